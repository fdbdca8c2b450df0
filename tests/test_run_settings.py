"""Settings changed on a built Accumulator: `max_grad_norm`, `on_nonfinite`, `normalize`, ...

Before, they were plain attributes read at each boundary unchecked: `acc.max_grad_norm =
float("nan")` stepped the weights to NaN, `-1.0` stepped uphill, `acc.on_nonfinite = "raise"` (a
string) kept skipping, and `acc.normalize = "sum"` was ignored by the engine while the results
and the saved state followed it (`gradaccum._run_settings`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, NonFiniteError

LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(10, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(10, 1, generator=generator, dtype=torch.float64) * 5


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [s["momentum_buffer"] for s in optimizer.state.values()]
    return [p.detach().clone() for p in model.parameters()] + [m.clone() for m in moments]


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0, math.inf, "1.0", True])
def test_a_bad_max_grad_norm_set_between_windows_is_refused_changing_nothing(bad: object) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4, max_grad_norm=1.0)
    acc.step(_batch(0), _loss)
    before = _snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"acc\.max_grad_norm=.* must be a positive finite"):
        acc.max_grad_norm = bad  # type: ignore[assignment]
    assert acc.max_grad_norm == 1.0
    after = _snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    acc.step(_batch(1), _loss)  # the kept threshold clips: finite weights, a downhill step
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_max_grad_norm_lowered_between_windows_equals_the_full_batch_clipped_steps() -> None:
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=3, max_grad_norm=5.0)
    for seed, threshold in [(0, 5.0), (1, 0.5), (2, None)]:
        acc.max_grad_norm = threshold
        result = acc.step(_batch(seed), _loss)
        plain.zero_grad()
        _loss(reference, _batch(seed)).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), threshold or math.inf)
        plain.step()
        assert result.grad_norm == pytest.approx(float(norm), rel=1e-10)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)


def test_on_nonfinite_set_as_a_string_raises() -> None:
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), micro_batch_size=4)
    acc.on_nonfinite = "raise"  # was kept as the string: `is OnNonFinite.RAISE` never held
    x, y = _batch(0)
    with pytest.raises(NonFiniteError):
        acc.step((x, y * math.inf), _loss)
    with pytest.raises(ValueError, match="on_nonfinite='never' is not a valid choice"):
        acc.on_nonfinite = "never"
    with pytest.raises(ValueError, match="partial_window='keep' is not a valid choice"):
        acc.partial_window = "keep"


@pytest.mark.parametrize(
    ("name", "value"), [("normalize", "sum"), ("precision", "bf16"), ("memory_budget", "2GiB")]
)
def test_settings_the_engine_was_built_with_cannot_change(name: str, value: str) -> None:
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), micro_batch_size=4)
    before = getattr(acc, name)
    with pytest.raises(ValueError, match=rf"{name} cannot change .*Accumulator\(model, optim"):
        setattr(acc, name, value)
    assert getattr(acc, name) == before
    setattr(acc, name, before)  # the same value is taken
    assert acc.state_dict()["settings"]["normalize"] == "mean"


def test_normalize_mean_set_as_a_string_keeps_the_mean() -> None:
    """A no-op assignment of the same value as a string stays the enum the results read."""
    model, reference = _model(), _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), micro_batch_size=3)
    acc.normalize = "mean"  # type: ignore[assignment]
    result = acc.step(_batch(0), _loss)
    assert result.loss == pytest.approx(float(_loss(reference, _batch(0)).detach()), rel=1e-10)


def test_a_gradscaler_assigned_to_acc_scaler_is_refused_naming_load_state_dict() -> None:
    """A plain fp16 loop's `GradScaler(init_scale=..., growth_interval=...)` assigned to
    `acc.scaler` raised Python's bare "property 'scaler' of 'Accumulator' object has no setter";
    the refusal names the way that works, which then steps as that loop, scale included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    acc = Accumulator(model, optimizer, micro_batch_size=4, precision="fp16")
    own = acc.scaler
    wanted = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    with pytest.raises(ValueError, match=r"acc\.scaler\.load_state_dict\(scaler\.state_dict\(\)\)"):
        acc.scaler = wanted
    assert acc.scaler is own
    assert own is not None
    assert own.get_scale() == 65536.0
    acc.scaler = own  # the same one is taken
    own.load_state_dict(wanted.state_dict())  # the fix
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    for seed in range(3):
        x, y = (t.float() for t in _batch(seed))
        acc.step((x, y), _loss)
        plain.zero_grad()
        for rows in (slice(0, 4), slice(4, 8), slice(8, 10)):
            with torch.autocast("cpu", dtype=torch.float16):
                part = ((reference(x[rows]) - y[rows]) ** 2).float().sum() / len(x)
            wanted.scale(part).backward()
        wanted.step(plain)
        wanted.update()
    assert own.get_scale() == wanted.get_scale() == 8192.0  # grew once per window
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)


def test_a_gradscaler_assigned_without_fp16_is_refused_naming_precision() -> None:
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), micro_batch_size=4)
    with pytest.raises(ValueError, match="precision='fp16'"):
        acc.scaler = torch.amp.GradScaler("cpu")
    assert acc.scaler is None
