"""DDP as labs configure it, on 2 real gloo ranks (float64): each against plain PyTorch.

- `find_unused_parameters=True` with a layer only rank 0 uses, `gradient_as_bucket_view=True`,
  a tiny `bucket_cap_mb`, reentrant activation checkpointing under `static_graph=True`, and
  `ZeroRedundancyOptimizer` (with `micro_batch_size="auto"` too, whose plan replays this rank's
  local optimizer: ZeRO itself cannot be deep-copied): three windows equal three full-batch
  steps, ranks bitwise equal;
- torch's post-local SGD recipe (`post_localSGD_hook` and `PostLocalSGDOptimizer`, whose
  averaging step is a collective), with `micro_batch_size="auto"` too: the same exact steps (it
  was refused as a wrapper that never ran `Optimizer.__init__`, and planning could not copy it);
- `ZeroRedundancyOptimizer(overlap_with_ddp=True)`, whose step runs only inside a DDP hook that
  gradaccum never runs (its `step()` does nothing), is refused at construction;
- a model with `SyncBatchNorm` (its train-mode forward and backward are collectives) refuses
  uneven plans on every rank before any forward, nothing changed (on a GPU the ranks would wait
  for each other); with `batchnorm="frozen"` (no collective) the uneven window is exact;
- a `static_graph=True` model's first window (which DDP must reduce) inside the user's
  `model.no_sync()` raises a `ValueError` naming the fix, nothing changed (before: an internal
  assert of DDP's reducer); so does it with a communication hook registered (before, DDP reduced
  that window through `fp16_compress_hook`, 1e-4 off, while a warning said the hook was unused),
  a built-in one (`_register_builtin_comm_hook`) included, which was not seen at all; on a
  dynamic graph a built-in hook is named unused, as a Python one is, and the steps stay exact.

- a forward that reassigns its buffers (a running normalizer): rank 0's are broadcast after each
  step, read afresh (a list kept from construction was broadcast into dropped tensors); a
  parameter DDP ignores stays rank-local (it was summed over ranks).

The single-process references are computed in the test process with plain PyTorch.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from gradaccum import Accumulator, LossSum
from tests.distributed._harness import run_ranks
from tests.reference import relative_gap

EXACT = 1e-10
ITEMS, MICRO, WINDOWS = 7, 3, 3
HOOKS = ("python", "builtin")  # register_comm_hook(), _register_builtin_comm_hook()


class Net(nn.Module):
    """An MLP with a layer used only on some ranks and an optionally checkpointed head."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.side = nn.Linear(4, 2)  # only where the batch says so (rank 0)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        hidden = torch.tanh(self.body(x))
        if self.checkpointed:  # the reentrant kind, DDP's "marked ready twice" classic
            out = checkpoint(self.head, hidden, use_reentrant=True)
        else:
            out = self.head(hidden)
        return out + self.side(x) if side else out


def make_net(checkpointed: bool = False) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net(checkpointed).double()


def rank_batch(window: int, rank: int, side_ranks: tuple[int, ...]) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(100 * window + rank)
    return {
        "x": torch.randn(ITEMS, 4, generator=generator, dtype=torch.float64),
        "y": torch.randn(ITEMS, 2, generator=generator, dtype=torch.float64),
        "side": rank in side_ranks,
    }


