"""Tests for gradaccum.loss: reading a loss as (sum, count), and what that means for a window."""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import gradaccum
from gradaccum import LossSum
from gradaccum.loss import Term, counted_ahead, read_loss

IGNORE = -100


# --------------------------------------------------------------------------------------------
# read_loss: the contract of a loss_fn result
# --------------------------------------------------------------------------------------------


def test_scalar_tensor_is_a_mean_weighted_by_the_leading_dimension() -> None:
    w = torch.tensor(2.0, requires_grad=True)
    mean = w * 1.5
    value, weight, count = read_loss(mean, 4)
    assert (weight, count) == (4, 4)
    assert (value * weight).item() == 12.0  # the sum the mean stands for
    assert value.requires_grad  # the graph is kept for backward
    (value * weight).backward()
    assert w.grad.item() == 6.0


def test_one_element_tensor_counts_as_scalar() -> None:
    value, weight, count = read_loss(torch.tensor([0.5]), 2)
    assert value.shape == ()
    assert ((value * weight).item(), count) == (1.0, 2)


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (3, 3),
        (0, 0),
        (3.0, 3),
        (torch.tensor(5), 5),
        (torch.tensor(5.0), 5),
        (torch.tensor([7]), 7),
        (torch.tensor(0), 0),
        (np.int64(6), 6),  # a count summed with numpy
        (np.int32(2), 2),
        (np.uint8(4), 4),
        (np.float64(3.0), 3),
    ],
)
def test_loss_sum_counts(count: object, expected: int) -> None:
    value, weight, read = read_loss(LossSum(torch.tensor(2.5), count), 99)
    assert weight == 1
    assert read == expected
    assert type(read) is int
    assert value.item() == 2.5  # taken as it is: not multiplied by the batch size


@pytest.mark.parametrize(
    ("dtype", "largest"), [(torch.bfloat16, 256), (torch.float16, 2048), (torch.float32, 2**24)]
)
def test_a_count_in_a_float_dtype_too_coarse_for_it_is_refused(dtype, largest) -> None:
    """A count summed in bfloat16 (`mask.to(logits.dtype).sum()`) is exact only up to 256
    items: 257 ones sum to 256, a silently wrong denominator. Above the range where every
    integer is exact the count is refused, naming the integer count to use."""
    assert torch.ones(257, dtype=torch.bfloat16).sum().item() == 256  # the silent error
    exact = read_loss(LossSum(torch.tensor(1.0), torch.tensor(largest, dtype=dtype)), 1)
    assert exact[2] == largest
    with pytest.raises(ValueError, match=r"is exact only up to .*mask\.bool\(\)\.sum\(\)"):
        read_loss(LossSum(torch.tensor(1.0), torch.tensor(2 * largest, dtype=dtype)), 1)
    # NEGATIVE CONTROL: the same number as an integer tensor, or a Python float, is read.
    assert read_loss(LossSum(torch.tensor(1.0), torch.tensor(2 * largest)), 1)[2] == 2 * largest
    assert read_loss(LossSum(torch.tensor(1.0), float(2 * largest)), 1)[2] == 2 * largest


def test_a_coarse_count_is_refused_before_the_window_changes_anything() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=300, precision="bf16")
    x = torch.randn(600, 4, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]

    def loss_fn(m, b) -> LossSum:
        out = m(b)
        return LossSum(out.float().pow(2).sum(), torch.ones_like(out).sum())  # bf16 count

    with pytest.raises(ValueError, match="exact only up to 256"):
        acc.step(x, loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state


@pytest.mark.parametrize(
    ("result", "error", "pattern"),
    [
        (torch.ones(3), ValueError, r"the loss has shape \(3,\); it must be a scalar"),
        (torch.ones(2, 2), ValueError, "reduction='sum'"),
        (torch.tensor(3), ValueError, "must be a floating-point tensor"),
        (1.5, TypeError, r"return a scalar tensor.*number has no graph.*not loss\.item\(\)"),
        (np.float64(1.5), TypeError, r"numpy number has no graph.*loss\.detach\(\)\.numpy\(\)"),
        (np.array(1.5), TypeError, r"numpy number has no graph"),
        (None, TypeError, r"gradaccum\.LossSum\(value=sum_of_losses, count=items_counted\)"),
        ((torch.tensor(1.0), 2), TypeError, "loss_fn returned tuple"),
        (LossSum(torch.ones(4), 4), ValueError, r"LossSum\.value has shape \(4,\)"),
        (LossSum(2.0, 4), TypeError, "LossSum.value is a float; it must be a scalar"),
        (LossSum(torch.tensor(1.0), -1), ValueError, "must be >= 0"),
        (LossSum(torch.tensor(1.0), torch.tensor(-3)), ValueError, "must be >= 0"),
        (LossSum(torch.tensor(1.0), 2.5), ValueError, "must be a whole number"),
        (LossSum(torch.tensor(1.0), torch.tensor(2.5)), ValueError, "whole number"),
        (LossSum(torch.tensor(1.0), float("nan")), ValueError, "whole number"),
        (LossSum(torch.tensor(1.0), float("inf")), ValueError, "whole number"),
        (LossSum(torch.tensor(1.0), torch.tensor([1, 2])), ValueError, "0-dim"),
        (LossSum(torch.tensor(1.0), True), TypeError, "must be an int or a 0-dim tensor"),
        (LossSum(torch.tensor(1.0), "3"), TypeError, "must be an int or a 0-dim tensor"),
    ],
    ids=lambda v: None,
)
def test_bad_results_are_rejected_with_the_fix(result: object, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        read_loss(result, 4)


class _ModelOutput:
    """What a Hugging Face model returns: an object with `.loss` and `.logits`."""

    def __init__(self) -> None:
        self.loss, self.logits = torch.tensor(1.0), torch.zeros(4, 3)


@pytest.mark.parametrize(
    ("result", "where"),
    [
        ((torch.tensor(1.0), torch.zeros(4, 3)), r"return result\[0\] \(if it is the loss\) alone"),
        ({"loss": torch.tensor(1.0), "logits": torch.zeros(4, 3)}, r"return result\['loss'\]"),
        (_ModelOutput(), r"return result\.loss alone"),
    ],
    ids=["tuple", "dict", "model-output"],
)
def test_a_whole_model_output_is_refused_naming_where_its_loss_is(
    result: object, where: str
) -> None:
    with pytest.raises(TypeError, match=where) as info:
        read_loss(result, 4)
    assert "gradaccum.hf.causal_lm" in str(info.value)  # the exact token count, named


@pytest.mark.parametrize("result", [torch.tensor(1.0), LossSum(torch.tensor(2.0), 3)])
def test_a_counted_loss_without_a_graph_is_refused_where_a_backward_needs_one(
    result: object,
) -> None:
    assert read_loss(result, 4).count > 0  # read alone: a value, no backward needed
    with pytest.raises(ValueError, match=r"does not require grad.*torch\.no_grad"):
        read_loss(result, 4, needs_graph=True)
    assert read_loss(LossSum(torch.tensor(0.0), 0), 4, needs_graph=True).count == 0


# --------------------------------------------------------------------------------------------
# A window's objective: sum(value) / sum(count), compared with a plain float64 reference
# --------------------------------------------------------------------------------------------


class TinyTagger(torch.nn.Module):
    """Embedding + linear: per-token logits, so padding makes counts differ per micro-batch."""

    def __init__(self, vocab: int = 11, width: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def _ragged_token_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (8, 9), generator=generator)
    labels = torch.randint(0, 5, (8, 9), generator=generator)
    lengths = [9, 1, 2, 9, 3, 8, 1, 7]  # very ragged: per-micro-batch token counts differ a lot
    for row, length in enumerate(lengths):
        labels[row, length:] = IGNORE
    return tokens, labels


def _token_sum(model: torch.nn.Module, batch) -> LossSum:
    tokens, labels = batch
    logits = model(tokens)
    value = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return LossSum(value, (labels != IGNORE).sum())


def _token_mean(model: torch.nn.Module, batch) -> torch.Tensor:
    tokens, labels = batch
    return torch.nn.functional.cross_entropy(
        model(tokens).flatten(0, 1), labels.flatten(), ignore_index=IGNORE
    )


def _grads_seen_by_optimizer(model, optimizer) -> dict[str, list[torch.Tensor]]:
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(opt, args, kwargs) -> None:
        seen["grads"] = [p.grad.detach().clone() for p in model.parameters()]

    optimizer.register_step_pre_hook(hook)
    return seen


def _rel_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    flat_a = torch.cat([t.flatten() for t in a])
    flat_b = torch.cat([t.flatten() for t in b])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def _accumulated_grads(base: torch.nn.Module, batch, loss_fn, micro_batch_size: int):
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = _grads_seen_by_optimizer(model, optimizer)
    result = gradaccum.Accumulator(model, optimizer, micro_batch_size=micro_batch_size).step(
        batch, loss_fn
    )
    return seen["grads"], result


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3, 5, 8])
def test_token_mean_over_a_ragged_window_is_exact(micro_batch_size: int) -> None:
    torch.manual_seed(0)
    base = TinyTagger().double()
    batch = _ragged_token_batch()

    # Plain reference, no library: one full-batch backward of the token mean, float64.
    reference = copy.deepcopy(base)
    reference_loss = _token_mean(reference, batch)
    reference_grads = torch.autograd.grad(reference_loss, list(reference.parameters()))

    grads, result = _accumulated_grads(base, batch, _token_sum, micro_batch_size)
    tokens = int((batch[1] != IGNORE).sum())
    assert result.count == tokens
    assert result.loss == pytest.approx(reference_loss.item(), rel=1e-12)
    for got, want in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore::gradaccum._token_mean.TokenMeanWarning")  # the naive way warns
def test_negative_control_token_means_per_micro_batch_are_not_the_token_mean() -> None:
    """Returning each micro-batch's token mean as a plain scalar weights by sequences, not
    tokens. On ragged data that is a different objective; the gap must be large, which shows
    the exactness test above can fail."""
    torch.manual_seed(0)
    base = TinyTagger().double()
    batch = _ragged_token_batch()
    reference = copy.deepcopy(base)
    reference_grads = torch.autograd.grad(
        _token_mean(reference, batch), list(reference.parameters())
    )

    exact, _ = _accumulated_grads(base, batch, _token_sum, 2)
    wrong, _ = _accumulated_grads(base, batch, _token_mean, 2)
    assert _rel_gap(exact, list(reference_grads)) < 1e-12
    assert _rel_gap(wrong, list(reference_grads)) > 1e-2


def test_scalar_losses_with_an_uneven_last_micro_batch_are_exact() -> None:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    base = base.double()
    x = torch.randn(7, 4, dtype=torch.float64)
    y = torch.randn(7, 1, dtype=torch.float64) * 3

    def mse(m, b) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    reference = copy.deepcopy(base)
    reference_grads = torch.autograd.grad(mse(reference, (x, y)), list(reference.parameters()))
    grads, result = _accumulated_grads(base, (x, y), mse, 3)  # micro-batches of 3, 3, 1
    assert result.count == 7
    for got, want in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

    # Negative control, no library: averaging the three micro-batch means is a different
    # objective when the last micro-batch is smaller.
    naive = copy.deepcopy(base)
    mean_of_means = sum(mse(naive, (x[s : s + 3], y[s : s + 3])) for s in (0, 3, 6)) / 3
    naive_grads = torch.autograd.grad(mean_of_means, list(naive.parameters()))
    assert _rel_gap(list(naive_grads), list(reference_grads)) > 1e-2


