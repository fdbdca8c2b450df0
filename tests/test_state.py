"""`Accumulator.state_dict()` / `load_state_dict()`: exact mid-window resume and strict checks.

Resume is checked in-process here (the SIGKILL version lives in `test_checkpoint.py`): a run saved
mid-window and restored into a freshly built Accumulator must end bitwise where the uninterrupted
run ends, and a restore that leaves the state out must end somewhere clearly different.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, Tokens, load_checkpoint, save_checkpoint
from tests.reference import reference_step
from tests.state import assert_bitwise, clone_state


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x)
    # Promoted by hand: torch 2.4's mse_loss backward fails on mixed dtypes, and it has no
    # bfloat16 CPU kernel (later torch promotes, and has one).
    dtype = torch.promote_types(out.dtype, y.dtype)
    return nn.functional.mse_loss(out.to(dtype), y.to(dtype))


def _data(count: int, dtype: torch.dtype, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [1 + i % 3 for i in range(count)]
    return [
        (
            torch.randn(size, 4, generator=generator, dtype=torch.float64).to(dtype),
            torch.randn(size, 2, generator=generator, dtype=torch.float64).to(dtype),
        )
        for size in sizes
    ]


def _setup(
    dtype: torch.dtype = torch.float64, hidden: int = 6, **options: Any
) -> tuple[nn.Module, torch.optim.Optimizer, Accumulator]:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    options.setdefault("accumulation_steps", 3)
    return model, optimizer, Accumulator(model, optimizer, **options)


def _everything(model: nn.Module, optimizer: torch.optim.Optimizer, acc: Accumulator) -> Any:
    return clone_state([model.state_dict(), optimizer.state_dict(), acc.state_dict()])


def _via_bytes(state: Any) -> Any:
    """Round-trip through `torch.save` and a `weights_only` load, as a checkpoint would."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


VARIANTS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "fp64": (torch.float64, {}),
    "bf16-buffers": (torch.bfloat16, {"precision": "bf16", "accum_dtype": torch.float32}),
    "fp16-scaler": (torch.float32, {"precision": "fp16"}),
    "sum-carry": (torch.float64, {"normalize": "sum", "partial_window": "carry"}),
    # Windows of counted items (1, 2, 3 items per micro-batch): they close at micro-steps 2, 5
    # and 8, so stop 3 and 4 save an open window, and stop 5 its last micro-batch.
    "tokens-fp16": (torch.float32, {"accumulation_steps": Tokens(5), "precision": "fp16"}),
    "tokens": (torch.float64, {"accumulation_steps": Tokens(5)}),
    # The noise-scale averages and an open window's first measurement are part of the state.
    "telemetry": (torch.float64, {"telemetry": True}),
}


def _resume_run(
    variant: str, stop: int | None, *, keep_accumulator: bool = True, total: int = 9
) -> Any:
    """Train `total` micro-steps; after `stop` of them, move everything into fresh objects."""
    dtype, options = VARIANTS[variant]
    data = _data(total, dtype)
    model, optimizer, acc = _setup(dtype, **options)
    for index, batch in enumerate(data):
        acc.micro_step(batch, _mse)
        if variant == "sum-carry" and index == 4:
            acc.flush()  # carry: the partial window stays open and is part of the state
        if index == stop:
            saved = _via_bytes(_everything(model, optimizer, acc))
            model, optimizer, acc = _setup(dtype, **options)
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            if keep_accumulator:
                acc.load_state_dict(saved[2])
    return _everything(model, optimizer, acc)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("stop", [3, 4, 5])
def test_mid_window_resume_is_bitwise_exact(variant: str, stop: int) -> None:
    assert_bitwise(_resume_run(variant, stop), _resume_run(variant, None))


def _copied_run(variant: str, stop: int, how: str) -> tuple[Any, Any]:
    """`_resume_run`, the objects copied (`copy.deepcopy` or pickle) after `stop` micro-steps;
    the copy and the original both go on: their final states."""
    dtype, options = VARIANTS[variant]
    data = _data(9, dtype)
    model, optimizer, acc = _setup(dtype, **options)
    for batch in data[: stop + 1]:
        acc.micro_step(batch, _mse)
    trio = (model, optimizer, acc)
    copied = copy.deepcopy(trio) if how == "deepcopy" else pickle.loads(pickle.dumps(trio))
    for batch in data[stop + 1 :]:
        acc.micro_step(batch, _mse)
        copied[2].micro_step(batch, _mse)
    return _everything(*copied), _everything(model, optimizer, acc)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("variant", ["fp64", "bf16-buffers", "fp16-scaler", "telemetry"])