def loss_fn(model: nn.Module, batch: dict[str, Any]) -> LossSum:
    residual = model(batch["x"], batch["side"]) - batch["y"]
    return LossSum(residual.pow(2).sum(), batch["x"].shape[0])


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def reference(
    side_ranks: tuple[int, ...], ranks: tuple[int, ...] = (0, 1)
) -> dict[str, torch.Tensor]:
    """One plain full-batch step per window on `ranks`' items (one rank: nothing reduced)."""
    model = make_net()
    optimizer = sgd(model.parameters())
    for window in range(WINDOWS):
        optimizer.zero_grad(set_to_none=True)
        losses = [loss_fn(model, rank_batch(window, rank, side_ranks)) for rank in ranks]
        objective = sum(loss.value for loss in losses) / sum(loss.count for loss in losses)
        objective.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _params(ddp: DistributedDataParallel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _train(rank: int, config: str) -> dict[str, torch.Tensor]:
    side_ranks: tuple[int, ...] = (0,)
    options: dict[str, Any] = {
        "unused": {"find_unused_parameters": True},
        "bucket_view": {"gradient_as_bucket_view": True},
        "tiny_buckets": {"bucket_cap_mb": 1e-5},
        "zero": {},
    }.get(config, {})
    if config == "static_checkpoint":  # a static graph: every rank uses the same parameters
        ddp = DistributedDataParallel(make_net(checkpointed=True), static_graph=True)
        side_ranks = ()
    else:
        ddp = DistributedDataParallel(make_net(), **options)
    if config.startswith("post_local"):  # torch's recipe: its hook (unused here) and optimizer
        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=1)
        ddp.register_comm_hook(state, post_localSGD_hook)
        averager = PeriodicModelAverager(period=1, warmup_steps=1)  # averages from the 2nd step
        optimizer: torch.optim.Optimizer = PostLocalSGDOptimizer(sgd(ddp.parameters()), averager)
    elif config.startswith("zero"):
        optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9,
            weight_decay=0.01,
        )  # fmt: skip
    else:
        optimizer = sgd(ddp.parameters())
    if config.endswith("auto"):
        acc = Accumulator(ddp, optimizer, micro_batch_size="auto", memory_budget="256MiB")
    else:
        acc = Accumulator(ddp, optimizer, micro_batch_size=MICRO)
    for window in range(WINDOWS):
        acc.step(rank_batch(window, rank, side_ranks), loss_fn)
    return _params(ddp)


def _zero_overlap_refused() -> str:
    ddp = DistributedDataParallel(make_net())
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, overlap_with_ddp=True
    )
    try:
        Accumulator(ddp, optimizer, micro_batch_size=MICRO)
    except ValueError as error:
        return str(error)
    return "accepted"


def _static_graph_inside_no_sync(rank: int) -> dict[str, Any]:
    """The user's `no_sync()` around the first window of a static graph: refused, then exact."""
    ddp = DistributedDataParallel(make_net(), static_graph=True)
    optimizer = sgd(ddp.parameters())
    before = _params(ddp)
    errors = []
    for drive in ("step", "micro_step"):
        try:
            with ddp.no_sync():
                if drive == "step":
                    acc = Accumulator(ddp, optimizer, micro_batch_size=MICRO)
                    acc.step(rank_batch(0, rank, ()), loss_fn)
                else:
                    acc = Accumulator(ddp, optimizer, accumulation_steps=3)
                    acc.micro_step(rank_batch(0, rank, ()), loss_fn)
            errors.append("accepted")
        except ValueError as error:
            errors.append(str(error))
    unchanged = all(torch.equal(before[n], p) for n, p in _params(ddp).items())
    untouched = all(p.grad is None for p in ddp.parameters()) and not optimizer.state
    acc = Accumulator(ddp, optimizer, micro_batch_size=MICRO)
    for window in range(WINDOWS):  # the user's no_sync() is harmless after the first window
        with ddp.no_sync() if window else contextlib.nullcontext():
            acc.step(rank_batch(window, rank, ()), loss_fn)
    return {
        "errors": errors,
        "unchanged": unchanged,
        "untouched": untouched,
        "params": _params(ddp),
    }


def make_bn_net() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
        return net.double()


def bn_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """7 items on rank 0, 4 on rank 1: 3 and 2 micro-batches of up to 3."""
    generator = torch.Generator().manual_seed(rank)
    items = 7 if rank == 0 else 4
    x = torch.randn(items, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(items, 2, generator=generator, dtype=torch.float64)


def bn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    return LossSum((model(batch[0]) - batch[1]).pow(2).sum(), batch[0].shape[0])


def _sync_batchnorm(rank: int) -> dict[str, Any]:
    """DDP refuses SyncBatchNorm on CPU at construction: swap it in afterwards (same tensors)."""
    results: dict[str, Any] = {}
    for mode in ("micro", "pooled", "frozen"):
        ddp = DistributedDataParallel(make_bn_net())
        plain = ddp.module[1]
        sync_bn = nn.SyncBatchNorm(8).double()
        sync_bn.weight, sync_bn.bias = plain.weight, plain.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(sync_bn, name, getattr(plain, name))
        ddp.module[1] = sync_bn
        forwards: list[int] = []
        ddp.module.register_forward_pre_hook(lambda *_, seen=forwards: seen.append(1))
        before = {k: v.clone() for k, v in ddp.module.state_dict().items()}
        acc = Accumulator(ddp, sgd(ddp.parameters()), micro_batch_size=MICRO, batchnorm=mode)
        try:
            acc.step(bn_batch(rank), bn_loss)
            error = None
        except RuntimeError as caught:
            error = f"{type(caught).__name__}: {caught}"
        after = ddp.module.state_dict()
        results[mode] = {
            "error": error,
            "forwards": len(forwards),
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "state": {k: v.clone() for k, v in after.items()},
        }
    return results


def sync_batchnorm_reference() -> dict[str, torch.Tensor]:
    """batchnorm="frozen": one full-batch step with the BatchNorm in eval mode."""
    model = make_bn_net()
    model[1].eval()
    optimizer = sgd(model.parameters())
    x, y = (torch.cat(parts) for parts in zip(*(bn_batch(rank) for rank in (0, 1)), strict=True))
    ((model(x) - y).pow(2).sum() / len(x)).backward()
    optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _register_fp16_hook(ddp: DistributedDataParallel, how: str) -> None:
    if how == "python":
        ddp.register_comm_hook(None, fp16_compress_hook)
    else:  # the C++ kind, which DDP keeps out of `_comm_hooks` (it was not seen)
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)