def test_zero_count_micro_batch_contributes_nothing() -> None:
    torch.manual_seed(0)
    base = TinyTagger().double()
    tokens, labels = _ragged_token_batch()
    padded = labels.clone()
    padded[2:4] = IGNORE  # micro-batch 1 (rows 2, 3) counts no token at all

    with_empty, result = _accumulated_grads(base, (tokens, padded), _token_sum, 2)
    keep = torch.tensor([0, 1, 4, 5, 6, 7])
    without, result_without = _accumulated_grads(base, (tokens[keep], padded[keep]), _token_sum, 2)
    assert result.count == result_without.count == int((padded != IGNORE).sum())
    assert result.micro_batches == 4
    assert result.loss == pytest.approx(result_without.loss, rel=1e-12)
    for a, b in zip(with_empty, without, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0.0)


def test_normalize_sum_optimizes_the_plain_sum() -> None:
    torch.manual_seed(0)
    base = TinyTagger().double()
    batch = _ragged_token_batch()
    reference = copy.deepcopy(base)
    total = _token_sum(reference, batch).value
    reference_grads = torch.autograd.grad(total, list(reference.parameters()))

    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = _grads_seen_by_optimizer(model, optimizer)
    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3, normalize="sum")
    result = acc.step(batch, _token_sum)
    assert result.loss == pytest.approx(total.item(), rel=1e-12)
    for got, want in zip(seen["grads"], reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_loss_sum_is_exported_and_frozen() -> None:
    loss = gradaccum.LossSum(torch.tensor(1.0), 2)
    with pytest.raises(AttributeError):
        loss.count = 3  # type: ignore[misc]


class _Float32Norm(torch.nn.Module):
    """An RMSNorm that computes in float32 whatever its input, as Llama's and T5's do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class _TokenLoss:
    """A token-level LossSum over padded rows, optionally counting its tokens ahead."""

    def __init__(self, ahead: bool) -> None:
        if ahead:
            self.items_counted = lambda batch: (batch[1] != -100).sum()

    def __call__(self, model: torch.nn.Module, batch: Any) -> gradaccum.LossSum:
        x, labels = batch
        logits = model(x)
        value = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        return gradaccum.LossSum(value, (labels != -100).sum())


def _float32_inside_case() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), _Float32Norm(), torch.nn.Tanh(), torch.nn.Linear(16, 5)
    ).double()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(7, 9, 6, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 5, (7, 9), generator=generator)
    for row, length in enumerate([9, 2, 7, 4, 9, 1, 6]):
        labels[row, length:] = -100
    return model, (x, labels)


def _gap_after_step(ahead: bool) -> float:
    model, batch = _float32_inside_case()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=1.0)
    loss = _TokenLoss(ahead=False)(reference, batch)
    (loss.value / loss.count).backward()
    opt.step()
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=3
    )
    acc.step(batch, _TokenLoss(ahead))
    return max(
        float((a - b).abs().max() / b.abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.filterwarnings("ignore::gradaccum._token_mean.TokenMeanWarning")  # the naive way warns
def test_a_count_given_ahead_makes_float32_internal_models_exact() -> None:
    """`items_counted` lets each backward divide by the window's count, as the full batch does,
    so the float32 stage rounds alike: float64 exactness holds (`counted_ahead`)."""
    assert _gap_after_step(ahead=True) < 1e-13


def test_negative_control_without_the_count_ahead_the_float32_stage_rounds_differently() -> None:
    assert _gap_after_step(ahead=False) > 1e-10


def test_counted_ahead_reads_only_loss_functions_that_count() -> None:
    batches = [(None, torch.tensor([[1, -100]])), (None, torch.tensor([[2, 3]]))]
    assert counted_ahead(_TokenLoss(ahead=True), batches) == 3
    assert counted_ahead(_TokenLoss(ahead=False), batches) is None
    assert counted_ahead(lambda m, b: None, batches) is None


def test_token_mean_check_reads_shift_labels_and_stops_after_warning() -> None:
    """`shift_labels` (shifted by the pipeline) mark unscored tokens as `labels` do."""
    import warnings

    from gradaccum.loss import TokenMeanCheck, TokenMeanWarning

    padded = {"shift_labels": torch.tensor([[3, -100]])}
    scalar = torch.tensor(1.0)
    check = TokenMeanCheck()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        check.check(scalar, padded)
        check.check(scalar, padded)  # once only
        TokenMeanCheck().check(LossSum(scalar, 1), padded)  # negative control: a LossSum
        TokenMeanCheck().check(scalar, {"labels": torch.tensor([[0.5, -100.0]])})  # regression
    assert [w.category for w in record] == [TokenMeanWarning]


def _ignore_index_ce(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = (batch["x"], batch["target"]) if isinstance(batch, dict) else batch
    return torch.nn.functional.cross_entropy(model(x), y, ignore_index=IGNORE)


def _ignore_index_ce_sum(model: torch.nn.Module, batch: Any) -> LossSum:
    x, y = batch
    value = torch.nn.functional.cross_entropy(model(x), y, ignore_index=IGNORE, reduction="sum")
    return LossSum(value, (y != IGNORE).sum())


@pytest.mark.parametrize("drive", ["step", "micro_step", "accumulate_grad"])
@pytest.mark.parametrize("layout", ["tuple", "list", "dict"])
def test_a_plain_ignore_index_mean_warns_whatever_the_batch_layout(drive: str, layout: str) -> None:
    """`cross_entropy(..., ignore_index=-100)` returned plainly on an `(x, y)` batch is a mean
    over the scored targets weighted by rows: 0.5 off the full-batch step here. It warned only
    for a dict's `labels`; the targets of a tuple, a list or another key were never looked at."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(11, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (11,), generator=generator)
    y[[1, 2, 3, 7]] = IGNORE
    batch: Any = {"tuple": (x, y), "list": [x, y], "dict": {"x": x, "target": y}}[layout]
    model = torch.nn.Linear(6, 5).double()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if drive == "step":
            acc = gradaccum.Accumulator(
                model, torch.optim.SGD(model.parameters()), micro_batch_size=4
            )
            acc.step(batch, _ignore_index_ce)
        elif drive == "micro_step":
            acc = gradaccum.Accumulator(
                model, torch.optim.SGD(model.parameters()), accumulation_steps=3
            )
            for micro_batch in gradaccum.split_batch(batch, 4):
                acc.micro_step(micro_batch, _ignore_index_ce)
        else:
            gradaccum.accumulate_grad(model, batch, _ignore_index_ce, micro_batch_size=4)
    caught = [w for w in record if w.category is TokenMeanWarning]
    assert len(caught) == 1
    assert caught[0].filename == __file__
    where = "batch['target']" if layout == "dict" else "batch[1]"
    assert where in str(caught[0].message)
    assert "LossSum" in str(caught[0].message)


def test_negative_controls_no_ignore_index_warning_without_minus_100_integer_targets() -> None:
    """A LossSum, integer inputs (token ids), float targets holding -100.0 and targets without
    -100 never warn; the LossSum recipe is the exact one."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(11, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (11,), generator=generator)
    y[[1, 2, 3, 7]] = IGNORE
    model = torch.nn.Linear(6, 5).double()
    embedding = torch.nn.Embedding(9, 5).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenMeanWarning)
        gradaccum.accumulate_grad(model, (x, y), _ignore_index_ce_sum, micro_batch_size=4)
        gradaccum.accumulate_grad(model, (x, y.clamp(min=0)), _ignore_index_ce, micro_batch_size=4)
        ids = torch.randint(0, 9, (11,), generator=generator)
        gradaccum.accumulate_grad(
            embedding, (ids, y.clamp(min=0)), _ignore_index_ce, micro_batch_size=4
        )
        regression = (x, torch.full((11, 5), -100.0, dtype=torch.float64))
        gradaccum.accumulate_grad(
            model,
            regression,
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
            micro_batch_size=4,
        )
    full = copy.deepcopy(model)
    torch.nn.functional.cross_entropy(full(x), y, ignore_index=IGNORE).backward()
    gradaccum.accumulate_grad(model, (x, y), _ignore_index_ce_sum, micro_batch_size=4)
    for exact, accumulated in zip(full.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(accumulated.grad, exact.grad, rtol=1e-10, atol=0)


def test_unsigned_tensors_are_no_ignore_index_targets() -> None:
    """`uint8 == -100` wraps to 156: every `(uint8 image, y)` batch with a pixel of 156 warned,
    telling a correct row-mean loss to become a LossSum. Unsigned tensors cannot hold -100; the
    same batch with signed labels of -100 still warns (the control that the check is live)."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    generator = torch.Generator().manual_seed(4)
    images = torch.randint(0, 256, (9, 6), generator=generator).to(
        torch.uint8
    )  # uint16+: few ops on torch 2.4
    images[0, 0] = 156  # reads as -100 through the wrap
    y = torch.randn(9, 1, generator=generator, dtype=torch.float64)
    model = torch.nn.Linear(6, 1).double()

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(batch[0].double() / 255), batch[1])

    full = copy.deepcopy(model)
    loss_fn(full, (images, y)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenMeanWarning)
        gradaccum.accumulate_grad(model, (images, y), loss_fn, micro_batch_size=4)
        for exact, accumulated in zip(full.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(accumulated.grad, exact.grad, rtol=1e-10, atol=0)
        gradaccum.accumulate_grad(model, {"x": images, "labels": images}, _first, 4)
    signed = images.to(torch.int16).masked_fill(images.to(torch.int16) == 156, IGNORE)
    with pytest.warns(TokenMeanWarning, match="hold -100"):
        gradaccum.accumulate_grad(model, (signed, y), loss_fn, micro_batch_size=4)


def test_signed_integer_inputs_with_other_negative_values_are_no_ignore_index_targets() -> None:
    """Raw int16 PCM audio (`torchaudio.load(normalize=False)`) holds -100 among other negative
    samples: `(pcm, y)` with a row-mean loss warned of unscored labels. Targets are class indices
    and -100 only; the same clip with its other negative samples clipped to 0 still warns."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    generator = torch.Generator().manual_seed(5)
    pcm = (torch.randn(9, 6, generator=generator) * 3000).to(torch.int16)
    pcm[0, 0] = IGNORE
    y = torch.randn(9, 1, generator=generator, dtype=torch.float64)
    model = torch.nn.Linear(6, 1).double()

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(batch[0].double() / 32768), batch[1])

    full = copy.deepcopy(model)
    loss_fn(full, (pcm, y)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenMeanWarning)
        gradaccum.accumulate_grad(model, (pcm, y), loss_fn, micro_batch_size=4)
    for exact, accumulated in zip(full.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(accumulated.grad, exact.grad, rtol=1e-10, atol=0)
    labels_like = pcm.masked_fill((pcm < 0) & (pcm != IGNORE), 0)
    with pytest.warns(TokenMeanWarning, match="hold -100"):
        gradaccum.accumulate_grad(model, (labels_like, y), loss_fn, micro_batch_size=4)


def _first(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(batch["x"].double()).pow(2).mean()


@pytest.mark.parametrize("loss", ["mean", "loss_sum"])
@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_inputs_that_require_grad_step_exactly_and_their_grad_is_as_documented(
    loss: str, drive: str
) -> None:
    """docs/losses.md: a batch input with requires_grad=True steps the parameters exactly, and an
    input gradient taken with autograd.grad inside loss_fn (a PINN's) is exact; the input's own
    .grad is the full-batch one only for a plain scalar loss in step(), else off by a positive
    factor (its sign, FGSM's, is right)."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(11, 2, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (11,), generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = model.double()

    def loss_fn(m: torch.nn.Module, batch: Any) -> Any:
        inputs, targets = batch
        logits = m(inputs)
        slope = torch.autograd.grad(logits.sum(), inputs, create_graph=True)[0]
        rows = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        rows = rows + slope.pow(2).sum(1)  # a per-row input-gradient penalty
        return rows.mean() if loss == "mean" else LossSum(rows.sum(), len(rows))

    reference, leaf = copy.deepcopy(model), x.clone().requires_grad_(True)
    objective = loss_fn(reference, (leaf, y))
    (objective if loss == "mean" else objective.value / objective.count).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    full_batch_input_grad = leaf.grad

    inputs = x.clone().requires_grad_(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if drive == "step":
        gradaccum.Accumulator(model, optimizer, micro_batch_size=3).step((inputs, y), loss_fn)
    else:
        acc = gradaccum.Accumulator(model, optimizer, accumulation_steps=4)
        for start in range(0, 11, 3):
            acc.micro_step((inputs[start : start + 3], y[start : start + 3]), loss_fn)
        assert acc.flush().stepped is False  # the fourth micro-batch closed the window
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    ratio = inputs.grad / full_batch_input_grad
    assert bool((ratio > 0).all())
    exact = bool(torch.allclose(ratio, torch.ones_like(ratio), rtol=1e-10, atol=0))
    assert exact == (loss == "mean" and drive == "step")


def _mean_times_count(model: torch.nn.Module, batch: Any) -> LossSum:
    """The usual 'mean to sum' conversion: nan * 0 on a micro-batch whose targets are all -100."""
    x, y = batch
    count = (y != IGNORE).sum()
    return LossSum(
        torch.nn.functional.cross_entropy(model(x), y, ignore_index=IGNORE) * count, count
    )


@pytest.mark.parametrize("drive", ["step", "micro_step", "accumulate_grad", "terms"])
def test_a_mean_times_a_zero_count_is_refused_naming_the_sum(drive: str) -> None:
    """Rows 3-5 have no target: their micro-batch's mean is nan, and nan * 0 made the whole
    window non-finite, silently skipped where the full batch steps. It is refused naming
    reduction='sum', changing nothing; the sum itself is exact."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(9, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (9,), generator=generator)
    y[3:6] = IGNORE
    model = torch.nn.Linear(4, 3).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = copy.deepcopy(model.state_dict())

    def as_terms(m: torch.nn.Module, b: Any) -> Any:
        loss = _mean_times_count(m, b)
        return LossSum.terms(ce=(loss.value, loss.count))

    def run() -> None:
        if drive in ("step", "terms"):
            acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3)
            acc.step((x, y), _mean_times_count if drive == "step" else as_terms)
        elif drive == "micro_step":
            acc = gradaccum.Accumulator(model, optimizer, accumulation_steps=3)
            for micro_batch in gradaccum.split_batch((x, y), 3):
                acc.micro_step(micro_batch, _mean_times_count)
        else:
            gradaccum.accumulate_grad(model, (x, y), _mean_times_count, micro_batch_size=3)

    with pytest.raises(ValueError, match=r"counts 0 items but is nan.*reduction='sum'"):
        run()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])
    assert all(p.grad is None for p in model.parameters())

    full = copy.deepcopy(model)
    torch.nn.functional.cross_entropy(full(x), y, ignore_index=IGNORE).backward()
    gradaccum.accumulate_grad(model, (x, y), _ignore_index_ce_sum, micro_batch_size=3)
    for exact, accumulated in zip(full.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(accumulated.grad, exact.grad, rtol=1e-10, atol=0)


def test_a_detection_loss_dict_returned_whole_is_refused_naming_its_total() -> None:
    """torchvision-style detectors return a dict of losses; returned whole it was refused with
    no hint (a dict without a 'loss' key). The message names sum(result.values()); nothing
    changes (parameters bitwise, no .grad, no optimizer state)."""
    model = torch.nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images = [torch.randn(3, 4 + i, 5, dtype=torch.float64) for i in range(5)]
    targets = [{"labels": torch.tensor([i])} for i in range(5)]

    def loss_dict(m: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        pooled = torch.stack([image.mean((1, 2)) for image in batch[0]])
        return {"loss_classifier": m(pooled).pow(2).mean(), "loss_box_reg": m(pooled).abs().mean()}

    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=2)
    with pytest.raises(TypeError, match=r"sum\(result\.values\(\)\)"):
        acc.step((images, targets), loss_dict)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state
    fixed = acc.step((images, targets), lambda m, b: sum(loss_dict(m, b).values()))
    assert fixed.stepped  # the fix


# --------------------------------------------------------------------------------------------
# A per-sample weighted mean, sum(w * loss) / sum(w), returned as a plain scalar
# --------------------------------------------------------------------------------------------


def _weighted_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(10, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (10,), generator=generator)
    return x, y, torch.rand(10, generator=generator, dtype=torch.float64) * 3


def _per_sample(model: torch.nn.Module, b: Any) -> torch.Tensor:
    return b[2] * torch.nn.functional.cross_entropy(model(b[0]), b[1], reduction="none")


def test_a_plain_weighted_mean_warns_naming_terms_which_are_the_full_batch_step() -> None:
    """Per-sample weights: `sum(w * l) / sum(w)` read as a row mean is silently another
    objective (the control: 10 = 3 + 3 + 3 + 1 is far off); the warning's fix is exact."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    batch = _weighted_batch()
    torch.manual_seed(0)
    start = torch.nn.Linear(6, 4).double()
    full = copy.deepcopy(start)
    optimizer = torch.optim.SGD(full.parameters(), lr=1.0)
    (_per_sample(full, batch).sum() / batch[2].sum()).backward()
    optimizer.step()

    def plain(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return _per_sample(m, b).sum() / b[2].sum()

    def terms(m: torch.nn.Module, b: Any) -> LossSum:
        return LossSum.terms(loss=(_per_sample(m, b).sum(), b[2].sum()))

    models = {}
    for name, loss_fn in (("plain", plain), ("terms", terms)):
        model = models[name] = copy.deepcopy(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.step(batch, loss_fn)
        messages = [str(w.message) for w in caught if w.category is TokenMeanWarning]
        if name == "plain":
            assert len(messages) == 1
            assert caught[0].filename == __file__
            assert "weighted or masked mean" in messages[0]
            assert "LossSum.terms(loss=((w * loss).sum(), w.sum()))" in messages[0]
        else:
            assert messages == []
    for exact, plain_step, reference in zip(
        models["terms"].parameters(), models["plain"].parameters(), full.parameters(), strict=True
    ):
        torch.testing.assert_close(exact, reference, rtol=1e-10, atol=0)
        assert float((plain_step - reference).detach().abs().max()) > 1e-3  # the control


def test_row_means_written_as_a_divided_sum_do_not_warn_and_a_masked_mean_does() -> None:
    """`sum / len(x)`, a sum over rows x features divided by their number, kl_div's
    'batchmean' and the mean of two heads' losses are row means; a masked mean is not."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    x, y, _ = _weighted_batch()
    functional = torch.nn.functional
    row_means = [
        lambda m, b: functional.cross_entropy(m(b[0]), b[1], reduction="sum") / len(b[0]),
        lambda m, b: m(b[0]).pow(2).sum() / m(b[0]).numel(),
        lambda m, b: functional.kl_div(
            m(b[0]).log_softmax(-1), torch.full((len(b[0]), 4), 0.25), reduction="batchmean"
        ),
        lambda m, b: torch.stack([functional.cross_entropy(m(b[0]), b[1])] * 2).sum() / 2,
    ]
    model = torch.nn.Linear(6, 4).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenMeanWarning)
        for loss_fn in row_means:
            gradaccum.accumulate_grad(model, (x, y), loss_fn, micro_batch_size=3)
    kept = (y != 0).double()  # control: a mean over the kept rows only

    def masked(m: torch.nn.Module, b: Any) -> torch.Tensor:
        per_row = functional.cross_entropy(m(b[0]), b[1], reduction="none")
        return (b[2] * per_row).sum() / b[2].sum()

    with pytest.warns(TokenMeanWarning, match="weighted or masked mean"):
        gradaccum.accumulate_grad(model, (x, y, kept), masked, micro_batch_size=3)


class _CTCHead(torch.nn.Module):
    """A Hugging Face `*ForCTC` loss by hand: labels padded with -100, targets concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.ce_head = torch.nn.Linear(3, 6), torch.nn.Linear(3, 6)

    def forward(self, batch: dict, hybrid: bool = False) -> torch.Tensor:
        log_probs = self.proj(batch["x"]).log_softmax(-1).transpose(0, 1)  # (T, B, C)
        labels = batch["labels"]
        scored = labels >= 0
        loss = torch.nn.functional.ctc_loss(
            log_probs,
            labels.masked_select(scored),
            batch["frames"],
            scored.sum(-1),
            zero_infinity=True,
        )
        if hybrid:  # CTC plus an attention decoder's token mean (ESPnet's hybrid ASR)
            logits = self.ce_head(batch["x"][:, : labels.shape[1]])
            return 0.3 * loss + 0.7 * torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten()
            )
        return loss


def test_a_ctc_mean_over_minus_100_padded_labels_is_a_row_mean_and_not_warned() -> None:
    """`Wav2Vec2ForCTC(ctc_loss_reduction="mean")`'s loss returned as it is: CTC divides each
    row by its own target length, then averages rows, so the plain scalar is exact. The -100
    padding of its labels warned `TokenMeanWarning`, whose LossSum recipe would change the
    objective; the loss's graph says CTC now. A CE token mean beside it still warns."""
    generator = torch.Generator().manual_seed(0)
    rows, lengths = 7, [3, 5, 2, 4, 1, 5, 3]
    labels = torch.full((rows, 5), -100)
    for row, length in enumerate(lengths):
        labels[row, :length] = torch.randint(1, 6, (length,), generator=generator)
    batch = {
        "x": torch.randn(rows, 12, 3, generator=generator, dtype=torch.float64),
        "frames": torch.tensor([12, 11, 9, 12, 7, 12, 10]),
        "labels": labels,
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        start = _CTCHead().double()
    reference = copy.deepcopy(start)
    reference(batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    model = copy.deepcopy(start)
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=3
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TokenMeanWarning, nor any other
        acc.step(batch, lambda m, b: m(b))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    twin = copy.deepcopy(start)
    hybrid = gradaccum.Accumulator(
        twin, torch.optim.SGD(twin.parameters(), lr=0.5), micro_batch_size=3
    )
    with pytest.warns(gradaccum.loss.TokenMeanWarning, match="-100"):
        hybrid.step(batch, lambda m, b: m(b, hybrid=True))


def test_a_negated_weighted_mean_warns_naming_terms_which_are_the_full_batch_step() -> None:
    """A class-weighted NLL by hand, `-(w[y] * log_p).sum() / w[y].sum()`, and the same under
    a constant factor: the negation on the numerator (or over the quotient) hid the division
    from the check, silently 0.4 off. Both warn now, and the term they name is exact."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    x, y, _ = _weighted_batch()
    classes = torch.tensor([1.0, 2.0, 5.0, 0.5], dtype=torch.float64)
    functional = torch.nn.functional

    def log_p(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return functional.log_softmax(m(b[0]), -1).gather(1, b[1][:, None]).squeeze(1)

    torch.manual_seed(0)
    start = torch.nn.Linear(6, 4).double()
    full = copy.deepcopy(start)
    (-(classes[y] * log_p(full, (x, y))).sum() / classes[y].sum()).backward()
    torch.optim.SGD(full.parameters(), lr=1.0).step()
    plains = [
        lambda m, b: -(classes[b[1]] * log_p(m, b)).sum() / classes[b[1]].sum(),
        lambda m, b: -((classes[b[1]] * log_p(m, b)).sum() / classes[b[1]].sum()),
        lambda m, b: 0.5 * (classes[b[1]] * log_p(m, b)).sum() / -classes[b[1]].sum() * 2.0,
    ]
    steps = []
    for loss_fn in plains:
        model = copy.deepcopy(start)
        acc = gradaccum.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=3
        )
        with pytest.warns(TokenMeanWarning, match="weighted or masked mean"):
            acc.step((x, y), loss_fn)
        steps.append(model)
    model = copy.deepcopy(start)
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=3
    )

    def terms(m: torch.nn.Module, b: Any) -> LossSum:
        return LossSum.terms(nll=(-(classes[b[1]] * log_p(m, b)).sum(), classes[b[1]].sum()))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.step((x, y), terms)
    for exact, reference, *plain in zip(
        model.parameters(), full.parameters(), *(s.parameters() for s in steps), strict=True
    ):
        torch.testing.assert_close(exact, reference, rtol=1e-10, atol=0)
        for other in plain:  # the controls: each plain form read as a row mean
            assert float((other - reference).detach().abs().max()) > 1e-3


def _multi_task_batch() -> dict[str, torch.Tensor]:
    """Tabular rows with two regression targets, each missing for some rows (NaN-free: masked)."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(11, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(11, 2, generator=generator, dtype=torch.float64)
    known = torch.rand(11, 2, generator=generator) > 0.4
    known[0] = True
    return {"x": x, "y": y, "known": known}


def test_a_masked_mean_returned_plainly_warns_and_its_loss_sum_is_the_full_batch_step() -> None:
    """Labels missing for some rows or outputs: `F.mse_loss(pred[known], y[known])` (and a sum
    of such means, one per task) divides by the known labels of each micro-batch, silently 0.1
    off the full-batch step before. It warns now naming `LossSum`, which is exact; row means
    picked by an index (`out[idx]`, the last step of each row) and a LossSum stay quiet."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    batch = _multi_task_batch()
    functional = torch.nn.functional
    torch.manual_seed(0)
    start = torch.nn.Linear(6, 2).double()

    def masked(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return functional.mse_loss(m(b["x"])[b["known"]], b["y"][b["known"]])

    def tasks(m: torch.nn.Module, b: Any) -> torch.Tensor:
        out, known = m(b["x"]), b["known"]
        first = functional.mse_loss(out[:, 0][known[:, 0]], b["y"][:, 0][known[:, 0]])
        return first + 0.5 * (out[:, 1] - b["y"][:, 1])[known[:, 1]].abs().mean()

    def counted(m: torch.nn.Module, b: Any) -> LossSum:
        squared = functional.mse_loss(m(b["x"])[b["known"]], b["y"][b["known"]], reduction="sum")
        return LossSum(squared, count=b["known"].sum())

    full = copy.deepcopy(start)
    masked(full, batch).backward()
    torch.optim.SGD(full.parameters(), lr=1.0).step()
    models = {}
    for name, loss_fn in (("masked", masked), ("tasks", tasks), ("counted", counted)):
        model = models[name] = copy.deepcopy(start)
        acc = gradaccum.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=3
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.step(batch, loss_fn)
        told = [str(w.message) for w in caught if w.category is TokenMeanWarning]
        assert len(told) == (name != "counted"), told
        assert all("mean over" in text and "LossSum(" in text for text in told)
    for exact, plain, reference in zip(
        models["counted"].parameters(),
        models["masked"].parameters(),
        full.parameters(),
        strict=True,
    ):
        torch.testing.assert_close(exact, reference, rtol=1e-10, atol=0)
        assert float((plain - reference).detach().abs().max()) > 1e-3  # the control
    quiet = [
        lambda m, b: functional.mse_loss(m(b["x"])[torch.arange(len(b["x"])), 1], b["y"][:, 1]),
        lambda m, b: functional.mse_loss(m(b["x"])[:, [1]], b["y"][:, [1]]),
        lambda m, b: functional.cross_entropy(m(b["x"]), b["known"][:, 0].long()),
        counted,
    ]
    model = copy.deepcopy(start)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loss_fn in quiet:
            gradaccum.accumulate_grad(model, batch, loss_fn, micro_batch_size=3)


def test_a_node_mean_over_a_list_of_graphs_warns_and_its_loss_sum_is_the_full_batch_step() -> None:
    """Graphs as items (a list of per-graph dicts, collated in loss_fn) with a label per node:
    a plain `cross_entropy` mean over the micro-batch's nodes divides by their number, which
    varies per graph: silently 0.09 off the full-batch step. It warns naming LossSum (a mean
    over 13 targets is no mean over 3 rows), and LossSum over the nodes is exact."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    generator = torch.Generator().manual_seed(0)
    graphs = [
        {
            "x": torch.randn(n, 3, generator=generator, dtype=torch.float64),
            "edges": torch.randint(0, n, (2, 2 * n), generator=generator),
            "y": torch.randint(0, 4, (n,), generator=generator),
        }
        for n in (3, 5, 5, 2, 6, 7, 3)
    ]

    def nodes(m: torch.nn.Module, b: list) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = []
        for g in b:  # one message-passing step per graph, on its own nodes
            h = m(g["x"])
            outputs.append(h + torch.zeros_like(h).index_add_(0, g["edges"][1], h[g["edges"][0]]))
        return torch.cat(outputs), torch.cat([g["y"] for g in b])

    def plain(m: torch.nn.Module, b: list) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(*nodes(m, b))

    def counted(m: torch.nn.Module, b: list) -> LossSum:
        logits, y = nodes(m, b)
        return LossSum(torch.nn.functional.cross_entropy(logits, y, reduction="sum"), len(y))

    torch.manual_seed(0)
    start = torch.nn.Linear(3, 4).double()
    full = copy.deepcopy(start)
    plain(full, graphs).backward()
    torch.optim.SGD(full.parameters(), lr=1.0).step()
    steps = {}
    for name, loss_fn in (("plain", plain), ("counted", counted)):
        model = steps[name] = copy.deepcopy(start)
        acc = gradaccum.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=3
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.step(graphs, loss_fn)
        told = [str(w.message) for w in caught if w.category is TokenMeanWarning]
        assert len(told) == (name == "plain"), told
        assert all("mean over 13 values" in text and "the nodes" in text for text in told)
    for exact, plain_step, reference in zip(
        steps["counted"].parameters(), steps["plain"].parameters(), full.parameters(), strict=True
    ):
        torch.testing.assert_close(exact, reference, rtol=1e-10, atol=0)
        assert float((plain_step - reference).detach().abs().max()) > 1e-3  # the control


def _per_row_masked_batch(valid_per_row: list[int]) -> tuple[torch.Tensor, ...]:
    """Rows of 6 steps whose first `valid_per_row[i]` are valid (a token mask)."""
    generator = torch.Generator().manual_seed(5)
    rows = len(valid_per_row)
    x = torch.randn(rows, 6, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(rows, 6, generator=generator, dtype=torch.float64)
    valid = torch.zeros(rows, 6, dtype=torch.bool)
    for row, kept in enumerate(valid_per_row):
        valid[row, :kept] = True
    return x, y, valid


def _masked_token_mean(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = model(batch[0]).squeeze(-1)
    return ((out - batch[1]) ** 2)[batch[2]].mean()


def _counted_tokens(model: torch.nn.Module, batch: Any) -> LossSum:
    out = model(batch[0]).squeeze(-1)
    return LossSum(((out - batch[1]) ** 2)[batch[2]].sum(), count=batch[2].sum())


def test_a_masked_mean_whose_count_is_a_multiple_of_the_rows_warns_when_it_changes() -> None:
    """`loss[mask].mean()` with 3 valid tokens in every row of one micro-batch and 5 in every row
    of the next divides by 4 x 3 and 4 x 5: whole multiples of the rows, taken for row means,
    silently 0.1 off the full-batch step. It warns now (TokenMeanWarning naming LossSum), and
    LossSum is exact; the same count per row everywhere (exact) stays quiet, also when it
    differs between windows."""
    import warnings

    from gradaccum.loss import TokenMeanWarning

    batch = _per_row_masked_batch([3] * 4 + [5] * 4)
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 1).double()
    full = copy.deepcopy(start)
    _masked_token_mean(full, batch).backward()
    reference = [p.grad for p in full.parameters()]
    for loss_fn, warned in ((_masked_token_mean, True), (_counted_tokens, False)):
        model = copy.deepcopy(start)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gradaccum.accumulate_grad(model, batch, loss_fn, micro_batch_size=4)
        told = [str(w.message) for w in caught if w.category is TokenMeanWarning]
        assert len(told) == warned, told
        assert all("3 per row" in t and "5 per row" in t and "LossSum(" in t for t in told)
        pairs = zip(model.parameters(), reference, strict=True)
        gaps = [float((p.grad - r).abs().max()) for p, r in pairs]
        if warned:
            assert max(gaps) > 1e-3  # the control: the plain scalar is off
        else:
            for p, r in zip(model.parameters(), reference, strict=True):
                torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=0)
    # The same Accumulator.step warns too.
    model = copy.deepcopy(start)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_size=4)
    with pytest.warns(TokenMeanWarning, match="per row"):
        acc.step(batch, _masked_token_mean)
    # Quiet: the same valid tokens per row in every micro-batch (exact), and windows of
    # different counts per row, each the same inside (window 1: 3 per row, window 2: 5).
    even = _per_row_masked_batch([4] * 8)
    streamed = [_per_row_masked_batch([3] * 4), _per_row_masked_batch([3] * 4)]
    streamed += [_per_row_masked_batch([5] * 4), _per_row_masked_batch([5] * 4)]
    model = copy.deepcopy(start)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradaccum.accumulate_grad(copy.deepcopy(start), even, _masked_token_mean, 4)
        for micro_batch in streamed:
            acc.micro_step(micro_batch, _masked_token_mean)


# --------------------------------------------------------------------------------------------
# A multi-task model's losses returned together (a dict or a tuple of scalars)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(5, 8)
        self.cls, self.reg = torch.nn.Linear(8, 3), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.trunk(x))
        return {"cls": self.cls(hidden), "reg": self.reg(hidden)}


def _two_tasks() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    rows = 11
    has_cls = torch.rand(rows, generator=generator) < 0.5
    batch = {
        "x": torch.randn(rows, 5, generator=generator, dtype=torch.float64),
        "y": torch.randint(0, 3, (rows,), generator=generator),
        "target": torch.randn(rows, 2, generator=generator, dtype=torch.float64),
        "has_cls": has_cls,  # each row labelled for one task or both
        "has_reg": ~has_cls | (torch.rand(rows, generator=generator) < 0.3),
    }
    return _TwoHeads().double(), batch


def _task_sums(m: torch.nn.Module, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out = m(b["x"])
    cls = torch.nn.functional.cross_entropy(
        out["cls"][b["has_cls"]], b["y"][b["has_cls"]], reduction="sum"
    )
    reg = torch.nn.functional.mse_loss(
        out["reg"][b["has_reg"]], b["target"][b["has_reg"]], reduction="sum"
    )
    return cls, reg


@pytest.mark.parametrize("container", ["dict", "tuple"])
def test_several_task_losses_returned_together_are_refused_naming_terms_and_terms_are_exact(
    container: str,
) -> None:
    """A multi-task model's losses returned as `{"cls": ..., "reg": ...}` got no hint, and as a
    tuple the message said to return `result[0]` alone: following it trains one task and drops
    the other, silently. Both name the total and `LossSum.terms`, changing nothing; the terms
    recipe (a task missing from some micro-batches counts 0 there) is the full-batch step."""
    model, batch = _two_tasks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model.state_dict())

    def together(m: torch.nn.Module, b: Any) -> Any:
        cls, reg = _task_sums(m, b)
        means = cls / b["has_cls"].sum(), reg / (2 * b["has_reg"].sum())
        return dict(zip(("cls", "reg"), means, strict=True)) if container == "dict" else means

    acc = gradaccum.Accumulator(model, optimizer, micro_batch_size=1)
    with pytest.raises(TypeError, match=r"LossSum\.terms") as refused:
        acc.step(batch, together)
    assert "drops the others" in str(refused.value)
    assert "result[0]" not in str(refused.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state

    def terms(m: torch.nn.Module, b: Any) -> gradaccum.LossSum:  # the fix the message names
        cls, reg = _task_sums(m, b)
        return gradaccum.LossSum.terms(
            cls=(cls, b["has_cls"].sum()), reg=Term(reg, count=2 * b["has_reg"].sum(), weight=0.5)
        )

    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        ref_optimizer.zero_grad()
        cls, reg = _task_sums(reference, batch)
        (cls / batch["has_cls"].sum() + 0.5 * reg / (2 * batch["has_reg"].sum())).backward()
        ref_optimizer.step()
    for micro_batch_size in (1, 3):
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
        acc = gradaccum.Accumulator(trained, opt, micro_batch_size=micro_batch_size)
        for _ in range(2):
            assert acc.step(batch, terms).stepped
        for got, want in zip(trained.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


# --------------------------------------------------------------------------------------------
# Hand-written LM token means (eleventh round): chunked CE, `l[mask].sum()`, nanmean, RPO
# --------------------------------------------------------------------------------------------


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def _packed_lm_batch() -> dict[str, torch.Tensor]:
    """7 rows of 9 tokens; the targets kept: not across a document start, not padding."""
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 11, (7, 9), generator=generator)
    keep = torch.rand(7, 8, generator=generator) > 0.3
    keep[0] = True  # rows of very different counts
    keep[1, 1:] = False
    return {"ids": ids, "keep": keep}


def _token_losses(m: torch.nn.Module, b: dict) -> torch.Tensor:
    logits = m(b["ids"])[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), b["ids"][:, 1:], reduction="none"
    )


def _chunked(m: torch.nn.Module, b: dict) -> torch.Tensor:
    """A cross-entropy computed in chunks over the sequence (to save memory), then divided."""
    logits, targets = m(b["ids"])[:, :-1], b["ids"][:, 1:].masked_fill(~b["keep"], -100)
    total = 0
    for chunk, target in zip(logits.split(3, dim=1), targets.split(3, dim=1), strict=True):
        total = total + torch.nn.functional.cross_entropy(
            chunk.flatten(0, 1), target.flatten(), reduction="sum"
        )
    return total / b["keep"].sum()


def _picked(m: torch.nn.Module, b: dict) -> torch.Tensor:
    return _token_losses(m, b)[b["keep"]].sum() / b["keep"].sum()


def _nanmean(m: torch.nn.Module, b: dict) -> torch.Tensor:
    return _token_losses(m, b).masked_fill(~b["keep"], float("nan")).nanmean()


def _rpo(m: torch.nn.Module, b: dict) -> torch.Tensor:
    """A per-row mean plus a token-mean NLL term (RPO's SFT term, `-log_p.sum() / tokens`)."""
    per_row = (_token_losses(m, b) * b["keep"]).sum(1)
    return (0.1 * per_row).sigmoid().mean() + per_row.sum() / b["keep"].sum()


def _rpo_terms(m: torch.nn.Module, b: dict) -> LossSum:
    per_row = (_token_losses(m, b) * b["keep"]).sum(1)
    return LossSum.terms(
        pref=((0.1 * per_row).sigmoid().sum(), len(per_row)), sft=(per_row.sum(), b["keep"].sum())
    )


def _lm_token_sum(m: torch.nn.Module, b: dict) -> LossSum:
    return LossSum(_token_losses(m, b)[b["keep"]].sum(), b["keep"].sum())


def _sgd_step_caught(
    start: torch.nn.Module, batch: Any, loss_fn: Any, size: int
) -> tuple[torch.nn.Module, list[warnings.WarningMessage]]:
    """A copy of `start` after one `Accumulator.step` (SGD, lr 0.5) of `loss_fn` on `batch` in
    micro-batches of `size`, and the warnings the step raised."""
    model = copy.deepcopy(start)
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=size
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step(batch, loss_fn)
    return model, caught


@pytest.mark.parametrize("micro_batch_size", [1, 3])
@pytest.mark.parametrize(
    ("plain", "exact"),
    [
        (_chunked, _lm_token_sum),
        (_picked, _lm_token_sum),
        (_nanmean, _lm_token_sum),
        (_rpo, _rpo_terms),
    ],
)
def test_hand_written_lm_token_means_warn_and_their_loss_sums_are_the_full_batch_step(
    plain: Any, exact: Any, micro_batch_size: int
) -> None:
    """A token mean written by hand as a sum divided by the tokens, with its numerator in a
    form the check did not read (chunks added up, `l[mask].sum()`, `nanmean`), or as one term
    beside a row mean (RPO), or over micro-batches of one row (any count is a multiple of 1),
    was read as a row mean, 0.1-1.6 off silently. Each warns now (TokenMeanWarning naming
    LossSum), and the LossSum it names is the full-batch step within 1e-10."""
    from gradaccum.loss import TokenMeanWarning

    batch = _packed_lm_batch()
    torch.manual_seed(0)
    start = _TinyLM().double()
    full = copy.deepcopy(start)
    plain(full, batch).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    for loss_fn in (plain, exact):
        model, caught = _sgd_step_caught(start, batch, loss_fn, micro_batch_size)
        told = [str(w.message) for w in caught]
        gaps = [
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), full.parameters(), strict=True)
        ]
        if loss_fn is plain:
            assert len(told) == 1, told
            assert caught[0].category is TokenMeanWarning
            assert "LossSum" in told[0]
            assert max(gaps) > 1e-3  # the control: read as a row mean
        else:
            assert told == []
            for got, want in zip(model.parameters(), full.parameters(), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_lm_row_means_written_by_hand_stay_quiet() -> None:
    """No false alarm: `sum / numel`, chunks summed over all positions divided by their number,
    a token mean plus an L2 penalty over the weights, and a per-row mean of token means."""
    batch = _packed_lm_batch()
    model = _TinyLM().double()
    quiet = [
        lambda m, b: _token_losses(m, b).sum() / _token_losses(m, b).numel(),
        lambda m, b: _chunked(m, {**b, "keep": torch.ones_like(b["keep"])}) * 1.0,
        lambda m, b: (
            _token_losses(m, b).mean() + 1e-3 * sum(p.pow(2).sum() for p in m.parameters()) / 2
        ),
        lambda m, b: (
            (_token_losses(m, b) * b["keep"]).sum(1) / b["keep"].sum(1).clamp(min=1)
        ).mean(),
    ]
    for micro_batch_size in (1, 3):
        for loss_fn in quiet:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                gradaccum.accumulate_grad(model, batch, loss_fn, micro_batch_size=micro_batch_size)


def test_a_token_count_equal_to_the_number_of_micro_batches_is_not_told_to_be_removed() -> None:
    """Rows of one token mean each (micro-batches of one row) dividing by their token count:
    when two rows happened to count as many tokens as the window has micro-batches (7), the
    check took it for `loss / accumulation_steps` and said to remove the division (a
    CopiedLoopWarning whose advice is wrong). Only a division by that number from the first
    micro-batch on is such a line; the real one still warns."""
    from gradaccum.loss import CopiedLoopWarning, TokenMeanWarning

    batch = _packed_lm_batch()
    batch["keep"][:] = False
    for row, count in enumerate([5, 7, 7, 3, 6, 2, 8]):
        batch["keep"][row, :count] = True
    model = _TinyLM().double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradaccum.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=1
        ).step(batch, _picked)
    assert [w.category for w in caught] == [TokenMeanWarning], [str(w.message) for w in caught]
    with pytest.warns(CopiedLoopWarning, match="accumulation_steps"):
        gradaccum.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=1
        ).step(batch, lambda m, b: _token_losses(m, b).mean() / 7)


# --------------------------------------------------------------------------------------------
# Preference pairs laid out as rows (eleventh round): interleaved or halves, cut by the split
# --------------------------------------------------------------------------------------------


def _pair_scores(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A sequence's summed log-probability of its own next tokens."""
    log_p = m(ids)[:, :-1].log_softmax(-1)
    return log_p.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(1)


def _pairs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(12)
    return torch.randint(0, 11, (7, 6), generator=generator), torch.randint(
        0, 11, (7, 6), generator=generator
    )


def _interleaved(m: torch.nn.Module, b: dict) -> torch.Tensor:
    scores = _pair_scores(m, b["ids"])
    return -torch.nn.functional.logsigmoid(0.1 * (scores[0::2] - scores[1::2])).mean()


def _halves(m: torch.nn.Module, b: dict) -> torch.Tensor:
    scores = _pair_scores(m, b["ids"])
    chosen, rejected = scores.chunk(2)
    return -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)).mean()


def _per_row_pairs(m: torch.nn.Module, b: dict) -> torch.Tensor:
    margin = _pair_scores(m, b["chosen"]) - _pair_scores(m, b["rejected"])
    return -torch.nn.functional.logsigmoid(0.1 * margin).mean()


def test_preference_pairs_cut_by_the_split_warn_and_pairs_in_one_row_are_exact() -> None:
    """DPO-style pairs as rows: interleaved (chosen, rejected, chosen, ...) in micro-batches of 3
    rows broadcast a cut pair's halves (1.8 off silently), and chosen rows then rejected rows
    (`chunk(2)`) are compared with each other's chosen rows under any split; both warn now,
    naming the layout whose step is exact: each pair in one row, under its own keys. Interleaved
    in micro-batches of an even size is exact and quiet; an odd size that fails on the halves'
    sizes carries a note naming the fix, and changes nothing."""
    chosen, rejected = _pairs()
    interleaved = {"ids": torch.stack([chosen, rejected], 1).flatten(0, 1)[:12]}  # 6 pairs
    halves = {"ids": torch.cat([chosen[:6], rejected[:6]])}
    per_row = {"chosen": chosen[:6], "rejected": rejected[:6]}
    torch.manual_seed(0)
    start = _TinyLM().double()
    full = copy.deepcopy(start)
    _per_row_pairs(full, per_row).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()

    def stepped(batch: dict, loss_fn: Any, size: int) -> tuple[list[str], float]:
        model, caught = _sgd_step_caught(start, batch, loss_fn, size)
        pairs = zip(model.parameters(), full.parameters(), strict=True)
        gap = max(float((a - b).detach().abs().max() / b.detach().abs().max()) for a, b in pairs)
        return [str(w.message) for w in caught], gap

    for batch, loss_fn, size in ((interleaved, _interleaved, 3), (halves, _halves, 4)):
        told, gap = stepped(batch, loss_fn, size)
        assert len(told) == 1, told
        assert "Keep each pair in one row" in told[0]
        assert gap > 1e-3  # the control
    for batch, loss_fn, size in ((per_row, _per_row_pairs, 4), (interleaved, _interleaved, 4)):
        told, gap = stepped(batch, loss_fn, size)
        assert told == []
        assert gap < 1e-12
    model = copy.deepcopy(start)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_size=5)
    with pytest.raises(RuntimeError, match="must match") as raised:
        acc.step(interleaved, _interleaved)
    assert any("Keep each pair in one row" in note for note in raised.value.__notes__)
    for got, want in zip(model.parameters(), start.parameters(), strict=True):
        assert torch.equal(got, want)
        assert got.grad is None