def test_a_copy_taken_mid_window_goes_on_bitwise_like_the_original(how: str, variant: str) -> None:
    """PyTorch copies and pickles a Parameter without its `.grad`, where an open window keeps
    its partial sums: the copy used to lose them and raise a misleading "zero_grad() inside the
    accumulation loop" error at its next micro-step. The original is not affected by the copy."""
    uninterrupted = _resume_run(variant, None)
    copied, original = _copied_run(variant, 4, how)  # 5 micro-steps: the window holds 2 of 3
    assert_bitwise(copied, uninterrupted)
    assert_bitwise(original, uninterrupted)


def test_a_copy_still_catches_a_zero_grad_made_before_it() -> None:
    """Control for the copy's gradient marks: a `zero_grad()` between two micro-steps, made
    before the copy, is refused in the copy as in the original."""
    model, optimizer, acc = _setup()
    data = _data(3, torch.float64)
    acc.micro_step(data[0], _mse)
    optimizer.zero_grad()
    for other in (copy.deepcopy((model, optimizer, acc))[2], acc):
        with pytest.raises(RuntimeError, match="zero_grad"):
            other.micro_step(data[1], _mse)


def test_resume_without_accumulator_state_is_clearly_different() -> None:
    """Negative control: the mid-window state matters, so the exactness test can fail."""
    lost = _resume_run("fp64", 4, keep_accumulator=False)[0]
    exact = _resume_run("fp64", None)[0]
    gap = max(float((lost[name] - exact[name]).abs().max()) for name in exact)
    assert gap > 1e-3


def test_state_holds_partial_window() -> None:
    dtype, options = VARIANTS["bf16-buffers"]
    model, _, acc = _setup(dtype, **options)
    for batch in _data(2, dtype):
        acc.micro_step(batch, _mse)
    state = acc.state_dict()
    assert state["version"] == 2
    window, precision = state["engine"]["window"], state["engine"]["precision"]
    assert window["micro_batches"] == 2
    assert window["count"] == 1 + 2
    # bf16 gradients live in float32 buffers mid-window, not in .grad.
    assert all(b is not None and b.dtype == torch.float32 for b in precision["buffers"])
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_is_a_snapshot() -> None:
    model, _, acc = _setup()
    data = _data(5, torch.float64)
    acc.micro_step(data[0], _mse)
    state = acc.state_dict()
    frozen = clone_state(state)
    acc.micro_step(data[1], _mse)
    # Negative control: the live gradient did change after the state was taken.
    assert not torch.equal(model[0].weight.grad, frozen["engine"]["window"]["grads"][0])
    for batch in data[2:]:
        acc.micro_step(batch, _mse)
    assert_bitwise(state, frozen)


def test_loaded_state_is_not_aliased() -> None:
    """Training after `load_state_dict(state)` leaves `state` itself untouched."""
    _, _, acc = _setup()
    data = _data(4, torch.float64)
    acc.micro_step(data[0], _mse)
    state = acc.state_dict()
    frozen = clone_state(state)
    _, _, other = _setup()
    other.load_state_dict(state)
    for batch in data[1:]:
        other.micro_step(batch, _mse)
    assert_bitwise(state, frozen)


def _mismatches() -> dict[str, tuple[Callable[[], Accumulator], str]]:
    def frozen_layer() -> Accumulator:
        torch.manual_seed(11)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
        model[2].bias.requires_grad_(False)
        return Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)

    return {
        "accumulation_steps": (lambda: _setup(accumulation_steps=4)[2], "accumulation_steps"),
        "tokens": (lambda: _setup(accumulation_steps=Tokens(3))[2], "Tokens"),
        "parameter set": (frozen_layer, "parameters"),
        "shapes": (lambda: _setup(hidden=7)[2], "shapes"),
        "precision": (lambda: _setup(torch.float32, precision="fp16")[2], "precision"),
        "normalize": (lambda: _setup(normalize="sum")[2], "normalize"),
        "accum_dtype": (
            lambda: _setup(torch.bfloat16, accum_dtype=torch.float32)[2],
            "accum_dtype",
        ),
    }


