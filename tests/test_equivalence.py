"""The central claim: an accumulated step equals one full-batch step, whatever the split.

Every test compares `gradaccum` with `tests/reference.py`, plain PyTorch written without the
library: in float64 to rtol 1e-10 (exactness up to rounding), in float32 to rtol 1e-5. The
gap is `max |ours - reference| / max |reference|` per tensor, over every parameter and every
optimizer-state tensor (momentum buffers, Adam moments).

The negative controls run the hand-written accumulation loops users commonly get wrong on the
same data and against the same reference, and must show a gap far beyond rounding, while the
library passes in the same test. That proves the comparison can fail.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import gradaccum
from tests.models import (
    IGNORE_INDEX,
    concat_batches,
    make_model,
    mse_loss,
    regression_batch,
    token_batch,
    token_mean_loss,
    token_sum_loss,
)
from tests.reference import (
    BUGGY_GRADS,
    buggy_step,
    grad_tensors,
    param_tensors,
    reference_grads,
    reference_step,
    relative_gap,
    relative_gaps,
    split,
    state_tensors,
)

B = 10  # micro-batch size 3 leaves a ragged last micro-batch of 1
STEPS = 5
MICRO_BATCH_SIZES = [1, 3, B // 2, B]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
CONTROL_GAP = 1e-4  # a buggy loop must be at least this far off: far beyond rounding
MAX_GRAD_NORM = 0.05  # below every gradient norm of these tasks, so clipping always happens
DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32], ids=["float64", "float32"]
)


@dataclass(frozen=True)
class Task:
    """A tiny model kind, a batch generator and the loss function used with it."""

    model: str
    loss_fn: Callable[[torch.nn.Module, Any], Any]
    make_batch: Callable[[torch.Generator, int, torch.dtype], Any]


TASKS = {
    # token cross-entropy returning LossSum, padded sequences of different lengths
    "tokens": Task("token", token_sum_loss, lambda g, n, dtype: token_batch(g, n)),
    # a plain scalar mean (MSE), weighted by the micro-batch's leading dimension
    "mse": Task("mlp", mse_loss, lambda g, n, dtype: regression_batch(g, n, dtype)),
}


def decay(epoch: int) -> float:
    """LambdaLR factor: a visible change of the learning rate at every step."""
    return 0.7**epoch


@dataclass
class Trainee:
    """A model with its optimizer and scheduler."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any

    def state(self) -> dict[str, torch.Tensor]:
        return state_tensors(self.model, self.optimizer)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def make_trainee(
    kind: str, dtype: torch.dtype, optimizer: str, schedule: bool, normalize: str = "mean"
) -> Trainee:
    """A fresh model (same initial weights for the same kind and dtype) with its optimizer."""
    model = make_model(kind, dtype)
    if optimizer == "sgd":
        lr = 0.1 if normalize == "mean" else 0.002  # "sum" gradients are ~count times larger
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, decay) if schedule else None
    return Trainee(model, opt, scheduler)


def batches(task: Task, generator: torch.Generator, dtype: torch.dtype, sizes: list[int]):
    return [task.make_batch(generator, n, dtype) for n in sizes]


def assert_close_results(result: gradaccum.StepResult, ref, rtol: float) -> None:
    """The StepResult reports what the reference step computed."""
    assert result.stepped
    assert not result.skipped
    assert result.count == ref.count
    assert result.lr == ref.lr
    assert math.isclose(result.loss, ref.loss, rel_tol=rtol)
    assert result.grad_norm is not None
    assert math.isclose(result.grad_norm, ref.grad_norm, rel_tol=rtol)


def assert_within(actual: dict, expected: dict, rtol: float) -> None:
    """Every tensor of `actual` is within `rtol` of `expected`; the message names the worst."""
    gaps = relative_gaps(actual, expected)
    worst = sorted(gaps.items(), key=lambda item: -item[1])[:3]
    assert max(gaps.values()) <= rtol, f"gap above {rtol:.0e}: " + ", ".join(
        f"{key} {gap:.3e}" for key, gap in worst
    )