def _packed_rnn_loss(m: torch.nn.Module, b: dict) -> torch.Tensor:
    packed = torch.nn.utils.rnn.pack_padded_sequence(
        b["x"], b["lengths"], batch_first=True, enforce_sorted=False
    )
    return m(packed)[1][-1].pow(2).sum(-1).mean()


def test_a_packed_rnn_cutting_its_hidden_state_is_no_preference_pair() -> None:
    """`pack_padded_sequence` in loss_fn (variable-length sequences, the usual RNN recipe): the
    RNN cuts its hidden state's rows as the shorter sequences end (`h[:1]`, `h[1:]` of 2 rows)
    and concatenates the pieces back, which the pair check read as halves compared: a false
    'Keep each pair in one row' warning on an exact step. Pieces under a concatenation along
    the rows are skipped; the step is the full batch's (float64, rtol 1e-10), quietly."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 5, 2, 4, 6, 1])
    x = torch.randn(6, 6, 3, generator=generator, dtype=torch.float64)
    x = x * (torch.arange(6)[None, :, None] < lengths[:, None, None])
    batch = {"x": x, "lengths": lengths}
    torch.manual_seed(0)
    start = torch.nn.GRU(3, 4, batch_first=True).double()
    full = copy.deepcopy(start)
    _packed_rnn_loss(full, batch).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    # Control: a micro-batch's graph holds the halves of its 2 rows, each sliced along dim 0.
    loss = _packed_rnn_loss(copy.deepcopy(start), {"x": x[:2], "lengths": lengths[:2]})
    queue, cuts = [loss.grad_fn], set()
    while queue:
        node = queue.pop()
        if type(node).__name__ == "SliceBackward0" and node._saved_self_sym_sizes[0] == 2:
            cuts.add((int(node._saved_start), int(node._saved_end)))
        queue.extend(f for f, _ in getattr(node, "next_functions", ()) if f is not None)
    assert {(0, 1), (1, 2)} <= cuts
    model, caught = _sgd_step_caught(start, batch, _packed_rnn_loss, 2)
    assert [str(w.message) for w in caught] == []
    for got, want in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_a_causal_lm_count_taken_before_the_shift_warns_and_the_shifted_count_is_exact() -> None:
    """Pretraining rows (no -100 at position 0) scored as `labels[:, 1:]` against
    `logits[:, :-1]` but counted `(labels != -100).sum()`: one more per row, silently 0.15 off
    the full-batch token-mean update. It warns now (TokenMeanWarning naming the shifted
    count); the shifted count is exact and quiet; a classifier's LossSum counting rows whose
    targets hold -100 is no shift and stays quiet."""
    from gradaccum.loss import TokenMeanWarning

    generator = torch.Generator().manual_seed(13)
    labels = torch.randint(0, 11, (7, 9), generator=generator)
    for row, pad in enumerate([0, 2, 1, 3, 0, 4, 1]):
        labels[row, 9 - pad :] = -100
    batch = {"ids": labels.clamp(min=0), "labels": labels}

    def scored(m: torch.nn.Module, b: dict, count: Any) -> LossSum:
        logits = m(b["ids"])[:, :-1]
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), b["labels"][:, 1:].flatten(), reduction="sum"
        )
        return LossSum(ce, count(b["labels"]))

    torch.manual_seed(0)
    start = _TinyLM().double()
    full = copy.deepcopy(start)
    out = full(batch["ids"])[:, :-1]
    torch.nn.functional.cross_entropy(out.flatten(0, 1), labels[:, 1:].flatten()).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    counts = {
        "unshifted": lambda y: (y != -100).sum(),
        "shifted": lambda y: (y[:, 1:] != -100).sum(),
    }
    for name, count in counts.items():
        model = copy.deepcopy(start)
        acc = gradaccum.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=3
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.step(batch, lambda m, b, count=count: scored(m, b, count))
        told = [str(w.message) for w in caught if w.category is TokenMeanWarning]
        pairs = zip(model.parameters(), full.parameters(), strict=True)
        gap = max(float((a - b).detach().abs().max()) for a, b in pairs)
        if name == "unshifted":
            assert len(told) == 1, told
            assert "labels[:, 1:] != -100" in told[0]
            assert gap > 1e-3  # the control
        else:
            assert [str(w.message) for w in caught] == []
            for got, want in zip(model.parameters(), full.parameters(), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, -100, 2, -100, 1])
    linear = torch.nn.Linear(4, 3).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradaccum.accumulate_grad(
            linear,
            (x, y),
            lambda m, b: LossSum(
                torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="sum"), len(b[1])
            ),
            micro_batch_size=3,
        )


def _unshifted_lm_sum(m: torch.nn.Module, b: dict) -> LossSum:
    """A causal LM's token sum counted before the shift: one more per row."""
    logits = m(b["ids"])[:, :-1]
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), b["ids"][:, 1:].flatten(), reduction="sum"
    )
    return LossSum(ce, b["ids"].numel())