@pytest.mark.parametrize("mismatch", list(_mismatches()))
def test_incompatible_state_raises_naming_it_and_changes_nothing(mismatch: str) -> None:
    _, _, source = _setup()
    data = _data(3, torch.float64)
    source.micro_step(data[0], _mse)
    state = source.state_dict()
    build, word = _mismatches()[mismatch]
    target = build()
    target.micro_step((data[1][0].to(target.model[0].weight.dtype), data[1][1].float()), _mse)
    before = clone_state(
        [
            [p.grad for p in target.model.parameters()],
            target.state_dict(),
            target.model.state_dict(),
        ]
    )
    with pytest.raises(ValueError, match=word):
        target.load_state_dict(state)
    after = [
        [p.grad for p in target.model.parameters()],
        target.state_dict(),
        target.model.state_dict(),
    ]
    assert_bitwise(after, before)


def test_compatible_state_loads() -> None:
    """Negative control for the mismatch tests: the same settings load without complaint."""
    _, _, source = _setup()
    source.micro_step(_data(1, torch.float64)[0], _mse)
    _, _, target = _setup()
    target.load_state_dict(source.state_dict())
    assert target.state_dict()["engine"]["window"]["micro_batches"] == 1


def test_the_state_has_the_documented_keys() -> None:
    """The layout docs/architecture.md gives; it listed 6 of the 9 top keys, 4 of the engine's 6."""
    _, _, acc = _setup()
    acc.micro_step(_data(1, torch.float64)[0], _mse)
    state = acc.state_dict()
    top = ["version", "settings", "engine", "auto", "telemetry", "nonfinite_windows"]
    top += ["empty_windows", "nonfinite_in_a_row"]
    engine = ["buffers", "window", "precision", "batchnorm_mode", "batchnorm", "origin"]
    assert sorted(state) == sorted(top)
    assert sorted(state["engine"]) == sorted(engine)
    docs = Path(__file__).parents[1] / "docs" / "architecture.md"
    text = " ".join(docs.read_text().split())
    written = '", "'.join(engine)
    assert f'"engine": {{"{written}"}}' in text
    assert all(f'"{key}"' in text for key in top)


@pytest.mark.parametrize("bad", [{}, {"version": 99}, "not a dict"])
def test_not_a_state_or_wrong_version_raises(bad: Any) -> None:
    _, _, acc = _setup()
    with pytest.raises(ValueError, match=r"version|not an Accumulator state"):
        acc.load_state_dict(bad)


def test_nonfinite_counter_and_scaler_survive_checkpoint(tmp_path: Any) -> None:
    model, optimizer, acc = _setup(torch.float32, precision="fp16", accumulation_steps=2)
    scale = acc.scaler.get_scale()
    data = _data(2, torch.float32)
    acc.micro_step((data[0][0] * 1e6, data[0][1]), _mse)  # overflows fp16: window skipped
    result = acc.micro_step(data[1], _mse)
    assert result.skipped
    assert not result.stepped
    assert acc.nonfinite_windows == 1
    assert acc.scaler.get_scale() == scale / 2
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    model2, optimizer2, acc2 = _setup(torch.float32, precision="fp16", accumulation_steps=2)
    assert acc2.nonfinite_windows == 0  # negative control: a fresh one starts at 0
    assert acc2.scaler.get_scale() == scale
    load_checkpoint(path, model=model2, optimizer=optimizer2, accumulator=acc2)
    assert acc2.nonfinite_windows == 1
    assert acc2.scaler.get_scale() == scale / 2
    assert math.isfinite(acc2.scaler.get_scale())