# --------------------------------------------------------------------------------------------
# Whole-batch drive: Accumulator.step
# --------------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("task_name", list(TASKS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("clip_and_schedule", [False, True], ids=["plain", "clip+sched"])
@pytest.mark.parametrize("micro_batch_size", MICRO_BATCH_SIZES)
@pytest.mark.parametrize("normalize", ["mean", "sum"])
def test_step_equals_full_batch_step(
    dtype, task_name, optimizer, clip_and_schedule, micro_batch_size, normalize, generator
):
    task, rtol = TASKS[task_name], TOLERANCE[dtype]
    ref = make_trainee(task.model, dtype, optimizer, clip_and_schedule, normalize)
    ours = make_trainee(task.model, dtype, optimizer, clip_and_schedule, normalize)
    initial = param_tensors(ref.model)
    assert relative_gap(param_tensors(ours.model), initial) == 0.0
    max_grad_norm = MAX_GRAD_NORM if clip_and_schedule else None
    acc = gradaccum.Accumulator(
        ours.model,
        ours.optimizer,
        micro_batch_size=micro_batch_size,
        normalize=normalize,
        scheduler=ours.scheduler,
        max_grad_norm=max_grad_norm,
    )
    lrs = []
    for batch in batches(task, generator, dtype, [B] * STEPS):
        expected = reference_step(
            ref.model,
            ref.optimizer,
            batch,
            task.loss_fn,
            normalize=normalize,
            max_grad_norm=max_grad_norm,
            scheduler=ref.scheduler,
        )
        result = acc.step(batch, task.loss_fn)
        assert result.micro_batches == math.ceil(B / micro_batch_size)
        assert result.micro_batch_size == micro_batch_size
        assert_close_results(result, expected, rtol)
        if clip_and_schedule:
            assert expected.grad_norm > 2 * MAX_GRAD_NORM  # clipping really happened
        assert_within(ours.state(), ref.state(), rtol)
        assert ours.lr() == ref.lr()
        assert all(p.grad is None for p in ours.model.parameters())
        lrs.append(result.lr)
    if clip_and_schedule:
        assert lrs == pytest.approx([decay(i) * lrs[0] for i in range(STEPS)], rel=1e-12)
        assert len(set(lrs)) == STEPS
    assert relative_gap(param_tensors(ref.model), initial) > 1e-4  # the reference moved


@pytest.mark.parametrize("max_grad_norm", [None, MAX_GRAD_NORM], ids=["unclipped", "clipped"])
def test_clipping_bounds_the_update(max_grad_norm, generator):
    """With plain SGD (lr 1) the update IS the gradient: its norm must be the clipped norm."""
    model = make_model("token")
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = gradaccum.Accumulator(model, opt, micro_batch_size=3, max_grad_norm=max_grad_norm)
    result = acc.step(token_batch(generator, B), token_sum_loss)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    update_norm = float(torch.linalg.vector_norm(before - after))
    assert result.grad_norm > 2 * MAX_GRAD_NORM  # so clipping has something to do
    expected = result.grad_norm if max_grad_norm is None else max_grad_norm
    assert update_norm == pytest.approx(expected, rel=1e-4)


# --------------------------------------------------------------------------------------------
# Streaming drive: micro_step + flush, with a partial last window
# --------------------------------------------------------------------------------------------

STREAM_SIZES = [2, 3, 1, 2, 2, 3, 1]  # 7 ragged micro-batches
ACCUMULATION_STEPS = 3  # windows of 3, 3 and a partial 1


def make_stream(task_name, dtype, optimizer, partial_window, normalize="mean"):
    task = TASKS[task_name]
    ref = make_trainee(task.model, dtype, optimizer, True, normalize)
    ours = make_trainee(task.model, dtype, optimizer, True, normalize)
    acc = gradaccum.Accumulator(
        ours.model,
        ours.optimizer,
        accumulation_steps=ACCUMULATION_STEPS,
        normalize=normalize,
        scheduler=ours.scheduler,
        max_grad_norm=1.0,
        partial_window=partial_window,
    )
    return task, ref, ours, acc


def ref_window(task, ref: Trainee, micro_batches, normalize="mean"):
    """One reference step over the concatenated items of a window's micro-batches."""
    return reference_step(
        ref.model,
        ref.optimizer,
        concat_batches(micro_batches),
        task.loss_fn,
        normalize=normalize,
        max_grad_norm=1.0,
        scheduler=ref.scheduler,
    )


def run_full_windows(task, ref, ours, acc, stream, rtol, normalize="mean"):
    """Feed the stream; check every full window against the reference as it closes."""
    for index, micro_batch in enumerate(stream):
        result = acc.micro_step(micro_batch, task.loss_fn)
        closes = (index + 1) % ACCUMULATION_STEPS == 0
        assert result.stepped == closes
        if closes:
            window = stream[index + 1 - ACCUMULATION_STEPS : index + 1]
            assert_close_results(result, ref_window(task, ref, window, normalize), rtol)
            assert result.micro_batches == ACCUMULATION_STEPS
        assert_within(ours.state(), ref.state(), rtol)