@pytest.mark.parametrize("first", ["unshifted", "pairs", "copied"])
def test_each_loss_warning_kind_is_told_once_on_its_own(first: str) -> None:
    """The preference-pair check and the causal-shift check shared one 'told once' flag (and a
    copied loop's line stopped both): whichever warned first silenced the other for the rest of
    the run, so a later window's pairs cut by the split (or its unshifted count) stepped off
    silently. Each kind now has its own flag: in either order both warn, each once."""
    from gradaccum.loss import CopiedLoopWarning, TokenMeanWarning

    chosen, rejected = _pairs()
    halves = {"ids": torch.cat([chosen[:4], rejected[:4]])}  # 4 pairs, 2 micro-batches of 4
    lm = {"ids": chosen[:6]}
    kinds = {
        "unshifted": (lm, _unshifted_lm_sum, 3, TokenMeanWarning, "labels[:, 1:] != -100"),
        "pairs": (halves, _halves, 4, UserWarning, "Keep each pair in one row"),
        "copied": (lm, lambda m, b: -_pair_scores(m, b["ids"]).sum(), 3, CopiedLoopWarning, "sum"),
    }
    order = [first] + [kind for kind in kinds if kind != first]
    model = _TinyLM().double()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in order + order:  # each kind twice: told once
            batch, loss_fn, size, _, _ = kinds[kind]
            acc.micro_batch_size = size
            acc.step(batch, loss_fn)
    told = [(w.category, str(w.message)) for w in caught]
    assert len(told) == 3, told
    for (category, message), kind in zip(told, order, strict=True):
        assert category is kinds[kind][3], (kind, message)
        assert kinds[kind][4] in message, (kind, message)