def _step_run(sizes: list[int | str], resume_at: int, load_optimizer: bool = True) -> Any:
    """Windows of 10 items by `step()`, window k at `sizes[k]`, resumed before `resume_at`."""
    generator = torch.Generator().manual_seed(3)
    batches = [
        (
            torch.randn(10, 4, generator=generator, dtype=torch.float64),
            torch.randn(10, 2, generator=generator, dtype=torch.float64),
        )
        for _ in sizes
    ]
    model, optimizer, acc = _setup(micro_batch_size=sizes[0], accumulation_steps=None)
    for index, (size, batch) in enumerate(zip(sizes, batches, strict=True)):
        if index == resume_at:
            saved = _via_bytes(_everything(model, optimizer, acc))
            budget = "1GiB" if size == "auto" else None
            model, optimizer, acc = _setup(
                micro_batch_size=size, memory_budget=budget, accumulation_steps=None
            )
            model.load_state_dict(saved[0])
            if load_optimizer:
                optimizer.load_state_dict(saved[1])
            acc.load_state_dict(saved[2])
        acc.step(batch, _mse)
    return [p.detach().clone() for p in model.parameters()], batches


@pytest.mark.parametrize("resumed_at", [5, "auto"])
def test_resume_at_another_micro_batch_size_is_exact(resumed_at: int | str) -> None:
    """The split is a speed knob: a state saved between windows resumes at any size."""
    got, batches = _step_run([3, 3, resumed_at, resumed_at], resume_at=2)
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for batch in batches:
        reference_step(model, optimizer, batch, _mse)
    expected = [p.detach() for p in model.parameters()]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
    # NEGATIVE CONTROL: the same resume without the optimizer's state misses the reference.
    lost, _ = _step_run([3, 3, resumed_at, resumed_at], resume_at=2, load_optimizer=False)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lost, expected, rtol=1e-10, atol=0)


# ----- a damaged state is refused whole, before any component loads its part ---------------------

# Entries a load may find absent or changed without harm: the split is a speed knob, the
# BatchNorm state's own copy of the mode is not read (the engine's is), older version-2 states
# lack `loss_host`, `terms`, `telemetry`, auto's `capped` and `tuner` (the tuner its
# `decisions`) and BatchNorm's `start`,
# and a closed window is read no further than its `micro_batches`.
_HARMLESS = {"settings.micro_batch_size", "engine.batchnorm.mode"}
_OPTIONAL = {
    "engine.origin",  # absent from states saved before it was recorded
    "nonfinite_in_a_row.dropped_in_a_row",  # the drop streak: absent from older states
    "nonfinite_in_a_row.warned_dropped",
    "engine.window.loss_host",
    "engine.window.terms",
    "auto",
    "auto.capped",
    "auto.regrow_after",  # absent from states saved before it was recorded
    "auto.tuner",
    "auto.tuner.decisions",
    "engine.batchnorm.start",
    "engine.buffers",  # absent from states saved before the buffers' window start was
    "telemetry",
    "nonfinite_in_a_row",  # absent from states saved before the streak was kept
}


