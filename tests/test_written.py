"""Tests for gradaccum._written: trained weights written between two `micro_step()` calls."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import gradaccum._engine_state
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


class _ScheduleFreeSGD(torch.optim.Optimizer):
    """Schedule-free SGD as the `schedulefree` package steps it: the model holds y, the
    interpolation of the average x and the SGD iterate z; `eval()` moves it to x, `train()` back
    (two `lerp_` calls: the round trip rounds)."""

    def __init__(self, params, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "k": 0, "train_mode": True})

    @torch.no_grad()
    def _move(self, train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] != train:
                weight = 1 - group["beta"] if train else 1 - 1 / group["beta"]
                for param in group["params"]:
                    if "z" in self.state[param]:
                        param.lerp_(self.state[param]["z"], weight)
                group["train_mode"] = train

    def eval(self) -> None:
        self._move(train=False)

    def train(self) -> None:
        self._move(train=True)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                z = self.state[param].setdefault("z", param.clone())
                param.lerp_(z, 1 - 1 / group["beta"])  # y -> x
                z.sub_(param.grad, alpha=group["lr"])
                param.lerp_(z, 1 / (group["k"] + 1))
                param.lerp_(z, 1 - group["beta"])  # x -> y
            group["k"] += 1


def _swap_ema_in_and_out(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    kept = [p.detach().clone() for p in model.parameters()]
    _copy(model, _other_weights(model))  # EMA weights in for the evaluation
    with torch.no_grad():
        model(_data()[0])
        for param, value in zip(model.parameters(), kept, strict=True):
            param.copy_(value)  # and the trained ones back


def _schedule_free_eval(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.eval()
    with torch.no_grad():
        model(_data()[0])
    optimizer.train()


def _rounding_round_trip(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Weights scaled and scaled back: back within rounding, not bitwise (as some averages are)."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3.0).div_(3.0)


EVALUATIONS = {
    "schedule-free eval/train": _schedule_free_eval,
    "EMA swap": _swap_ema_in_and_out,
    "rounding round trip": _rounding_round_trip,
}


def _carried_run(evaluate: Callable[[torch.nn.Module, torch.optim.Optimizer], None]) -> tuple:
    """Windows of two micro-batches over epochs of five: the third is carried over the end of
    the first epoch, where `evaluate` runs (after two steps, so that `eval()` moves them)."""
    model = _mlp()
    optimizer = _ScheduleFreeSGD(model.parameters())
    acc = Accumulator(model, optimizer, accumulation_steps=2, partial_window="carry")
    x, y = _data()
    parts = [(x[a:b], y[a:b]) for a, b in ((0, 2), (2, 3), (3, 5), (5, 6), (6, 8))]
    for index, part in enumerate(parts):
        assert acc.micro_step(part, _mse).stepped == (index % 2 == 1)
    assert not acc.flush().stepped  # the epoch ends inside the third window: carried
    evaluate(model, optimizer)
    return model, acc, parts


def _reference_steps() -> list[torch.Tensor]:
    """The same three windows as plain full-batch steps of their items, float64."""
    model = _mlp()
    optimizer = _ScheduleFreeSGD(model.parameters())
    x, y = _data()
    for rows in ([0, 1, 2], [3, 4, 5], [6, 7, 0, 1]):
        optimizer.zero_grad()
        _mse(model, (x[rows], y[rows])).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("how", sorted(EVALUATIONS))
def test_an_evaluation_putting_the_weights_back_in_a_carried_window_steps_the_full_batch(
    how: str,
) -> None:
    """A schedule-free optimizer's `eval()`/`train()` (or an EMA swapped in and out) at the end
    of an epoch whose last window is carried wrote the weights and put them back (the round trip
    rounds): the next `micro_step()` refused the window as written and discarded it. Weights
    back within rounding of the carried window's are its own: the step is the full batch's."""
    model, acc, parts = _carried_run(EVALUATIONS[how])
    assert acc.micro_step(parts[0], _mse).stepped  # the next epoch completes the window
    for mine, theirs in zip(model.parameters(), _reference_steps(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)


def test_negative_control_without_the_kept_weights_a_carried_evaluation_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the kept copy, a round trip that rounds (norms not bitwise back) is refused."""
    monkeypatch.setattr(gradaccum.window, "kept_weights", lambda marks, params: marks)
    _, acc, parts = _carried_run(_rounding_round_trip)
    with pytest.raises(RuntimeError, match="written between two micro_step"):
        acc.micro_step(parts[0], _mse)