_DIVISIONS = {
    "a / d": lambda s, d: s / d,
    "a * (1 / d)": lambda s, d: s * (1 / d),
    "(1 / d) * a": lambda s, d: (1 / d) * s,
    "a * torch.reciprocal(d)": lambda s, d: s * torch.reciprocal(d.double()),
    "a * d.reciprocal() * 0.5": lambda s, d: s * d.reciprocal() * 0.5,
    "a.div(d)": lambda s, d: s.div(d),
    "torch.true_divide(a, d)": lambda s, d: torch.true_divide(s, d),
}


@pytest.mark.parametrize("micro_batch_size", [1, 3])
@pytest.mark.parametrize("form", list(_DIVISIONS))
def test_a_token_mean_written_with_a_reciprocal_warns_as_its_division_does(
    form: str, micro_batch_size: int
) -> None:
    """`(l * k).sum() * (1 / k.sum())` (a token mean as a product with a reciprocal, also
    `torch.reciprocal`) was read as a constant factor on a sum: over one-row micro-batches it
    was silent (4.6e-2 off the full-batch step), over three rows it warned CopiedLoopWarning
    that the sum counted 3 times. It is the division it is: TokenMeanWarning naming LossSum,
    in every form (`/`, `.div`, `torch.true_divide`), and the LossSum is exact."""
    from gradaccum.loss import TokenMeanWarning

    batch = _packed_lm_batch()
    divide = _DIVISIONS[form]

    def plain(m: torch.nn.Module, b: dict) -> torch.Tensor:
        return divide((_token_losses(m, b) * b["keep"]).sum(), b["keep"].sum())

    torch.manual_seed(0)
    start = _TinyLM().double()
    full = copy.deepcopy(start)
    (_token_losses(full, batch)[batch["keep"]].mean() * (0.5 if "0.5" in form else 1)).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    model, caught = _sgd_step_caught(start, batch, plain, micro_batch_size)
    assert [w.category for w in caught] == [TokenMeanWarning], [str(w.message) for w in caught]
    assert "LossSum" in str(caught[0].message)
    pairs = zip(model.parameters(), full.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 1e-3  # the control
    model, caught = _sgd_step_caught(start, batch, _lm_token_sum, micro_batch_size)
    assert caught == [] or "0.5" in form
    if "0.5" not in form:
        for got, want in zip(model.parameters(), full.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_row_means_written_with_a_reciprocal_stay_quiet() -> None:
    """No false alarm: `l.sum() * (1 / l.numel())` (warned CopiedLoopWarning over 3 rows),
    `l.mean(1).sum() * (1 / len(x))` (a float32 reciprocal too), a loss weight on a mean
    (`0.1 * l.mean()`) and a per-row mean by reciprocal, each exact."""
    batch = _packed_lm_batch()
    quiet = [
        lambda m, b: _token_losses(m, b).sum() * (1 / _token_losses(m, b).numel()),
        lambda m, b: (
            _token_losses(m, b).mean(1).sum() * torch.tensor(1 / len(b["ids"]), dtype=torch.float64)
        ),
        lambda m, b: _token_losses(m, b).mean(1).sum() * torch.tensor(1 / len(b["ids"])),
        lambda m, b: 0.1 * _token_losses(m, b).mean(),
        lambda m, b: (
            (_token_losses(m, b) * b["keep"]).sum(1) * (1 / b["keep"].sum(1).clamp(min=1))
        ).mean(),
    ]
    torch.manual_seed(0)
    start = _TinyLM().double()
    for loss_fn in quiet:
        full = copy.deepcopy(start)
        loss_fn(full, batch).backward()
        torch.optim.SGD(full.parameters(), lr=0.5).step()
        for micro_batch_size in (1, 3):
            model, caught = _sgd_step_caught(start, batch, loss_fn, micro_batch_size)
            assert [str(w.message) for w in caught] == []
            rtol = 1e-5 if loss_fn is quiet[2] else 1e-10  # a float32 factor: rounded
            for got, want in zip(model.parameters(), full.parameters(), strict=True):
                torch.testing.assert_close(got, want, rtol=rtol, atol=0)


def _rollout() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "obs": torch.randn(16, 4, generator=generator, dtype=torch.float64),
        "act": torch.randint(0, 3, (16,), generator=generator),
        "old_logp": -torch.rand(16, generator=generator, dtype=torch.float64) - 0.5,
        "adv": torch.randn(16, generator=generator, dtype=torch.float64) * 3 + 1,
    }


def _ppo(m: torch.nn.Module, b: dict, normalize: bool = True) -> torch.Tensor:
    logp = m(b["obs"]).log_softmax(-1).gather(1, b["act"][:, None]).squeeze(1)
    adv = (b["adv"] - b["adv"].mean()) / (b["adv"].std() + 1e-8) if normalize else b["adv"]
    ratio = (logp - b["old_logp"]).exp()
    return -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()


def _policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    ).double()