@DTYPES
@pytest.mark.parametrize("task_name", list(TASKS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("normalize", ["mean", "sum"])
def test_stream_partial_window_step(dtype, task_name, optimizer, normalize, generator):
    task, ref, ours, acc = make_stream(task_name, dtype, optimizer, "step", normalize)
    rtol = TOLERANCE[dtype]
    initial = param_tensors(ref.model)
    stream = batches(task, generator, dtype, STREAM_SIZES)
    run_full_windows(task, ref, ours, acc, stream, rtol, normalize)
    result = acc.flush()  # the partial window of 1 micro-batch: an exact step over its items
    assert_close_results(result, ref_window(task, ref, stream[6:], normalize), rtol)
    assert result.micro_batches == 1
    assert_within(ours.state(), ref.state(), rtol)
    assert ours.lr() == ref.lr() == pytest.approx(decay(3) * ref.optimizer.defaults["lr"])
    assert not acc.flush().stepped  # nothing left to flush
    assert relative_gap(param_tensors(ref.model), initial) > 1e-4


@DTYPES
@pytest.mark.parametrize("task_name", list(TASKS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_stream_partial_window_drop(dtype, task_name, optimizer, generator):
    task, ref, ours, acc = make_stream(task_name, dtype, optimizer, "drop")
    rtol = TOLERANCE[dtype]
    stream = batches(task, generator, dtype, STREAM_SIZES)
    run_full_windows(task, ref, ours, acc, stream, rtol)
    before = ours.state()
    lr_before = ours.lr()
    result = acc.flush()
    assert not result.stepped
    assert relative_gap(ours.state(), before) == 0.0  # the partial window changed nothing
    assert ours.lr() == lr_before  # and the scheduler did not step
    assert all(p.grad is None for p in ours.model.parameters())
    # the next epoch starts a fresh window: the dropped items leave no trace in it
    next_epoch = batches(task, generator, dtype, [2, 1, 3])
    run_full_windows(task, ref, ours, acc, next_epoch, rtol)
    assert_within(ours.state(), ref.state(), rtol)


@DTYPES
@pytest.mark.parametrize("task_name", list(TASKS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_stream_partial_window_carry(dtype, task_name, optimizer, generator):
    task, ref, ours, acc = make_stream(task_name, dtype, optimizer, "carry")
    rtol = TOLERANCE[dtype]
    stream = batches(task, generator, dtype, STREAM_SIZES)
    run_full_windows(task, ref, ours, acc, stream, rtol)
    before = ours.state()
    result = acc.flush()
    assert not result.stepped
    assert result.micro_batches == 1
    assert relative_gap(ours.state(), before) == 0.0
    # next epoch: two more micro-batches complete the carried window of three
    next_epoch = batches(task, generator, dtype, [2, 3])
    assert not acc.micro_step(next_epoch[0], task.loss_fn).stepped
    result = acc.micro_step(next_epoch[1], task.loss_fn)
    assert result.micro_batches == ACCUMULATION_STEPS
    expected = ref_window(task, ref, [stream[6], *next_epoch])
    assert_close_results(result, expected, rtol)
    assert_within(ours.state(), ref.state(), rtol)


# --------------------------------------------------------------------------------------------
# Negative controls: hand-written loops that must FAIL against the same reference
# --------------------------------------------------------------------------------------------


def tokens_per_micro_batch(batch, micro_batch_size: int) -> list[int]:
    return [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in split(batch, micro_batch_size)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize(
    ("bug", "micro_batch_size"),
    [
        ("mean_of_means", 3),  # ragged in sequences (3, 3, 3, 1) and in tokens
        ("mean_of_means", 5),  # same number of sequences; only the padding differs
        ("zero_grad_inside", 3),
        ("last_micro_batch_only", 3),
    ],
)
def test_buggy_loop_fails_where_library_passes(bug, micro_batch_size, optimizer, generator):
    dtype = torch.float64
    ref = make_trainee("token", dtype, optimizer, True)
    ours = make_trainee("token", dtype, optimizer, True)
    buggy = make_trainee("token", dtype, optimizer, True)
    acc = gradaccum.Accumulator(
        ours.model,
        ours.optimizer,
        micro_batch_size=micro_batch_size,
        scheduler=ours.scheduler,
        max_grad_norm=1.0,
    )
    for batch in [token_batch(generator, B) for _ in range(STEPS)]:
        counts = tokens_per_micro_batch(batch, micro_batch_size)
        assert len(set(counts)) > 1, counts  # ragged token counts: the case that matters
        common = {"max_grad_norm": 1.0}
        reference_step(
            ref.model, ref.optimizer, batch, token_sum_loss, scheduler=ref.scheduler, **common
        )
        acc.step(batch, token_sum_loss)
        buggy_step(
            bug,
            buggy.model,
            buggy.optimizer,
            batch,
            token_mean_loss,
            micro_batch_size,
            scheduler=buggy.scheduler,
            **common,
        )
    ours_gap = relative_gap(ours.state(), ref.state())
    buggy_gap = relative_gap(buggy.state(), ref.state())
    assert ours_gap <= TOLERANCE[dtype]
    assert buggy_gap > CONTROL_GAP, f"{bug} was expected to differ, gap {buggy_gap:.2e}"
    # the bug is only in the loop: same code as the library without micro-batching is exact
    assert buggy.lr() == ref.lr()


@pytest.mark.parametrize("bug", list(BUGGY_GRADS))
def test_buggy_gradients_differ_from_full_batch(bug, generator):
    """Before any optimizer: the buggy loops' gradients themselves are off by far more than 1e-4."""
    batch = token_batch(generator, B)
    full = make_model("token")
    reference_grads(full, batch, token_sum_loss)
    buggy = make_model("token")
    BUGGY_GRADS[bug](buggy, batch, token_mean_loss, 3)
    ours = make_model("token")
    gradaccum.accumulate_grad(ours, batch, token_sum_loss, micro_batch_size=3)
    assert_within(grad_tensors(ours), grad_tensors(full), 1e-10)
    assert relative_gap(grad_tensors(buggy), grad_tensors(full)) > CONTROL_GAP


def test_float32_tolerance_is_tight_enough_to_catch_a_small_bug(generator):
    """A 1e-4 relative error in the objective's divisor is caught at the float32 tolerance."""
    dtype = torch.float32
    batch = token_batch(generator, B)
    full = make_model("token", dtype)
    reference_grads(full, batch, token_sum_loss)
    off = make_model("token", dtype)
    loss = token_sum_loss(off, batch)
    (loss.value / (int(loss.count) * (1 + 1e-4))).backward()
    ours = make_model("token", dtype)
    gradaccum.accumulate_grad(ours, batch, token_sum_loss, micro_batch_size=3)
    assert_within(grad_tensors(ours), grad_tensors(full), TOLERANCE[dtype])
    assert relative_gap(grad_tensors(off), grad_tensors(full)) > TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------
# accumulate_grad and check_equivalence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task_name", list(TASKS))
@pytest.mark.parametrize("micro_batch_size", MICRO_BATCH_SIZES)
@pytest.mark.parametrize("normalize", ["mean", "sum"])
def test_accumulate_grad_gives_full_batch_gradient(
    task_name, micro_batch_size, normalize, generator
):
    task, dtype = TASKS[task_name], torch.float64
    batch = task.make_batch(generator, B, dtype)
    full = make_model(task.model, dtype)
    ref_loss, ref_count = reference_grads(full, batch, task.loss_fn, normalize)
    ours = make_model(task.model, dtype)
    for param in ours.parameters():  # stale gradients must be replaced, not added to
        param.grad = torch.ones_like(param)
    result = gradaccum.accumulate_grad(
        ours, batch, task.loss_fn, micro_batch_size=micro_batch_size, normalize=normalize
    )
    assert_within(grad_tensors(ours), grad_tensors(full), 1e-10)
    assert result.count == ref_count
    objective = float(result.value) / (result.count if normalize == "mean" else 1)
    assert math.isclose(objective, ref_loss, rel_tol=1e-10)
    # the parameters themselves are untouched: no optimizer step
    assert relative_gap(param_tensors(ours), param_tensors(full)) == 0.0


def test_check_equivalence_ok_on_additive_model(generator):
    model = make_model("token", torch.float32)
    before = copy.deepcopy(model.state_dict())
    report = gradaccum.check_equivalence(
        model, token_batch(generator, B), token_sum_loss, micro_batch_size=3
    )
    assert report.ok
    assert report.max_rel_diff <= 1e-10
    assert report.dtype == torch.float64
    assert report.non_additive == ()
    text = str(report)
    for name, _ in model.named_parameters():
        assert name in text
    # the model itself was not touched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_check_equivalence_flags_batchnorm_in_train_mode(generator):
    model = make_model("bn", torch.float32).train()
    batch = regression_batch(generator, B, torch.float32)
    running_mean = model.bn.running_mean.clone()
    # micro-batches of 5: BatchNorm cannot run on a single item in train mode
    report = gradaccum.check_equivalence(model, batch, mse_loss, micro_batch_size=5)
    assert not report.ok
    assert report.max_rel_diff > CONTROL_GAP
    kinds = {module.kind for module in report.non_additive}
    assert "BatchNorm1d" in kinds
    assert "bn" in {module.name for module in report.non_additive}
    text = str(report)
    for name, _ in model.named_parameters():
        assert name in text
    assert "BatchNorm1d" in text
    assert torch.equal(model.bn.running_mean, running_mean)  # the copies ran, not the model
    # the same model in eval mode uses fixed statistics: additive again
    eval_report = gradaccum.check_equivalence(model.eval(), batch, mse_loss, micro_batch_size=3)
    assert eval_report.ok
    assert eval_report.non_additive == ()
