"""`gradaccum.memory`: `measure_activation_bytes` against byte counts worked out by hand, and
`parse_bytes` against byte counts written out as powers of 1000 and 1024.

What autograd saves (PyTorch 2.x, CPU), used for the hand counts below:
- Linear on a 2-D input (addmm): its input, for the weight's gradient, and the weight, for the
  input's gradient if the input requires grad. Both are the batch or a parameter here, so are left
  out, except when the input is an earlier layer's output.
- ReLU and Tanh: their output. `sum()`: nothing. `mse_loss`: the prediction and the target.
- `a * b`: both operands (whichever the other's gradient needs).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import LossSum, split_batch
from gradaccum.memory import measure_activation_bytes, parse_bytes


def _sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _naive_saved_bytes(model: nn.Module, batch, loss_fn) -> int:
    """What a measurement WITHOUT storage de-duplication or exclusions would report."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = loss_fn(model, batch)
    del result
    return total


def test_linear_relu_exact_bytes_float32_and_float64():
    torch.manual_seed(0)
    B, d_in, d_out = 3, 5, 7
    model = nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU())
    # Saved: x (the batch, excluded) and the ReLU output, B x d_out.
    assert measure_activation_bytes(model, torch.randn(B, d_in), _sum_loss) == B * d_out * 4
    model64 = model.double()
    x64 = torch.randn(B, d_in, dtype=torch.float64)
    assert measure_activation_bytes(model64, x64, _sum_loss) == B * d_out * 8


def test_input_requiring_grad_still_excludes_batch_and_weight():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU())
    x = torch.randn(4, 5, requires_grad=True)
    # Now the weight is saved too (for x's gradient), but it is a parameter: still only ReLU out.
    assert measure_activation_bytes(model, x, _sum_loss) == 4 * 7 * 4
    # Control: the raw saved bytes do include the input, the weight and the ReLU output.
    assert _naive_saved_bytes(model, x, _sum_loss) == 4 * 5 * 4 + 7 * 5 * 4 + 4 * 7 * 4


def test_mlp_exact_bytes_and_storage_saved_twice_counted_once():
    torch.manual_seed(0)
    B, d_in, hidden, d_out = 6, 4, 9, 2
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))
    batch = (torch.randn(B, d_in), torch.randn(B, d_out))
    # ReLU output (saved by ReLU and again by the second Linear: one storage), the prediction
    # (saved by mse_loss); x and the target belong to the batch, the weights to the model.
    expected = B * hidden * 4 + B * d_out * 4
    assert measure_activation_bytes(model, batch, _mse) == expected
    # Control: counting every save separately gives more, so de-duplication is what's tested.
    assert _naive_saved_bytes(model, batch, _mse) > expected