def test_advantages_normalized_in_loss_fn_warn_and_normalized_before_the_step_are_exact() -> None:
    """PPO's `adv = (adv - adv.mean()) / (adv.std() + 1e-8)` inside loss_fn normalizes each
    micro-batch with its own statistics: the step depends on the split (1.2 rel off the
    full-batch gradient), silently. It warns once now (a tensor without gradient the loss
    multiplies by, mean 0 over the micro-batch; a batch-mean baseline too), in
    Accumulator.step, as a LossSum.terms term, and in check_equivalence's run (which reports the
    gap); normalized over the whole batch before the step it is exact and quiet, and raw
    advantages and a margin loss's balanced +-1 labels stay quiet."""
    rollout, start = _rollout(), _policy()
    full = copy.deepcopy(start)
    _ppo(full, rollout).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    model, caught = _sgd_step_caught(start, rollout, _ppo, 4)
    told = [str(w.message) for w in caught]
    assert len(told) == 1, told
    assert "Normalize over the whole batch before acc.step()" in told[0]
    pairs = zip(model.parameters(), full.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 1e-3  # the control

    def as_terms(m: torch.nn.Module, b: dict) -> LossSum:
        return LossSum.terms(pg=(_ppo(m, b) * len(b["act"]), len(b["act"])))

    _, caught = _sgd_step_caught(start, rollout, as_terms, 4)
    assert ["adv.std()" in str(w.message) for w in caught] == [True]
    with pytest.warns(UserWarning, match="mean 0 over"):
        report = gradaccum.check_equivalence(start, rollout, _ppo, 4)
    assert not report.ok
    assert "advantage normalization" in report.explain()
    ahead = {**rollout, "adv": (rollout["adv"] - rollout["adv"].mean()) / rollout["adv"].std()}
    full = copy.deepcopy(start)
    _ppo(full, ahead, normalize=False).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()

    def baseline(m: torch.nn.Module, b: dict) -> torch.Tensor:  # REINFORCE, batch-mean baseline
        logp = m(b["obs"]).log_softmax(-1).gather(1, b["act"][:, None]).squeeze(1)
        return -(logp * (b["adv"] - b["adv"].mean())).mean()

    _, caught = _sgd_step_caught(start, rollout, baseline, 4)
    assert ["R - R.mean()" in str(w.message) for w in caught] == [True]

    def margin(m: torch.nn.Module, b: dict) -> torch.Tensor:  # +-1 labels, 2 of each per 4
        signs = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64).repeat(len(b["act"]) // 4)
        return torch.nn.functional.softplus(-signs * m(b["obs"])[:, 0]).mean()

    for batch, loss_fn in ((ahead, lambda m, b: _ppo(m, b, False)), (rollout, margin)):
        model, caught = _sgd_step_caught(start, batch, loss_fn, 4)
        assert [str(w.message) for w in caught] == []
        if batch is ahead:
            for got, want in zip(model.parameters(), full.parameters(), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def _mixup_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return torch.randn(12, 6, generator=generator, dtype=torch.float64), torch.tensor(
        [1, 2, 3, 4, 1, 3, 3, 1, 1, 2, 0, 4]  # the second micro-batch of 4: a palindrome
    )


def _mix_in_loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
    """timm's pairing (the batch flipped), drawn in loss_fn: mixes within the micro-batch."""
    x, y = b
    out = m(0.7 * x + 0.3 * x.flip(0))
    ce = torch.nn.functional.cross_entropy
    return 0.7 * ce(out, y) + 0.3 * ce(out, y.flip(0))


def _mixed_ahead(b: Any) -> dict[str, torch.Tensor]:
    x, y = b
    return {"x": 0.7 * x + 0.3 * x.flip(0), "ya": y, "yb": y.flip(0)}


def _score_mix(m: torch.nn.Module, b: dict) -> torch.Tensor:
    out, ce = m(b["x"]), torch.nn.functional.cross_entropy
    return 0.7 * ce(out, b["ya"]) + 0.3 * ce(out, b["yb"])


@pytest.mark.parametrize("draw", ["flip", "randperm"])
def test_mixup_drawn_in_loss_fn_warns_and_mixed_before_the_step_is_exact(draw: str) -> None:
    """Mixup drawn in loss_fn (`lam * ce(out, y) + (1 - lam) * ce(out, y[perm])`) mixes each
    item within its micro-batch only: 0.6-0.9 rel off the full-batch gradient, silently. It
    warns once now (two cross-entropies whose targets are the same labels reordered, on two
    micro-batches; one whose reordering kept them, a palindrome, is no evidence either way),
    check_equivalence's explain() names it; mixed before the step (the collate function) it is
    exact and quiet, although its micro-batches' two targets may hold the same labels."""
    batch = _mixup_batch()
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)
    ).double()

    def randperm(m: torch.nn.Module, b: Any) -> torch.Tensor:
        x, y = b
        perm = torch.randperm(len(x))
        out, ce = m(0.7 * x + 0.3 * x[perm]), torch.nn.functional.cross_entropy
        return 0.7 * ce(out, y) + 0.3 * ce(out, y[perm])

    loss_fn = _mix_in_loss if draw == "flip" else randperm
    model, caught = _sgd_step_caught(net, batch, loss_fn, 4)
    told = [str(w.message) for w in caught]
    assert len(told) == 1, told
    assert "Mix the whole batch before acc.step()" in told[0]
    with pytest.warns(UserWarning, match="Mix the whole batch"):
        report = gradaccum.check_equivalence(net, batch, loss_fn, 4)
    assert not report.ok  # the control
    assert "mixup" in report.explain()
    full = copy.deepcopy(net)
    _score_mix(full, _mixed_ahead(batch)).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    model, caught = _sgd_step_caught(net, _mixed_ahead(batch), _score_mix, 4)
    assert [str(w.message) for w in caught] == []
    for got, want in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def _soft(y: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """One-hot targets over 5 classes, label-smoothed as timm smooths them."""
    off = smoothing / 5
    return torch.nn.functional.one_hot(y, 5).double() * (1 - smoothing) + off


def _soft_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """timm's SoftTargetCrossEntropy."""
    return torch.sum(-target * torch.nn.functional.log_softmax(out, dim=-1), dim=-1).mean()


_SOFT_SCORES = {
    "timm-soft-ce": _soft_ce,
    "ce-probabilities": torch.nn.functional.cross_entropy,
    "bce": torch.nn.functional.binary_cross_entropy_with_logits,
}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("score", sorted(_SOFT_SCORES))
def test_soft_target_mixup_drawn_in_loss_fn_warns_and_mixed_before_is_exact(
    score: str, smoothing: float
) -> None:
    """Mixup or CutMix with soft targets drawn in loss_fn (timm's `lam * onehot(y) + (1 - lam)
    * onehot(y.flip(0))` scored by SoftTargetCrossEntropy, `F.cross_entropy` of probabilities
    or BCE) mixes within the micro-batch, 2e-2 to 9e-2 off the full-batch step, silently (only
    two class-index cross-entropies were read). Its column sums are whole label counts: it warns
    once; the same soft targets mixed before the step, and a teacher's probabilities, are exact
    and quiet."""
    batch = _mixup_batch()
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)
    ).double()
    scored = _SOFT_SCORES[score]

    def mixed_in_loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        x, y = b
        target = 0.7 * _soft(y, smoothing) + 0.3 * _soft(y.flip(0), smoothing)
        return scored(m(0.7 * x + 0.3 * x.flip(0)), target)

    model, caught = _sgd_step_caught(net, batch, mixed_in_loss, 4)
    told = [str(w.message) for w in caught]
    assert len(told) == 1, told
    assert "soft targets mixing its own labels" in told[0]
    assert "Mix the whole batch before acc.step()" in told[0]
    x, y = batch
    target = 0.7 * _soft(y, smoothing) + 0.3 * _soft(y.flip(0), smoothing)
    ahead = (0.7 * x + 0.3 * x.flip(0), target)
    full = copy.deepcopy(net)
    scored(full(ahead[0]), ahead[1]).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    pairs = zip(model.parameters(), full.parameters(), strict=True)
    gap = max(float((a - b).detach().abs().max()) for a, b in pairs)
    assert gap > 1e-3  # the control: drawn in loss_fn, another step
    teacher = _teacher_net(batchnorm=False)
    for batch_, loss_fn in (
        (ahead, lambda m, b: scored(m(b[0]), b[1])),
        (batch, lambda m, b: scored(m(b[0]), teacher(b[0]).softmax(-1))),
    ):
        model, caught = _sgd_step_caught(net, batch_, loss_fn, 4)
        assert [str(w.message) for w in caught] == []
        if batch_ is ahead:
            for got, want in zip(model.parameters(), full.parameters(), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


class _Distiller:
    """A training object holding the teacher, its loss a bound method (`self.teacher`)."""

    def __init__(self, teacher: torch.nn.Module) -> None:
        self.teacher = teacher

    def loss(self, m: torch.nn.Module, b: Any) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(b[0]).softmax(-1)
        out = m(b[0])
        kl = torch.nn.functional.kl_div(out.log_softmax(-1), target, reduction="batchmean")
        return kl + torch.nn.functional.cross_entropy(out, b[1])


def _teacher_net(batchnorm: bool = True) -> torch.nn.Module:
    torch.manual_seed(1)
    norm = [torch.nn.BatchNorm1d(16)] if batchnorm else []
    layers = [torch.nn.Linear(6, 16), *norm, torch.nn.ReLU(), torch.nn.Linear(16, 5)]
    return torch.nn.Sequential(*layers).double().requires_grad_(False)


@pytest.mark.parametrize("held", ["closure", "bound method"])
def test_a_teacher_outside_the_model_in_train_mode_warns_naming_eval_and_in_eval_is_exact(
    held: str,
) -> None:
    """A distillation teacher held outside the model (a closure's `teacher`, a training object's
    `self.teacher`), left in train mode and run in loss_fn: its BatchNorm normalizes each
    micro-batch on its own, so its targets depend on the split (8e-2 rel off the full-batch
    step), and nothing said so (the model's checks see only the model). It warns once now,
    naming `teacher.eval()`; in eval mode, or without BatchNorm, it is quiet and exact."""
    generator = torch.Generator().manual_seed(5)
    batch = (
        torch.randn(12, 6, generator=generator, dtype=torch.float64),
        torch.randint(0, 5, (12,), generator=generator),
    )
    torch.manual_seed(0)
    start = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5)
    ).double()

    def loss_of(teacher: torch.nn.Module) -> Any:
        if held == "bound method":
            return _Distiller(teacher).loss

        def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
            return _Distiller.loss(types.SimpleNamespace(teacher=teacher), m, b)

        return loss_fn

    for teacher in (_teacher_net(), _teacher_net().eval(), _teacher_net(batchnorm=False)):
        full, reference = copy.deepcopy(start), copy.deepcopy(teacher)
        loss_of(reference)(full, batch).backward()
        torch.optim.SGD(full.parameters(), lr=0.5).step()
        model, caught = _sgd_step_caught(start, batch, loss_of(teacher), 4)
        told = [str(w.message) for w in caught]
        gap = max(
            float((a - b).detach().abs().max() / b.detach().abs().max())
            for a, b in zip(model.parameters(), full.parameters(), strict=True)
        )
        if teacher.training and len(list(teacher.modules())) == 5:  # train-mode BatchNorm
            name = "self.teacher" if held == "bound method" else "teacher"
            assert len(told) == 1, told
            assert f"{name}.eval()" in told[0]
            assert gap > 1e-3  # the control
        else:
            assert told == []
            for got, want in zip(model.parameters(), full.parameters(), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_discriminator_with_spectral_norm_outside_the_generator_warns_and_the_recipe_is_exact(
    legacy: bool,
) -> None:
    """A GAN's generator step runs the discriminator (a closure's `disc`, frozen) in train mode:
    spectral norm's power iteration ran once per micro-batch instead of once per batch, so the
    generator's step was off the full-batch step, silently (legacy `spectral_norm` 5.7e-2 after
    3 rounds, the parametrization 2.5e-4; 1e-7 after one step from a converged start). It warns
    once now, naming the recipe: one power iteration by a no-grad forward, then the
    discriminator in eval mode for the window; that is exact."""
    sn = torch.nn.utils.spectral_norm if legacy else torch.nn.utils.parametrizations.spectral_norm
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(
        sn(torch.nn.Linear(4, 8)), torch.nn.LeakyReLU(0.2), sn(torch.nn.Linear(8, 1))
    )
    gen, disc = gen.double(), disc.double().requires_grad_(False)
    z = torch.randn(12, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def g_loss_of(d: torch.nn.Module) -> Any:
        return lambda g, noise: -d(g(noise)).mean()

    # The plain full-batch step: the discriminator in train mode, one power iteration.
    plain_gen, plain_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    g_loss_of(plain_disc)(plain_gen, z).backward()
    torch.optim.SGD(plain_gen.parameters(), lr=0.5).step()

    def gap(model: torch.nn.Module) -> float:
        pairs = zip(model.parameters(), plain_gen.parameters(), strict=True)
        return max(float((a - b).detach().abs().max() / b.detach().abs().max()) for a, b in pairs)

    # Control: left in train mode, each micro-batch iterates again; now it warns so.
    model, caught = _sgd_step_caught(gen, z, g_loss_of(copy.deepcopy(disc)), 4)
    told = [str(w.message) for w in caught]
    assert len(told) == 1, told
    assert "power iteration" in told[0]
    assert "d.eval()" in told[0]
    assert gap(model) > 1e-8  # far from rounding (1e-7 at a converged start, 1e-2 legacy)
    # The recipe the warning names: exact and quiet.
    recipe = copy.deepcopy(disc)
    with torch.no_grad():
        recipe(torch.zeros(1, 4, dtype=torch.float64))  # any input: the iteration ignores it
    recipe.eval()
    model, caught = _sgd_step_caught(gen, z, g_loss_of(recipe), 4)
    assert [str(w.message) for w in caught] == []
    for got, want in zip(model.parameters(), plain_gen.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    for got, want in zip(recipe.buffers(), plain_disc.buffers(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    # One micro-batch per window is the full batch: quiet.
    _, caught = _sgd_step_caught(gen, z, g_loss_of(copy.deepcopy(disc)), 12)
    assert caught == []


def test_fakes_made_once_per_batch_give_the_discriminator_the_full_batch_step() -> None:
    """docs/batchnorm.md, "GANs": a generator with train-mode BatchNorm run in the
    discriminator's loss_fn normalizes each micro-batch of fakes on its own (warned); fakes
    made once per batch before the window and put in the batch give the full-batch step, and
    the generator's running statistics move once per batch, as in the plain loop."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 4)
    ).double()
    disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    disc = disc.double()
    plain_gen, plain_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    acc = gradaccum.Accumulator(
        disc, torch.optim.Adam(disc.parameters(), lr=1e-2), micro_batch_size=4
    )
    plain_opt = torch.optim.Adam(plain_disc.parameters(), lr=1e-2)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def d_loss(d: torch.nn.Module, b: Any) -> torch.Tensor:
        real, fake = b
        ones, zeros = torch.ones_like(real[:, :1]), torch.zeros_like(real[:, :1])
        return bce(d(real), ones) + bce(d(fake), zeros)

    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        real = torch.randn(12, 4, generator=generator, dtype=torch.float64)
        z = torch.randn(12, 3, generator=generator, dtype=torch.float64)
        with torch.no_grad():
            fake = gen(z)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            acc.step((real, fake), d_loss)
        plain_opt.zero_grad()
        d_loss(plain_disc, (real, plain_gen(z).detach())).backward()
        plain_opt.step()
    for got, want in zip(
        [*disc.parameters(), *gen.buffers()],
        [*plain_disc.parameters(), *plain_gen.buffers()],
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def _probs(m: torch.nn.Module, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.sigmoid(m(b[0])), b[1]


def _batch_dice(m: torch.nn.Module, b: Any) -> torch.Tensor:
    p, t = _probs(m, b)
    return 1 - (2 * (p * t).sum() + 1) / (p.sum() + t.sum() + 1)


def _class_dice(m: torch.nn.Module, b: Any) -> torch.Tensor:  # smp's DiceLoss: dims (0, 2)
    p, t = _probs(m, b)
    return (1 - 2 * (p * t).sum(0) / (p.sum(0) + t.sum(0)).clamp_min(1e-7)).mean()


def _soft_iou(m: torch.nn.Module, b: Any) -> torch.Tensor:
    p, t = _probs(m, b)
    inter = (p * t).sum()
    return 1 - inter / (p.sum() + t.sum() - inter)


def _vicreg_variance(m: torch.nn.Module, b: Any) -> torch.Tensor:
    z = m(b[0])
    return torch.relu(1 - torch.sqrt(z.var(dim=0) + 1e-4)).mean()


def _std_hinge(m: torch.nn.Module, b: Any) -> torch.Tensor:
    return torch.relu(1 - m(b[0]).std(dim=0)).mean() + torch.nn.functional.mse_loss(m(b[0]), b[1])


def _rmse(m: torch.nn.Module, b: Any) -> torch.Tensor:
    return torch.sqrt(torch.nn.functional.mse_loss(m(b[0]), b[1]))


def _ohem(m: torch.nn.Module, b: Any) -> torch.Tensor:  # the hardest half and one more
    losses = torch.nn.functional.mse_loss(m(b[0]), b[1], reduction="none").sum(1)
    return losses.topk(len(losses) // 2 + 1).values.mean()


def _worst_row(m: torch.nn.Module, b: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(m(b[0]), b[1], reduction="none").sum(1).max()


def _info_max(m: torch.nn.Module, b: Any) -> torch.Tensor:  # entropy per row, diversity of the mean
    p = m(b[0]).softmax(1)
    mean = p.mean(0)
    return -(p * p.log()).sum(1).mean() + (mean * mean.log()).sum()


def _learned_weight(m: torch.nn.Module, b: Any) -> torch.Tensor:  # Kendall's uncertainty weights
    scale = m[2].bias[0]  # a parameter, not the batch: a product with it is linear in the rows
    return torch.nn.functional.mse_loss(m(b[0]), b[1]) * torch.exp(-scale) + scale


def _focal(m: torch.nn.Module, b: Any) -> torch.Tensor:  # a per-row power under the mean
    ce = torch.nn.functional.binary_cross_entropy_with_logits(m(b[0]), b[1], reduction="none")
    return ((1 - torch.exp(-ce)) ** 2 * ce).mean()


def _image_dice(m: torch.nn.Module, b: Any) -> torch.Tensor:  # per row, then the mean: exact
    p, t = _probs(m, b)
    return (1 - (2 * (p * t).sum(1) + 1) / (p.sum(1) + t.sum(1) + 1)).mean()


def _row_spread(m: torch.nn.Module, b: Any) -> torch.Tensor:  # a spread within each row: exact
    return torch.relu(1 - m(b[0]).std(dim=1)).mean()


@pytest.mark.parametrize(
    ("loss_fn", "says"),
    [
        (_batch_dice, "ratio of sums"),
        (_class_dice, "ratio of sums"),
        (_soft_iou, "ratio of sums"),
        (_vicreg_variance, "variance over its 4 rows"),
        (_std_hinge, "standard deviation over its 4 rows"),
        (_rmse, "under SqrtBackward0"),
        (_ohem, "ranking of its 4 rows (TopkBackward0"),
        (_worst_row, "ranking of its 4 rows (MaxBackward1"),
        (_info_max, "mean over its 4 rows (MeanBackward1) under MulBackward0"),
        (_image_dice, None),
        (_row_spread, None),
        (_learned_weight, None),
        (_focal, None),
    ],
    ids=[
        "dice",
        "dice-per-class",
        "soft-iou",
        "vicreg-variance",
        "std-hinge",
        "rmse",
        "ohem",
        "worst-row",
        "info-max",
        "dice-per-image",
        "std-per-row",
        "learned-weight",
        "focal",
    ],
)
def test_a_ratio_of_batch_sums_or_a_spread_over_rows_warns_and_per_row_forms_are_exact(
    loss_fn: Any, says: str | None
) -> None:
    """A Dice or soft IoU over the batch (a ratio of sums over the rows), VICReg's variance term
    (a std over the rows), an RMSE, OHEM's topk, a worst row and an entropy of the batch-mean
    prediction returned per micro-batch were 4e-3 to 0.6 off the full-batch step, silently: no
    rows x rows matrix, no division by a constant. They warn once now, naming the fix; a Dice
    per image, a spread within each row, a learned loss weight and a focal loss are per-row
    means: quiet and exact."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(12, 6, generator=generator, dtype=torch.float64)
    y = (torch.rand(12, 3, generator=generator) < 0.4).double()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    net = net.double()
    model, caught = _sgd_step_caught(net, (x, y), loss_fn, 4)
    told = [str(w.message) for w in caught]
    full = copy.deepcopy(net)
    loss_fn(full, (x, y)).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    pairs = list(zip(model.parameters(), full.parameters(), strict=True))
    if says is None:
        assert told == []
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
        return
    assert len(told) == 1, told
    assert says in told[0]
    assert "Exact:" in told[0] or "no exact accumulation" in told[0]
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 1e-3  # the control


def _class_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(9)
    # Micro-batches of 4 with other class counts each: (3, 1), (2, 2), (1, 3).
    return torch.randn(12, 6, generator=generator, dtype=torch.float64), torch.tensor(
        [0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 0, 1]
    )


def _inverse_counts(m: torch.nn.Module, b: Any) -> torch.Tensor:
    weight = 1.0 / torch.bincount(b[1], minlength=2).double().clamp_min(1)
    return torch.nn.functional.cross_entropy(m(b[0]), b[1], weight=weight, reduction="sum") / len(
        b[1]
    )


def _balanced(m: torch.nn.Module, b: Any) -> torch.Tensor:  # sklearn's "balanced", a mean
    weight = len(b[1]) / (2 * torch.bincount(b[1], minlength=2).double().clamp_min(1))
    return torch.nn.functional.cross_entropy(m(b[0]), b[1], weight=weight)


@pytest.mark.parametrize("loss_fn", [_inverse_counts, _balanced], ids=["1/counts", "balanced"])
def test_class_weights_from_the_micro_batchs_counts_warn_and_fixed_weights_do_not(loss_fn) -> None:
    """Class weights computed in loss_fn from the micro-batch's own labels (`1 / bincount(y)`,
    sklearn's "balanced") weigh each micro-batch by its own counts: 8e-2 to 0.13 off the
    full-batch step, silently. They warn once (weights inverse to the counts, changing between
    micro-batches); fixed weights that happen to fit every micro-batch's counts (micro-batches
    as balanced as the data) are quiet, and their LossSum.terms form is exact."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    net = net.double()
    batch = _class_batch()
    model, caught = _sgd_step_caught(net, batch, loss_fn, 4)
    told = [str(w.message) for w in caught if "own label counts" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]
    assert "Count the labels over the whole dataset" in told[0]
    full = copy.deepcopy(net)
    loss_fn(full, batch).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    pairs = list(zip(model.parameters(), full.parameters(), strict=True))
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 1e-3  # the control
    x = batch[0]
    y = torch.tensor([0, 0, 0, 1] * 3)  # every micro-batch 3:1, as the fixed weights assume
    fixed = torch.tensor([1.0, 3.0], dtype=torch.float64)

    def weighted(m: torch.nn.Module, b: Any) -> LossSum:
        ce = torch.nn.functional.cross_entropy(m(b[0]), b[1], weight=fixed, reduction="sum")
        return LossSum.terms(loss=(ce, fixed[b[1]].sum()))

    model, caught = _sgd_step_caught(net, (x, y), weighted, 4)
    assert [str(w.message) for w in caught] == []
    full = copy.deepcopy(net)
    torch.nn.functional.cross_entropy(full(x), y, weight=fixed).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()
    for got, want in zip(model.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