def _entries(state: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The dotted path and value of every dict entry in `state`, nested ones too."""
    entries = []
    for key, value in state.items():
        path = f"{prefix}{key}"
        entries.append((path, value))
        if isinstance(value, dict):
            entries += _entries(value, path + ".")
    return entries


def _damaged(state: Any, path: str, kind: str) -> Any:
    damaged = clone_state(state)
    *parents, key = path.split(".")
    part = damaged
    for parent in parents:
        part = part[parent]
    if kind == "delete":
        del part[key]
    else:
        part[key] = "garbage"
    return damaged


def _damage_source(variant: str) -> tuple[Any, Callable[[], tuple[Any, ...]]]:
    """A saved state of `variant` and a builder of a target that holds a different state."""
    if variant == "auto":
        batch = _data(1, torch.float64)[0]
        x, y = batch[0].repeat(6, 1), batch[1].repeat(6, 1)

        def build() -> tuple[Any, ...]:
            return _setup(micro_batch_size="auto", memory_budget="64MiB", accumulation_steps=None)

        source = build()[2]
        source.step((x, y), _mse)
        target = build()
        target[2].step((x[:4] * 2, y[:4]), _mse)
        return source.state_dict(), lambda: target
    data = _data(3, torch.float32)

    def build() -> tuple[Any, ...]:
        return _setup(torch.float32, precision="fp16", telemetry=True)

    _, _, source = build()
    source.micro_step(data[0], _mse)
    source.micro_step(data[1], _mse)  # an open window: gradients, loss, scaler, telemetry
    target = build()
    target[2].micro_step(data[2], _mse)
    return source.state_dict(), lambda: target


@pytest.mark.parametrize("variant", ["fp16-telemetry-mid-window", "auto"])
def test_damaged_state_is_refused_naming_the_entry_and_changes_nothing(variant: str) -> None:
    """Every entry missing or of the wrong type: one ValueError naming it, nothing loaded.

    Before, the components loaded one after the other, so a damaged entry raised a KeyError,
    TypeError or AttributeError halfway, with the window (or the counters, automatic sizing)
    already replaced.
    """
    state, build = _damage_source(variant)
    model, optimizer, target = build()

    def everything() -> Any:
        grads = [p.grad for p in model.parameters()]
        counters = [target.nonfinite_windows, target.empty_windows]
        return clone_state([grads, counters, *_everything(model, optimizer, target)])

    before = everything()
    refused = 0
    for path, value in _entries(state):
        for kind in ("delete", "garbage"):
            if path in _HARMLESS or (kind == "delete" and path in _OPTIONAL):
                continue
            if kind == "delete" and path.startswith("settings.") and value is None:
                continue  # a setting absent reads as None: the same setting
            if kind == "garbage" and isinstance(value, str) and not path.startswith("settings"):
                continue  # still text: the tuner's reason, a plan's device, shown in tables
            closed = not state["engine"]["window"]["micro_batches"]
            if (
                closed
                and path.startswith("engine.window.")
                and path != "engine.window.micro_batches"
            ):
                continue
            if path == "version":
                continue  # its own message: tests above
            name = path.split(".")[-1].removesuffix("_mode")  # batchnorm_mode: "batchnorm="
            with pytest.raises(ValueError, match=re.escape(name)):
                target.load_state_dict(_damaged(state, path, kind))
            refused += 1
            assert_bitwise(everything(), before)  # the same target, damaged again and again
    assert refused > 30
    # A wrong number of gradients, or one of another shape, is refused the same way, and so is
    # an fp16 state without its loss scale (the target's own scale would silently stay).
    if variant != "auto":
        bad = clone_state(state)
        bad["engine"]["precision"]["scaler"] = None
        with pytest.raises(ValueError, match="scaler"):
            target.load_state_dict(bad)
        for grads in (state["engine"]["window"]["grads"][:-1], [torch.zeros(3, 3)] * 4):
            bad = clone_state(state)
            bad["engine"]["window"]["grads"] = grads
            with pytest.raises(ValueError, match="gradients"):
                target.load_state_dict(bad)
            assert_bitwise(everything(), before)
    # Control: the undamaged state loads into the same target, and changes it.
    target.load_state_dict(state)
    assert_bitwise(target.state_dict(), state)


def test_damaged_accumulator_state_in_a_checkpoint_is_a_checkpoint_error(tmp_path: Any) -> None:
    """`load_checkpoint` reports a damaged Accumulator state as a `CheckpointError`, changing
    nothing: before, a KeyError escaped with the window half loaded."""
    from gradaccum.checkpoint import CheckpointError

    model, optimizer, acc = _setup()
    data = _data(3, torch.float64)
    acc.micro_step(data[0], _mse)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    payload = torch.load(path, weights_only=True)
    del payload["accumulator"]["engine"]["window"]["count"]
    torch.save(payload, path)
    model2, optimizer2, acc2 = _setup()
    acc2.micro_step(data[1], _mse)
    before = clone_state(
        [[p.grad for p in model2.parameters()], _everything(model2, optimizer2, acc2)]
    )
    with pytest.raises(CheckpointError, match=r"engine\.window\.count is missing"):
        load_checkpoint(path, model=model2, optimizer=optimizer2, accumulator=acc2)
    after = [[p.grad for p in model2.parameters()], _everything(model2, optimizer2, acc2)]
    assert_bitwise(after, before)


class _Ema(nn.Module):
    """A forward that updates buffers (an EMA and a call counter), as an EMA codebook does."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(4, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
            self.calls += 1
        return x


def _ema_run(micro_batches: int) -> tuple[nn.Module, torch.optim.Optimizer, Accumulator]:
    """A window of 4, then `micro_batches - 4` of the next: open, with buffers updated."""
    torch.manual_seed(11)
    model = nn.Sequential(_Ema(), nn.Linear(4, 2)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    acc = Accumulator(model, optimizer, accumulation_steps=4)
    with pytest.warns(UserWarning, match="updated the buffers"):
        _micro_steps(acc, _data(micro_batches, torch.float64))
    return model, optimizer, acc


def _micro_steps(acc: Accumulator, data: list[Any]) -> None:
    for batch in data:
        acc.micro_step(batch, _mse)


def _ema_resumed(end: Callable[[Accumulator], Any], keep_start: bool = True) -> Any:
    """The second window saved after 2 micro-batches, resumed in a fresh Accumulator, ended."""
    model, optimizer, acc = _ema_run(6)
    saved = _via_bytes([model.state_dict(), optimizer.state_dict(), acc.state_dict()])
    if not keep_start:  # as a state saved before the window's start of buffers was
        del saved[2]["engine"]["buffers"]
    model, optimizer, acc = _ema_run(4)  # a fresh run elsewhere, between windows
    acc.load_state_dict(saved[2])  # before the model, as load_checkpoint does
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    end(acc)
    return clone_state(model.state_dict())


def _nan_micro_batch(acc: Accumulator) -> None:
    nan = (
        torch.full((2, 4), math.nan, dtype=torch.float64),
        torch.zeros(2, 2, dtype=torch.float64),
    )
    acc.micro_step(nan, _mse)
    assert acc.micro_step(nan, _mse).stepped is False  # the window closes, skipped


@pytest.mark.parametrize(
    "end",
    [
        pytest.param(lambda acc: acc.flush("drop"), id="dropped"),
        pytest.param(_nan_micro_batch, id="skipped"),
    ],
)
def test_a_resumed_window_forgotten_puts_forward_updated_buffers_back(
    end: Callable[..., Any],
) -> None:
    """Saved mid-window, the forward-updated buffers' window start is part of the state.

    Before, only BatchNorm's start was saved: a resumed window that was dropped or skipped put
    no buffer back, keeping the saved window's updates (`calls` over 4), unlike the
    uninterrupted run.
    """
    model, _, acc = _ema_run(6)
    end(acc)
    uninterrupted = clone_state(model.state_dict())
    assert int(uninterrupted["0.calls"]) == 4  # the second window's two calls put back
    assert_bitwise(_ema_resumed(end), uninterrupted)
    naive = _ema_resumed(end, keep_start=False)  # negative control: no saved start
    assert int(naive["0.calls"]) > 4  # the saved window's calls stay
    assert not torch.equal(naive["0.ema"], uninterrupted["0.ema"])


@pytest.mark.parametrize("entry", ["another buffer", "another shape", "garbage"])
def test_a_buffer_start_of_another_model_is_refused_changing_nothing(entry: str) -> None:
    state = _ema_run(6)[2].state_dict()
    state["engine"]["buffers"][0] = {
        "another buffer": ["1.nope", torch.zeros(4, dtype=torch.float64)],
        "another shape": ["0.calls", torch.zeros(3, dtype=torch.long)],
        "garbage": "garbage",
    }[entry]
    model, optimizer, target = _ema_run(5)  # its own window open, one micro-batch in
    before = clone_state(
        [[p.grad for p in model.parameters()], _everything(model, optimizer, target)]
    )
    with pytest.raises(ValueError, match=r"engine\.buffers"):
        target.load_state_dict(state)
    after = clone_state(
        [[p.grad for p in model.parameters()], _everything(model, optimizer, target)]
    )
    assert_bitwise(after, before)
    target.flush("drop")  # the target's own window start is still there
    assert int(model[0].calls) == 4


@pytest.mark.parametrize("ramp", [2, Tokens(4)])
def test_a_state_saved_after_a_ramp_names_the_setting_to_set_then_resumes_exactly(
    ramp: int | Tokens,
) -> None:
    """`acc.accumulation_steps = n` between windows, saved mid-window, resumed in a fresh build.

    The fresh Accumulator is built with the constructor's value, as the run's script does: the
    refusal names the assignment that makes it load, and the resumed run is bitwise the
    uninterrupted one.
    """
    data = _data(9, torch.float64)

    def ramped() -> tuple[nn.Module, torch.optim.Optimizer, Accumulator]:
        model, optimizer, acc = _setup()
        _micro_steps(acc, data[:3])  # the first window, of 3
        acc.accumulation_steps = ramp
        acc.micro_step(data[3], _mse)  # the ramped window, open
        return model, optimizer, acc

    model, optimizer, acc = ramped()
    _micro_steps(acc, data[4:])
    uninterrupted = _everything(model, optimizer, acc)
    saved = _via_bytes(_everything(*ramped()))
    model, optimizer, acc = _setup()
    before = _everything(model, optimizer, acc)
    with pytest.raises(ValueError, match=re.escape(f"set acc.accumulation_steps = {ramp!r}")):
        acc.load_state_dict(saved[2])
    assert_bitwise(_everything(model, optimizer, acc), before)
    acc.accumulation_steps = ramp  # what the message says
    acc.load_state_dict(saved[2])
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    _micro_steps(acc, data[4:])
    assert_bitwise(_everything(model, optimizer, acc), uninterrupted)


def test_a_state_saved_without_telemetry_resets_the_telemetry_it_is_loaded_into() -> None:
    """The loaded run's noise-scale averages are its own, whatever the target measured before.

    Before, a state saved with `telemetry=False` left a used target's averages and its open
    window's first measurement in place: the resumed run reported the target's history.
    """
    data = _data(16, torch.float64)
    source_model, source_opt, source = _setup()
    _micro_steps(source, data[:4])  # a window closed, one open
    saved = _via_bytes(_everything(source_model, source_opt, source))

    def resumed(used: bool) -> Any:
        model, optimizer, acc = _setup(telemetry=True)
        if used:
            _micro_steps(acc, data[:11])  # three windows measured, a fourth open
            assert acc.state_dict()["telemetry"]["steps"] > 0
        loaded = clone_state(saved)
        acc.load_state_dict(loaded[2])
        model.load_state_dict(loaded[0])
        optimizer.load_state_dict(loaded[1])
        results = [acc.micro_step(batch, _mse) for batch in data[4:]]
        return [(r.telemetry.noise_scale, r.telemetry.trace) for r in results if r.stepped], (
            _everything(model, optimizer, acc)
        )

    fresh, used = resumed(False), resumed(True)
    assert fresh[0] == used[0]
    assert_bitwise(fresh[1], used[1])


@pytest.mark.parametrize("then", ["loaded", "a window dropped", "a window skipped"])
def test_a_boundary_state_loaded_mid_window_leaves_no_partial_sums_behind(then: str) -> None:
    """Loading a state saved between windows forgets the target's own open window whole.

    Before, its partial gradient sums stayed in `.grad` after the load (the saved run had none
    there), and the next window set them aside as if they were the user's, so a window dropped
    or skipped after the load put them back.
    """
    data = _data(9, torch.float64)
    model, optimizer, source = _setup()
    _micro_steps(source, data[:3])  # one window, closed
    saved = _via_bytes(_everything(model, optimizer, source))
    assert all(p.grad is None for p in model.parameters())
    model, optimizer, target = _setup()
    _micro_steps(target, data[3:5])  # its own window open: partial sums in .grad
    assert all(p.grad is not None for p in model.parameters())
    target.load_state_dict(saved[2])
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    if then == "a window dropped":
        target.micro_step(data[5], _mse)
        target.flush("drop")
    elif then == "a window skipped":
        nan = (torch.full((2, 4), math.nan, dtype=torch.float64), data[5][1][:1].repeat(2, 1))
        results = [target.micro_step(batch, _mse) for batch in (data[5], nan, data[6])]
        assert results[-1].stepped is False  # non-finite: skipped
    assert [p.grad for p in model.parameters()] == [None] * len(list(model.parameters()))
    assert_bitwise(_everything(model, optimizer, target)[:2], saved[:2])