def test_same_tensor_saved_by_several_ops_is_counted_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU())

    def squared(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = m(x)
        return (h * h).sum()  # mul saves h twice; ReLU saved it already

    x = torch.randn(4, 3)
    assert measure_activation_bytes(model, x, squared) == 4 * 5 * 4
    assert _naive_saved_bytes(model, x, squared) == 4 * 3 * 4 + 3 * (4 * 5 * 4)


def test_saved_view_counts_its_whole_storage():
    torch.manual_seed(0)

    class HalfGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(5, 8)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return h[:, :4] * self.scale  # mul saves the VIEW h[:, :4] for the scale's gradient

    x = torch.randn(3, 5)
    # The view keeps all of h (3 x 8) alive, not just its 3 x 4 elements.
    assert measure_activation_bytes(HalfGate(), x, _sum_loss) == 3 * 8 * 4


def test_scales_linearly_with_batch_size():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )

    def measure(b: int) -> int:
        return measure_activation_bytes(model, (torch.randn(b, 16), torch.randn(b, 1)), _mse)

    small, large = measure(32), measure(64)
    assert 1.6 <= large / small <= 2.4
    # Exactly: ReLU out + Tanh out + prediction, per item.
    assert small == 32 * (64 + 64 + 1) * 4
    assert large == 64 * (64 + 64 + 1) * 4
    # Control: a wider hidden layer must show up in the number, so it is not a constant.
    wider = nn.Sequential(
        nn.Linear(16, 65), nn.ReLU(), nn.Linear(65, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    wide = measure_activation_bytes(wider, (torch.randn(32, 16), torch.randn(32, 1)), _mse)
    assert wide - small == 32 * 1 * 4


def test_micro_batch_view_does_not_count_the_batch_it_views():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    batch = (torch.randn(40, 8), torch.randn(40, 1))
    first = split_batch(batch, 10)[0]  # views into the 40-item tensors
    copied = tuple(t.clone() for t in first)
    view_bytes = measure_activation_bytes(model, first, _mse)
    assert view_bytes == measure_activation_bytes(model, copied, _mse) == 10 * (16 + 1) * 4
    assert measure_activation_bytes(model, batch, _mse) == 4 * view_bytes


def test_tensor_captured_outside_the_batch_is_counted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    in_batch = measure_activation_bytes(model, (x, y), _mse)
    captured = measure_activation_bytes(model, x, lambda m, b: F.mse_loss(m(b), y))
    assert captured - in_batch == y.numel() * 4


def test_accepts_losssum_and_leaves_model_and_grads_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    before = [p.detach().clone() for p in model.parameters()]
    x, labels = torch.randn(7, 4), torch.randint(0, 3, (7,))

    def ce(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
        return LossSum(F.cross_entropy(m(b[0]), b[1], reduction="sum"), len(b[1]))

    measured = measure_activation_bytes(model, (x, labels), ce)
    # ReLU out (7 x 6), log_softmax out (7 x 3), nll_loss's total_weight (a 0-dim float).
    assert measured == 7 * 6 * 4 + 7 * 3 * 4 + 4
    assert all(p.grad is None for p in model.parameters())
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_no_graph_means_zero_bytes():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    with torch.no_grad():
        assert measure_activation_bytes(model, torch.randn(3, 4), _sum_loss) == 0
    frozen = nn.Sequential(nn.Linear(4, 6), nn.ReLU()).requires_grad_(False)
    assert measure_activation_bytes(frozen, torch.randn(3, 4), _sum_loss) == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("1", 1),
        ("3b", 3),
        ("3B", 3),
        ("512MB", 512 * 1000**2),
        ("512mb", 512 * 1000**2),
        ("2G", 2 * 1000**3),
        ("1.5GB", 1_500_000_000),
        ("1TB", 1000**4),
        ("2GiB", 2 * 1024**3),
        ("2Gi", 2 * 1024**3),
        ("2gib", 2 * 1024**3),
        ("1.5KiB", 1536),
        ("512MiB", 512 * 1024**2),
        ("1TiB", 1024**4),
        (" 64 kib ", 64 * 1024),
        (".5K", 500),
        ("7.", 7),
        ("1.9", 1),  # whole bytes, rounded down
    ],
)
def test_parse_bytes_accepted_forms(value, expected):
    assert parse_bytes(value) == expected


def test_parse_bytes_decimal_counts_are_exact():
    cases = [
        ("1.001KB", 1000, 1001),
        ("1.003MB", 1000**2, 1_003_000),
        ("1.009GB", 1000**3, 1_009_000_000),
    ]
    for text, unit, expected in cases:
        # Control: the same product in binary floating point falls short of a whole byte.
        assert int(float(text[:5]) * unit) == expected - 1
        assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "value",
    ["lots", "", "  ", "2 parsecs", "-1GB", "+1GB", "1e9", "1.5.2", "2iB", "2 G B", "GB", "2PB"],
)
def test_parse_bytes_rejects_malformed_text_and_names_the_accepted_forms(value):
    with pytest.raises(ValueError, match="is not a size") as caught:
        parse_bytes(value)
    message = str(caught.value)
    assert repr(value) in message
    for unit in ("KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"):
        assert unit in message


@pytest.mark.parametrize("value", ["0", "0B", "0.5", "0.0009KB", 0, -4096])
def test_parse_bytes_rejects_less_than_one_byte(value):
    with pytest.raises(ValueError, match="must be more than 0 bytes"):
        parse_bytes(value)


@pytest.mark.parametrize("value", [True, 2.0, None, b"2GiB"])
def test_parse_bytes_rejects_other_types(value):
    with pytest.raises(TypeError, match="a str or an int"):
        parse_bytes(value)