def _static_graph_with_comm_hook(rank: int, how: str) -> dict[str, Any]:
    ddp = DistributedDataParallel(make_net(), static_graph=True)
    _register_fp16_hook(ddp, how)
    optimizer = sgd(ddp.parameters())
    before = _params(ddp)
    acc = Accumulator(ddp, optimizer, micro_batch_size=MICRO)
    try:
        acc.step(rank_batch(0, rank, ()), loss_fn)
        error = "accepted"
    except ValueError as caught:
        error = str(caught)
    unchanged = all(torch.equal(before[n], p) for n, p in _params(ddp).items())
    untouched = all(p.grad is None for p in ddp.parameters()) and not optimizer.state
    return {"error": error, "unchanged": unchanged, "untouched": untouched}


def _builtin_comm_hook_unused(rank: int) -> dict[str, Any]:
    """A built-in fp16 hook on a dynamic graph: never run (the library reduces), so warned."""
    ddp = DistributedDataParallel(make_net())
    _register_fp16_hook(ddp, "builtin")
    acc = Accumulator(ddp, sgd(ddp.parameters()), micro_batch_size=MICRO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for window in range(WINDOWS):
            acc.step(rank_batch(window, rank, (0,)), loss_fn)
    hooks = [str(w.message) for w in caught if "communication hook" in str(w.message)]
    return {"warnings": hooks, "params": _params(ddp)}


class Normalized(nn.Module):
    """An RL-style running input normalizer whose forward REASSIGNS its buffers (not in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor, side: bool = False) -> torch.Tensor:
        if self.training:
            total = self.count + x.shape[0]
            self.mean = self.mean + (x.sum(0) - x.shape[0] * self.mean) / total
            self.count = total
        return self.net(x - self.mean, side)


def _reassigned_buffers(rank: int) -> dict[str, torch.Tensor]:
    ddp = DistributedDataParallel(Normalized())
    acc = Accumulator(ddp, sgd(ddp.parameters()), micro_batch_size=MICRO)
    for window in range(WINDOWS):
        acc.step(rank_batch(window, rank, ()), loss_fn)
    return {k: v.clone() for k, v in ddp.module.state_dict().items()}


def reassigned_buffers_reference() -> dict[str, torch.Tensor]:
    """Each window: every rank starts from rank 0's buffers (the broadcast) and updates them
    micro-batch by micro-batch; one full-batch step; rank 0's buffers carry on."""
    model = Normalized()
    optimizer = sgd(model.parameters())
    for window in range(WINDOWS):
        start, total, count = (model.count, model.mean), 0.0, 0
        for rank in (0, 1):
            model.count, model.mean = start
            batch = rank_batch(window, rank, ())
            for begin in range(0, ITEMS, MICRO):
                part = {key: batch[key][begin : begin + MICRO] for key in ("x", "y")}
                loss = loss_fn(model, {**part, "side": False})
                total, count = total + loss.value, count + int(loss.count)
            if rank == 0:
                kept = (model.count, model.mean)
        optimizer.zero_grad(set_to_none=True)
        (total / count).backward()
        optimizer.step()
        model.count, model.mean = kept
    return {k: v.clone() for k, v in model.state_dict().items()}


IGNORED = "head.bias"  # a rank-local parameter: DDP never reduces it


def _ignored_parameter(rank: int, static: bool) -> dict[str, torch.Tensor]:
    net = make_net()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, [IGNORED])
    ddp = DistributedDataParallel(net, static_graph=static)
    acc = Accumulator(ddp, sgd(ddp.parameters()), micro_batch_size=MICRO)
    for window in range(WINDOWS):
        acc.step(rank_batch(window, rank, () if static else (0,)), loss_fn)
    return _params(ddp)