def test_weights_left_elsewhere_in_a_carried_window_are_still_refused() -> None:
    """`eval()` without `train()` (the model left at the average) and a rollback are refused as
    any write, the message naming the schedule-free fix."""

    def eval_only(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.eval()

    def rollback(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        _load(model, _other_weights(model))

    for evaluate in (eval_only, rollback):
        model, acc, parts = _carried_run(evaluate)
        written = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"schedule-free optimizer's eval\(\) inside"):
            acc.micro_step(parts[0], _mse)
        assert not acc._engine.window.is_open
        for mine, theirs in zip(model.parameters(), written, strict=True):
            assert torch.equal(mine, theirs)
            assert mine.grad is None


def test_wgan_weight_clipping_after_every_micro_step_is_named_and_after_the_step_is_exact() -> None:
    """WGAN's critic clipped (`p.clamp_(-c, c)` under no_grad) after every micro_step(), as a
    loop copied from one without accumulation clips after every optimizer.step(): refused as a
    write, but the message listed only loads, copies and optimizers, none of which the loop
    had. It names the clipping and its place now, after a result with stepped=True, where it
    equals the plain loop that clips after each step."""
    model = _mlp()
    acc = Accumulator(model, torch.optim.RMSprop(model.parameters(), lr=5e-3), accumulation_steps=2)
    x, y = _data()
    acc.micro_step((x[:4], y[:4]), _mse)
    with torch.no_grad():
        for param in model.parameters():
            param.clamp_(-0.05, 0.05)
    with pytest.raises(RuntimeError, match=r"p\.clamp_\(-c, c\).*stepped=True"):
        acc.micro_step((x[4:], y[4:]), _mse)
    reference = copy.deepcopy(model)  # the weights as clipped; the window was discarded
    # Clipped when a step was taken: the plain loop's critic, clipped after each step.
    plain = torch.optim.RMSprop(reference.parameters(), lr=5e-3)
    for _ in range(3):
        for index in (slice(0, 4), slice(4, 8)):
            result = acc.micro_step((x[index], y[index]), _mse)
            if result.stepped:
                with torch.no_grad():
                    for param in model.parameters():
                        param.clamp_(-0.05, 0.05)
        plain.zero_grad()
        _mse(reference, (x, y)).backward()
        plain.step()
        with torch.no_grad():
            for param in reference.parameters():
                param.clamp_(-0.05, 0.05)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=0)


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


def _zero_grad(model: torch.nn.Module, other: torch.nn.Module) -> None:
    model.zero_grad()


def _zero_grad_kept(model: torch.nn.Module, other: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=False)


SPOILS = {**WRITES, "zero_grad": _zero_grad, "zero_grad(set_to_none=False)": _zero_grad_kept}


def _resumed_from(path, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    """A fresh model, optimizer and Accumulator loaded from `path`, its window's second half run."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    assert acc.micro_step((x[4:], y[4:]), _mse).stepped
    return model


@pytest.mark.parametrize("how", sorted(SPOILS))
def test_a_window_spoiled_after_its_last_micro_step_is_not_saved(how: str, tmp_path) -> None:
    """Early stopping that breaks mid-window, restores the best weights and saves (or a copied
    loop's zero_grad() before the save): the file held the spoiled window and the resumed run
    stepped it silently (the earlier gradients taken at other weights, or dropped). Now the save
    is refused naming flush('drop'), nothing written or changed; after the drop it saves and the
    resumed window is the full-batch step from the weights as they are."""
    model, _, acc, (x, y) = _window_with_a_write(SPOILS[how])
    path = tmp_path / "best.pt"
    path.write_bytes(b"previous checkpoint")
    optimizer = acc.optimizer
    with pytest.raises(RuntimeError, match=r"was not saved.*acc\.flush\('drop'\)") as error:
        save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    assert "The window was discarded" not in str(error.value)
    assert path.read_bytes() == b"previous checkpoint"
    with pytest.raises(RuntimeError, match="was not saved"):
        acc.state_dict()
    assert acc._engine.window.is_open  # kept
    assert acc._engine.window.micro_batches == 1
    weights = copy.deepcopy(model)
    acc.flush("drop")
    save_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    # The resumed run: a fresh window of the whole batch, from the weights as they were saved.
    resumed = _resumed_from_start(path, x, y)
    for mine, theirs in zip(resumed.parameters(), _full_batch_step(weights), strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)


def _resumed_from_start(path, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    assert not acc.micro_step((x[:4], y[:4]), _mse).stepped
    assert acc.micro_step((x[4:], y[4:]), _mse).stepped
    return model


@pytest.mark.parametrize("how", ["load_state_dict", "zero_grad"])
def test_negative_control_a_spoiled_window_saved_resumes_into_a_wrong_step(
    how: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gradaccum._engine_state, "refuse_spoiled_save", lambda *args: None)
    model, _, acc, (x, y) = _window_with_a_write(SPOILS[how])
    weights = copy.deepcopy(model)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=acc.optimizer, accumulator=acc)
    resumed = _resumed_from(tmp_path / "c.pt", x, y)  # no error anywhere
    for reference in (_full_batch_step(weights), _full_batch_step(_mlp())):
        gap = max(
            float((a.detach() - b).abs().max())
            for a, b in zip(resumed.parameters(), reference, strict=True)
        )
        assert gap > 1e-3


def test_a_window_saved_after_weights_were_put_back_resumes_exactly(tmp_path) -> None:
    """No false alarm: validation on swapped-in weights, put back before the save."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    x, y = _data()
    acc.micro_step((x[:4], y[:4]), _mse)
    backup = copy.deepcopy(model.state_dict())
    model.load_state_dict(_other_weights(model).state_dict())
    model.load_state_dict(backup)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=optimizer, accumulator=acc)
    resumed = _resumed_from(tmp_path / "c.pt", x, y)
    for mine, theirs in zip(resumed.parameters(), _full_batch_step(_mlp()), strict=True):
        torch.testing.assert_close(mine.detach(), theirs, rtol=1e-10, atol=0)
