"""Tests for gradaccum._written: trained weights written between two `micro_step()` calls."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import gradaccum.window
from gradaccum import Accumulator, load_checkpoint, save_checkpoint


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(8, 1, generator=generator, dtype=torch.float64)


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _other_weights(model: torch.nn.Module) -> torch.nn.Module:
    other = copy.deepcopy(model)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.05)
    return other


def _full_batch_step(start: torch.nn.Module) -> list[torch.Tensor]:
    """One plain SGD step on the whole batch from `start`'s weights, float64, by hand."""
    model = copy.deepcopy(start)
    x, y = _data()
    grads = torch.autograd.grad(_mse(model, (x, y)), list(model.parameters()))
    return [(p - 0.1 * g).detach() for p, g in zip(model.parameters(), grads, strict=True)]


def _load(model: torch.nn.Module, other: torch.nn.Module) -> None:
    model.load_state_dict(other.state_dict())


def _copy(model: torch.nn.Module, other: torch.nn.Module) -> None:
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            mine.copy_(theirs)


def _vector(model: torch.nn.Module, other: torch.nn.Module) -> None:
    vector = torch.nn.utils.parameters_to_vector(other.parameters()).detach()
    torch.nn.utils.vector_to_parameters(vector, model.parameters())


WRITES: dict[str, Callable[[torch.nn.Module, torch.nn.Module], None]] = {
    "load_state_dict": _load,
    "copy_": _copy,
    "vector_to_parameters": _vector,
}


def _window_with_a_write(write: Callable[[torch.nn.Module, torch.nn.Module], None]) -> tuple:
    model = _mlp()
    other = _other_weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    x, y = _data()
    acc.micro_step((x[:4], y[:4]), _mse)
    write(model, other)  # a rollback (or a weight sync) in the middle of the window
    return model, other, acc, (x, y)


@pytest.mark.parametrize("how", sorted(WRITES))
def test_weights_written_between_micro_steps_are_refused_and_the_next_window_is_exact(
    how: str,
) -> None:
    """Before, the step mixed the first micro-batch's gradient, taken at the old weights, with
    the second's (0.059 off either full-batch step, silently)."""
    model, other, acc, (x, y) = _window_with_a_write(WRITES[how])
    with pytest.raises(RuntimeError, match=r"written between two micro_step\(\) calls") as error:
        acc.micro_step((x[4:], y[4:]), _mse)
    assert "load_checkpoint(path, ..., accumulator=acc)" in str(error.value)
    # Nothing changed: the weights are the ones written, no gradient, no open window.
    for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        assert mine.grad is None
    assert not acc._engine.window.is_open
    # The loop goes on from the written weights: its next window is the full-batch step.
    expected = _full_batch_step(other)
    assert not acc.micro_step((x[:4], y[:4]), _mse).stepped
    assert acc.micro_step((x[4:], y[4:]), _mse).stepped
    for mine, theirs in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)


def test_negative_control_without_the_check_a_written_window_steps_a_mix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gradaccum.window, "written_error", lambda *args, **kwargs: None)
    model, other, acc, (x, y) = _window_with_a_write(_load)
    assert acc.micro_step((x[4:], y[4:]), _mse).stepped
    expected = [_full_batch_step(other), _full_batch_step(_mlp())]
    for reference in expected:
        gap = max(
            float((a.detach() - b).abs().max())
            for a, b in zip(model.parameters(), reference, strict=True)
        )
        assert gap > 1e-3


def test_a_write_flushed_is_refused_too_and_a_rollback_through_the_accumulator_is_not(
    tmp_path,
) -> None:
    """`flush('step')` reads the same marks; `load_checkpoint(..., accumulator=acc)` mid-window
    loads the weights after the window state, which is no write under the loaded window."""
    model, _, acc, (x, y) = _window_with_a_write(_load)
    with pytest.raises(RuntimeError, match="written between two micro_step"):
        acc.flush("step")
    # A checkpoint of a half window, loaded back in the middle of another one: exact.
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    acc.micro_step((x[:4], y[:4]), _mse)
    save_checkpoint(tmp_path / "half.pt", model=model, optimizer=optimizer, accumulator=acc)
    acc.flush("drop")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3)
    acc.micro_step((x[4:], y[4:]), _mse)  # another window, opened at other weights
    load_checkpoint(tmp_path / "half.pt", model=model, optimizer=optimizer, accumulator=acc)
    assert acc.micro_step((x[4:], y[4:]), _mse).stepped
    for mine, theirs in zip(model.parameters(), _full_batch_step(_mlp()), strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)