def ignored_parameter_reference(static: bool) -> list[dict[str, torch.Tensor]]:
    """Two replicas sharing every parameter but `head.bias`: one full-batch step per window on
    the objective over both ranks' items, each rank's items through its own bias."""
    side_ranks = () if static else (0,)
    models = [make_net(), make_net()]
    models[1].body, models[1].side = models[0].body, models[0].side
    models[1].head.weight = models[0].head.weight
    optimizer = sgd([*models[0].parameters(), models[1].head.bias])
    for window in range(WINDOWS):
        optimizer.zero_grad(set_to_none=True)
        losses = [loss_fn(models[r], rank_batch(window, r, side_ranks)) for r in (0, 1)]
        (sum(loss.value for loss in losses) / sum(loss.count for loss in losses)).backward()
        optimizer.step()
    return [{n: p.detach().clone() for n, p in model.named_parameters()} for model in models]


def configs_worker(rank: int, world_size: int) -> dict[str, Any]:
    configs = (
        *("unused", "bucket_view", "tiny_buckets", "static_checkpoint", "zero", "zero_auto"),
        *("post_local", "post_local_auto"),
    )
    return {
        "trained": {config: _train(rank, config) for config in configs},
        "zero_overlap": _zero_overlap_refused(),
        "no_sync": _static_graph_inside_no_sync(rank),
        "sync_batchnorm": _sync_batchnorm(rank),
        "comm_hook": {how: _static_graph_with_comm_hook(rank, how) for how in HOOKS},
        "builtin_hook": _builtin_comm_hook_unused(rank),
        "reassigned_buffers": _reassigned_buffers(rank),
        "ignored": {static: _ignored_parameter(rank, static) for static in (False, True)},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(configs_worker, tmp_path_factory.mktemp("configs"), timeout=120.0)


def test_ddp_configurations_labs_use(runs: list[dict[str, Any]]) -> None:
    with_side, without_side = reference((0,)), reference(())
    for config, params in runs[0]["trained"].items():
        expected = without_side if config == "static_checkpoint" else with_side
        for rank, run in enumerate(runs):
            gap = relative_gap(run["trained"][config], expected)
            assert gap < EXACT, f"{config}, rank {rank}: {gap:.1e} from the full-batch reference"
            assert all(torch.equal(params[n], p) for n, p in run["trained"][config].items())
    assert relative_gap(reference((0,), ranks=(0,)), with_side) > 1e-3  # control: no reduction


def test_zero_with_overlap_with_ddp_is_refused_at_construction(
    runs: list[dict[str, Any]],
) -> None:
    """Its step() only logs a warning when overlapping: every window would train nothing."""
    for run in runs:
        assert run["zero_overlap"].startswith("ZeroRedundancyOptimizer(overlap_with_ddp=True)")
        assert "overlap_with_ddp=False" in run["zero_overlap"]


def test_a_static_graphs_first_window_inside_no_sync_is_refused_changing_nothing(
    runs: list[dict[str, Any]],
) -> None:
    expected = reference(())
    for rank, run in enumerate(runs):
        result = run["no_sync"]
        for error in result["errors"]:
            assert "inside model.no_sync()" in error, (rank, error)
            assert "outside no_sync()" in error
        assert result["unchanged"], rank
        assert result["untouched"], rank
        gap = relative_gap(result["params"], expected)
        assert gap < EXACT, f"rank {rank}: {gap:.1e} from the full-batch reference"


def test_sync_batchnorm_refuses_uneven_plans_before_any_forward(
    runs: list[dict[str, Any]],
) -> None:
    """Train-mode SyncBatchNorm all-gathers in every forward and all-reduces in every backward:
    3 micro-batches against 2 would leave rank 0 waiting (on a GPU; on CPU torch refuses it in
    the forward). Every rank raises first, naming each rank's plan, nothing changed;
    `batchnorm="frozen"` runs it in eval mode (no collective), so the uneven window is exact."""
    expected = sync_batchnorm_reference()
    for rank, run in enumerate(runs):
        for mode in ("micro", "pooled"):
            result = run["sync_batchnorm"][mode]
            assert result["error"] is not None, (rank, mode)
            assert result["error"].startswith("RankMismatchError: ranks planned different")
            assert "rank 0: 3 micro-batches" in result["error"]
            assert "SyncBatchNorm" in result["error"]
            assert "batchnorm='frozen'" in result["error"]
            assert result["forwards"] == 0, (rank, mode)
            assert result["unchanged"], (rank, mode)
        frozen = run["sync_batchnorm"]["frozen"]
        assert frozen["error"] is None, (rank, frozen["error"])
        gap = relative_gap(frozen["state"], expected)
        assert gap < EXACT, f"rank {rank}: {gap:.1e} from the full-batch reference"


def test_a_static_graphs_first_window_with_a_comm_hook_is_refused_changing_nothing(
    runs: list[dict[str, Any]],
) -> None:
    """DDP reduces that window itself, through the hook: fp16 compression rounded the step.

    A built-in hook (`_register_builtin_comm_hook`) is not in DDP's `_comm_hooks`: before, it was
    not seen, and that first window was reduced through fp16 compression, 1e-4 off, silently."""
    for rank, run in enumerate(runs):
        for how in HOOKS:
            result = run["comm_hook"][how]
            assert "communication hook" in result["error"], (rank, how, result["error"])
            assert "static_graph=False" in result["error"]
            assert result["unchanged"], (rank, how)
            assert result["untouched"], (rank, how)
        assert "FP16_COMPRESS" in run["comm_hook"]["builtin"]["error"]
        assert "fp16_compress_hook registered" in run["comm_hook"]["python"]["error"]


def test_a_builtin_comm_hook_is_named_unused_and_the_steps_stay_exact(
    runs: list[dict[str, Any]],
) -> None:
    """Before, the built-in hook went unnamed: no warning that it never runs."""
    expected = reference((0,))
    for rank, run in enumerate(runs):
        result = run["builtin_hook"]
        assert len(result["warnings"]) == 1, (rank, result["warnings"])
        assert "BuiltinCommHookType.FP16_COMPRESS registered" in result["warnings"][0]
        assert "is not used" in result["warnings"][0]
        gap = relative_gap(result["params"], expected)
        assert gap < EXACT, f"rank {rank}: {gap:.1e} from the full-batch reference"


def test_buffers_a_forward_reassigns_are_broadcast_from_rank_0(
    runs: list[dict[str, Any]],
) -> None:
    """`self.mean = self.mean + ...` replaces the buffer: DDP reads its buffers afresh before each
    broadcast. The library kept the list from construction and broadcast into tensors the module
    no longer held: each rank kept its own running statistics (count 21 against 15)."""
    expected = reassigned_buffers_reference()
    for rank, run in enumerate(runs):
        state = run["reassigned_buffers"]
        assert torch.equal(state["count"], runs[0]["reassigned_buffers"]["count"]), rank
        assert torch.equal(state["mean"], runs[0]["reassigned_buffers"]["mean"]), rank
        gap = relative_gap(state, expected)
        assert gap < EXACT, f"rank {rank}: {gap:.1e} from the full-batch reference"
    assert float(expected["count"]) == WINDOWS * ITEMS  # rank 0's items alone


def test_a_parameter_ddp_ignores_stays_rank_local(runs: list[dict[str, Any]]) -> None:
    """DDP never reduces a parameter named in `_set_params_and_buffers_to_ignore_for_model`;
    the library summed its gradients over ranks (the ranks' biases ended equal). A static graph's
    first window, which DDP averages itself, leaves it unaveraged too."""
    for static in (False, True):
        expected = ignored_parameter_reference(static)
        for rank, run in enumerate(runs):
            gap = relative_gap(run["ignored"][static], expected[rank])
            assert gap < EXACT, f"static={static}, rank {rank}: {gap:.1e} from the reference"
        biases = [run["ignored"][static][IGNORED] for run in runs]
        assert not torch.equal(biases[0], biases[1])
        assert relative_gap(expected[0], expected[1]) > 1e-3  # control: the biases differ
