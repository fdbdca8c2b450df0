"""BatchNorm modes under `torch.compile`, when the process compiled the model's class before.

Dynamo does not guard on module hooks (`skip_nnmodule_hook_guards`): a graph traced without
them is reused after hooks are added, even for another instance of the class. `"pooled"` and
`"frozen"` used to work through forward pre-hooks alone, so after a plain compiled step (a
baseline, a sweep, a notebook cell run again) they were silently skipped: `"pooled"` updated
the running statistics once per micro-batch plus nothing at the step, and `"frozen"` with a
loss_fn calling `model.train()` normalized with batch statistics and moved them. The modes now
change a flag Dynamo does guard on (`track_running_stats`, `training`) before the forward.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradaccum import Accumulator

RTOL, ATOL = 1e-10, 1e-12
SIZES = (4, 4, 3, 4, 4, 2, 4)  # 3 micro-batches per window: 2 full windows, a flushed one


class _Net(nn.Module):
    """A module with its own forward (Dynamo compiles it; an nn.Sequential it would skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.c = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.bn(self.a(x))))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net().double()


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 5, generator=generator, dtype=torch.float64) + i, torch.arange(n) % 3)
        for i, n in enumerate(SIZES)
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _habit(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    model.train()  # the defensive habit "frozen" must hold against
    return _loss(model, batch)


def _plain_compiled_steps() -> None:
    """What runs first in the process: a plain compiled training loop of another instance."""
    model = torch.compile(_net(), backend="aot_eager")
    for batch in _micro_batches():
        _loss(model, batch).backward()


def _train(mode: str, loss_fn, *, compiled: bool, micro_batches=None) -> _Net:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    driven = torch.compile(model, backend="aot_eager") if compiled else model
    acc = Accumulator(driven, optimizer, accumulation_steps=3, batchnorm=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "micro" warns that BatchNorm is inexact
        for batch in _micro_batches() if micro_batches is None else micro_batches:
            acc.micro_step(batch, loss_fn)
        acc.flush()
    return model


def _assert_equal_states(actual: nn.Module, expected: nn.Module) -> None:
    for (name, a), (_, e) in zip(
        actual.state_dict().items(), expected.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=name)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_pooled_after_a_plain_compiled_loop_updates_once_per_window_from_the_window() -> None:
    _plain_compiled_steps()
    compiled = _train("pooled", _loss, compiled=True)
    assert int(compiled.bn.num_batches_tracked) == 3  # one update per window, not per micro-batch
    _assert_equal_states(compiled, _train("pooled", _loss, compiled=False))
    # The reference: the first window's statistics are those of one plain full-batch forward.
    reference, first = _net().train(), _micro_batches()[:3]
    with torch.no_grad():
        reference(torch.cat([x for x, _ in first]))
    one_window = _train("pooled", _loss, compiled=True, micro_batches=first)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        expected = getattr(reference.bn, key)
        torch.testing.assert_close(getattr(one_window.bn, key), expected, rtol=RTOL, atol=ATOL)
    # Negative control: per-micro-batch updates (what the skipped hooks gave) are far off.
    micro = _train("micro", _loss, compiled=False)
    assert int(micro.bn.num_batches_tracked) == len(SIZES)
    gap = (micro.bn.running_var - compiled.bn.running_var).abs().max()
    assert float(gap) > 1e-2


def test_frozen_after_a_plain_compiled_loop_holds_when_loss_fn_calls_train() -> None:
    _plain_compiled_steps()
    start = dict(_net().bn.named_buffers())
    compiled = _train("frozen", _habit, compiled=True)
    for key, value in compiled.bn.named_buffers():
        assert torch.equal(value, start[key]), key  # running statistics bitwise untouched
    _assert_equal_states(compiled, _train("frozen", _habit, compiled=False))
    # Negative control: BatchNorm on batch statistics ("micro") takes other steps.
    micro = _train("micro", _habit, compiled=False)
    assert float((micro.c.weight - compiled.c.weight).detach().abs().max()) > 1e-3


def test_frozen_leaves_the_training_mode_loss_fn_asked_for() -> None:
    """As a plain loop would: before, every frozen layer was put back in train mode, so a
    loss_fn ending in model.eval() left BatchNorm alone in train mode."""

    def ends_in_eval(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = _loss(model, batch)
        model.eval()
        return loss

    model = _net()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, batchnorm="frozen"
    )
    acc.micro_step(_micro_batches()[0], ends_in_eval)
    assert [m.training for m in model.modules()] == [False] * 4
    model.eval()  # and a loss_fn switching an eval-mode model to train mode
    acc.micro_step(_micro_batches()[1], _habit)
    assert [m.training for m in model.modules()] == [True] * 4
    assert "train" not in vars(model.bn)  # the class's own train() again


def test_a_copy_made_inside_a_frozen_micro_batch_is_an_ordinary_module() -> None:
    copies: list[nn.Module] = []

    def makes_a_teacher(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        copies.append(copy.deepcopy(model))  # e.g. an EMA teacher made on first use
        return _loss(model, batch)

    model = _net()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, batchnorm="frozen"
    )
    acc.micro_step(_micro_batches()[0], makes_a_teacher)
    teacher = copies[0]
    assert teacher.train() is teacher
    assert teacher.bn.training
    assert teacher.eval() is teacher
    assert not teacher.bn.training
    assert model.bn.training  # the frozen original is back in its mode


class _CheckpointedBlocks(nn.Module):
    """Residual blocks with BatchNorm, each under activation checkpointing, in a loop."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(5, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(3)
        )
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return self.c(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_pooled_compiles_activation_checkpointed_blocks(reentrant: bool) -> None:
    """The pooled hook records the window's statistics, a Python side effect, which Dynamo
    refuses inside `torch.utils.checkpoint` (eager checkpointing replays a forward's side effects
    in the backward): every checkpointed BatchNorm broke the graph, and a break inside the loop
    over the blocks made Dynamo skip the whole forward. The model ran eagerly, compiled in 0
    frames, silently. The hook needs no replay (a recomputed forward is not counted), so pooled
    lets Dynamo skip it: the frames of "micro", and the weights and statistics bitwise those of
    the eager pooled run."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    start = _CheckpointedBlocks(reentrant).double()

    def frames_and_state(mode: str, compiled: bool) -> tuple[int, dict[str, torch.Tensor]]:
        model = copy.deepcopy(start)
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        wrapped = torch.compile(model, backend=counter) if compiled else model
        acc = Accumulator(
            wrapped,
            torch.optim.SGD(model.parameters(), lr=0.1),
            accumulation_steps=3,
            batchnorm=mode,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "micro" warns that BatchNorm is inexact
            for batch in _micro_batches():
                acc.micro_step(batch, _loss)
            acc.flush()
        return counter.frame_count, model.state_dict()

    micro_frames, _ = frames_and_state("micro", compiled=True)
    _, eager = frames_and_state("pooled", compiled=False)
    frames, compiled = frames_and_state("pooled", compiled=True)
    assert 1 <= frames == micro_frames  # before: 0, the whole forward eager
    for key, value in eager.items():
        assert torch.equal(compiled[key], value), key
    # One update per window: the recomputed forwards were not counted either.
    assert int(compiled["blocks.0.1.num_batches_tracked"]) == 3