def test_a_deep_copy_mid_window_and_writes_inside_a_forward_are_not_refused() -> None:
    """A copy's parameters have other storages and counters; a forward writing its own weight
    (a max-norm clamp under no_grad) writes it inside the micro-batch, not between two."""
    model = _mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    x, y = _data()
    acc.micro_step((x[:4], y[:4]), _mse)
    twin = copy.deepcopy(acc)
    assert twin.micro_step((x[4:], y[4:]), _mse).stepped

    def clamped(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            model[0].weight.clamp_(-10, 10)
        return _mse(model, batch)

    assert acc.micro_step((x[4:], y[4:]), clamped).stepped


def test_a_written_window_dropped_with_flush_is_discarded_without_an_error() -> None:
    """`flush('drop')` after the write discards the window as asked (it raised the refusal of a
    window it was discarding anyway); the next window is the full-batch step from the weights
    written."""
    model, other, acc, (x, y) = _window_with_a_write(_load)
    dropped = acc.flush("drop")
    assert not dropped.stepped
    assert all(p.grad is None for p in model.parameters())
    assert acc.micro_step((x[:4], y[:4]), _mse).micro_batches == 1
    assert acc.micro_step((x[4:], y[4:]), _mse).stepped
    for mine, theirs in zip(model.parameters(), _full_batch_step(other), strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)


@pytest.mark.parametrize("write", sorted(WRITES))
def test_weights_swapped_out_for_validation_and_put_back_are_not_refused(write: str) -> None:
    """Validation on EMA weights mid-window: swapped in, evaluated, the trained weights put back
    (by the same writer) leave the window's model as it was, so the window steps as the full
    batch; it was refused and discarded (a false alarm). A put-back one rounding off is still a
    write, refused (the control)."""
    model = _mlp()
    start, ema = copy.deepcopy(model), _other_weights(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    x, y = _data()
    acc.micro_step((x[:3], y[:3]), _mse)
    for half in (x[3:5], y[3:5]), (x[5:], y[5:]):
        backup = copy.deepcopy(model)
        WRITES[write](model, ema)  # validation on the EMA weights
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
        WRITES[write](model, backup)  # the trained weights back, bitwise
        result = acc.micro_step(half, _mse)
    assert result.stepped
    for mine, theirs in zip(model.parameters(), _full_batch_step(start), strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)

    acc.micro_step((x[:4], y[:4]), _mse)
    off = copy.deepcopy(model)
    with torch.no_grad():
        next(off.parameters()).view(-1)[0] += 1e-12  # one element, one rounding step away
    WRITES[write](model, off)
    with pytest.raises(RuntimeError, match="written between two micro_step"):
        acc.micro_step((x[4:], y[4:]), _mse)


@pytest.mark.parametrize("end", ["micro_step", "flush"])
def test_a_write_through_p_data_is_refused_before_the_windows_last_micro_batch(end: str) -> None:
    """`p.data.copy_()` mid-window (a hand-written rollback) moves no version counter: the step
    mixed two models' gradients, silently. The norms are compared before the window's last
    micro-batch (or `flush('step')`): refused, the window discarded, the weights as written; the
    next window is the full-batch step from them. A `.data` write that puts the same values
    back is not refused (the control)."""
    model = _mlp()
    other = _other_weights(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    x, y = _data()
    acc.micro_step((x[:3], y[:3]), _mse)
    saved = [p.detach().clone() for p in model.parameters()]
    for param, value in zip(model.parameters(), saved, strict=True):
        param.data.copy_(value)  # the same values: nothing to refuse
    acc.micro_step((x[3:5], y[3:5]), _mse)
    for param, theirs in zip(model.parameters(), other.parameters(), strict=True):
        param.data.copy_(theirs.data)  # a rollback to other weights, mid-window
    last = (
        (lambda: acc.flush("step"))
        if end == "flush"
        else lambda: acc.micro_step((x[5:], y[5:]), _mse)
    )
    with pytest.raises(RuntimeError, match=r"p\.data\.copy_\(\)"):
        last()
    assert all(p.grad is None for p in model.parameters())
    for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    acc.micro_step((x[:3], y[:3]), _mse)
    acc.micro_step((x[3:5], y[3:5]), _mse)
    assert acc.micro_step((x[5:], y[5:]), _mse).stepped
    for mine, theirs in zip(model.parameters(), _full_batch_step(other), strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)
