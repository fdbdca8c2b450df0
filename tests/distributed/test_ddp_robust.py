"""DDP on 2 real gloo ranks: the windows users really run, where ranks must never diverge or hang.

- a rank whose last micro-batch counts no item and returns a loss with no graph at all;
- a parameter that no micro-batch on any rank uses keeps `grad=None` and does not move under
  weight decay (plain and `accum_dtype` buffers);
- `DistributedDataParallel(static_graph=True)`: its first window is synchronized by DDP itself
  (every micro-batch), the later ones by the library, and every step is exact;
- a rank whose `loss_fn` raises mid-window: every rank raises, none waits, nothing changed, and
  the next window is exact;
- `micro_batch_size="auto"` (ranks agree on the sizes; the unused parameter stays `None`), and a
  learnable loss weight held by the optimizer outside the DDP model (reduced over ranks).

Each rank reports; the single-process references (one full-batch step on every rank's data)
are computed here, in the test process, with plain PyTorch.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator, LossSum
from gradaccum.sync import RankMismatchError
from tests.distributed._harness import describe, spawn_ranks
from tests.reference import kept_items_reference

EXACT = dict(rtol=1e-10, atol=1e-12)
MICRO, ITEMS, WINDOWS = 3, 7, 3


class Net(nn.Module):
    """An MLP with a parameter that nothing uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_net(dtype: torch.dtype = torch.float64) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net().to(dtype)


def rank_batch(window: int, rank: int, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """Rank 1's last micro-batch (item 6) counts nothing; in window 1 rank 1 counts nothing."""
    generator = torch.Generator().manual_seed(100 * window + rank)
    x = torch.randn(ITEMS, 4, generator=generator).to(dtype)
    y = torch.randn(ITEMS, 2, generator=generator).to(dtype)
    keep = torch.ones(ITEMS, dtype=torch.bool)
    if rank == 1:
        keep[6:] = False
        if window == 1:
            keep[:] = False
    return {"x": x, "y": y, "keep": keep}


def masked_loss(model: nn.Module, batch: dict[str, Any]) -> LossSum:
    """Sum of squared errors over kept items; with none kept, a constant with no graph at all."""
    keep = batch["keep"]
    if not bool(keep.any()):
        return LossSum(torch.zeros((), dtype=batch["x"].dtype), 0)  # the model never runs
    residual = model(batch["x"][keep]) - batch["y"][keep]
    return LossSum(residual.pow(2).sum(), int(keep.sum()))


def model_loss(model: nn.Module, batch: dict[str, Any]) -> LossSum:
    """The same loss, but the model always runs (a zero-item micro-batch still has a graph)."""
    residual = (model(batch["x"]) - batch["y"]).pow(2).sum(dim=1)
    return LossSum(residual[batch["keep"]].sum(), int(batch["keep"].sum()))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.5)


def reference_params(windows: int = WINDOWS) -> dict[str, torch.Tensor]:
    """One plain full-batch AdamW step per window on both ranks' kept items."""
    model = make_net()
    batches = [[rank_batch(window, rank) for rank in (0, 1)] for window in range(windows)]
    return kept_items_reference(model, make_optimizer(model.parameters()), batches)


def window0_gradient(per_rank_mean: bool) -> torch.Tensor:
    """The first layer's gradient of window 0: exact (item mean over ranks) or per-rank means."""
    model = make_net()
    batches = [rank_batch(0, rank) for rank in (0, 1)]
    sums = [(model(b["x"][b["keep"]]) - b["y"][b["keep"]]).pow(2).sum() for b in batches]
    counts = [int(b["keep"].sum()) for b in batches]
    if per_rank_mean:
        loss = (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    else:
        loss = (sums[0] + sums[1]) / sum(counts)
    loss.backward()
    grad = model.body[0].weight.grad
    assert grad is not None
    return grad


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}


def _run(rank: int, *, drive: str, static_graph: bool = False, bf16: bool = False) -> Any:
    dtype = torch.bfloat16 if bf16 else torch.float64
    ddp = DistributedDataParallel(make_net(dtype), static_graph=static_graph)
    optimizer = make_optimizer(ddp.parameters())
    options: dict[str, Any] = {"accum_dtype": torch.float32} if bf16 else {}
    # A static graph's first window is synchronized by DDP itself: every rank must run the model.
    loss_fn = model_loss if static_graph else masked_loss
    if drive == "auto":  # the sizes it plans and times: every rank agrees, every window exact
        acc = Accumulator(ddp, optimizer, micro_batch_size="auto", memory_budget="256MiB")
        for window in range(WINDOWS):
            acc.step(rank_batch(window, rank, dtype), loss_fn)
    elif drive == "step":
        acc = Accumulator(ddp, optimizer, micro_batch_size=MICRO, **options)
        for window in range(WINDOWS):
            acc.step(rank_batch(window, rank, dtype), loss_fn)
    else:
        acc = Accumulator(ddp, optimizer, accumulation_steps=3, **options)
        for window in range(WINDOWS):
            batch = rank_batch(window, rank, dtype)
            for start in range(0, ITEMS, MICRO):
                acc.micro_step({k: v[start : start + MICRO] for k, v in batch.items()}, loss_fn)
    return {"params": _params(ddp), "spare_grad": ddp.module.spare.grad}


def _static_graph_resume_mid_window(rank: int) -> str:
    """A saved open window cannot continue before a static graph's first (native) window."""
    source = DistributedDataParallel(make_net())
    acc = Accumulator(source, make_optimizer(source.parameters()), accumulation_steps=3)
    acc.micro_step({k: v[:MICRO] for k, v in rank_batch(0, rank).items()}, model_loss)
    state = acc.state_dict()
    static = DistributedDataParallel(make_net(), static_graph=True)
    target = Accumulator(static, make_optimizer(static.parameters()), accumulation_steps=3)
    try:
        target.load_state_dict(state)
    except ValueError as error:
        return str(error)
    return "accepted"


def _failure_mid_window(rank: int) -> dict[str, Any]:
    ddp = DistributedDataParallel(make_net())
    optimizer = make_optimizer(ddp.parameters())
    acc = Accumulator(ddp, optimizer, micro_batch_size=MICRO)
    acc.step(rank_batch(0, rank), masked_loss)
    before = (copy.deepcopy(_params(ddp)), copy.deepcopy(optimizer.state_dict()))
    calls = {"n": 0}

    def flaky(model: nn.Module, batch: dict[str, Any]) -> LossSum:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise ValueError("rank 1's loss failed")
        return masked_loss(model, batch)

    try:
        acc.step(rank_batch(1, rank), flaky)
        raised = None
    except Exception as error:  # every rank must raise, none may wait
        raised = f"{type(error).__name__}: {error}"
    unchanged = all(
        torch.equal(a, b) for a, b in zip(_params(ddp).values(), before[0].values(), strict=True)
    )
    grads_clear = all(p.grad is None for p in ddp.parameters())
    acc.step(rank_batch(2, rank), masked_loss)  # the next window runs on every rank
    return {"raised": raised, "unchanged": unchanged, "grads_clear": grads_clear}


def weighted_loss(model: nn.Module, batch: dict[str, Any], weight: torch.Tensor) -> LossSum:
    """`masked_loss` scaled by a learnable weight that lives outside the model."""
    loss = masked_loss(model, batch)
    return LossSum(loss.value * weight if loss.value.requires_grad else loss.value, loss.count)


def _outside_weight(rank: int) -> dict[str, Any]:
    """A learnable loss weight held by the optimizer but not the model: reduced over ranks too."""
    ddp = DistributedDataParallel(make_net())
    weight = nn.Parameter(torch.tensor(0.75, dtype=torch.float64))
    acc = Accumulator(ddp, make_optimizer([*ddp.parameters(), weight]), micro_batch_size=MICRO)
    for window in range(WINDOWS):
        acc.step(rank_batch(window, rank), lambda m, b: weighted_loss(m, b, weight))
    return {"params": _params(ddp), "weight": weight.detach().clone()}


def outside_weight_reference(ranks: tuple[int, ...] = (0, 1)) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the full batch of `ranks`' kept items, the weight in the same optimizer."""
    model, weight = make_net(), nn.Parameter(torch.tensor(0.75, dtype=torch.float64))
    optimizer = make_optimizer([*model.parameters(), weight])
    for window in range(WINDOWS):
        batches = [rank_batch(window, rank) for rank in ranks]
        x = torch.cat([b["x"][b["keep"]] for b in batches])
        y = torch.cat([b["y"][b["keep"]] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        ((model(x) - y).pow(2).sum() * weight / len(x)).backward()
        optimizer.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {**params, "weight": weight.detach().clone()}


def robust_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "auto": _run(rank, drive="auto"),
        "outside": _outside_weight(rank),
        "step": _run(rank, drive="step"),
        "stream": _run(rank, drive="stream"),
        "static": _run(rank, drive="step", static_graph=True),
        "static_stream": _run(rank, drive="stream", static_graph=True),
        "bf16": _run(rank, drive="step", bf16=True),
        "failure": _failure_mid_window(rank),
        "static_resume": _static_graph_resume_mid_window(rank),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outcomes = spawn_ranks(
        robust_worker, tmp_path_factory.mktemp("robust"), timeout=120.0, pg_timeout=20.0
    )
    assert all(o.ok for o in outcomes), describe(outcomes)
    return [o.result for o in outcomes]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["step", "stream", "static", "static_stream", "auto"])
def test_a_rank_whose_last_micro_batch_has_no_graph_matches_the_reference(
    runs: list[dict[str, Any]], case: str
) -> None:
    expected = reference_params()
    for rank, run in enumerate(runs):
        for name, want in expected.items():
            torch.testing.assert_close(run[case]["params"][name], want, **EXACT, msg=name)
        assert run[case]["spare_grad"] is None, rank
    # NEGATIVE CONTROL: DDP's plain recipe, each rank's own mean averaged over ranks, is far off
    # (rank 1 counts 6 items, rank 0 counts 7).
    exact, per_rank = window0_gradient(False), window0_gradient(True)
    assert (exact - per_rank).norm() / exact.norm() > 1e-2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["step", "stream", "bf16", "static", "auto"])
def test_a_parameter_no_rank_uses_keeps_no_gradient_and_does_not_move(
    runs: list[dict[str, Any]], case: str
) -> None:
    for run in runs:
        spare = run[case]["params"]["spare"]
        assert torch.equal(spare, torch.ones(3, dtype=spare.dtype))
        assert run[case]["spare_grad"] is None
    # NEGATIVE CONTROL: a zero gradient (what reducing zeros for it does) decays it under AdamW.
    spare = nn.Parameter(torch.ones(3, dtype=torch.float64))
    optimizer = make_optimizer([spare])
    spare.grad = torch.zeros_like(spare)
    optimizer.step()
    assert not torch.equal(spare, torch.ones(3, dtype=torch.float64))


@pytest.mark.timeout(180)
def test_a_learnable_weight_outside_the_model_is_reduced_over_ranks(
    runs: list[dict[str, Any]],
) -> None:
    """The optimizer's parameter outside the DDP model: summed over ranks, divided once."""
    expected = outside_weight_reference()
    for run in runs:
        torch.testing.assert_close(run["outside"]["weight"], expected["weight"], **EXACT)
        for name, got in run["outside"]["params"].items():
            torch.testing.assert_close(got, expected[name], **EXACT, msg=name)
    # NEGATIVE CONTROL: the weight trained on rank 0's items alone (not reduced) ends elsewhere.
    alone = outside_weight_reference(ranks=(0,))["weight"]
    assert abs(float(alone - expected["weight"])) > 1e-4


@pytest.mark.timeout(180)
def test_a_rank_that_raises_mid_window_makes_every_rank_raise_and_change_nothing(
    runs: list[dict[str, Any]],
) -> None:
    failing, other = runs[1]["failure"], runs[0]["failure"]
    assert failing["raised"].startswith("ValueError: rank 1's loss failed")
    assert other["raised"].startswith("RankMismatchError: rank 1 raised inside")
    for run in runs:
        assert run["failure"]["unchanged"]
        assert run["failure"]["grads_clear"]


@pytest.mark.timeout(180)
def test_a_static_graph_refuses_to_continue_a_saved_open_window(
    runs: list[dict[str, Any]],
) -> None:
    for run in runs:
        assert "static_graph=True" in run["static_resume"]
        assert "window boundaries" in run["static_resume"]


def test_the_reference_counts_the_zero_item_rank_right(tmp_path: Path) -> None:
    """The reference itself: window 1 has rank 0's items only; windows 0 and 2, 7 + 6."""
    counts = [
        sum(int(rank_batch(window, rank)["keep"].sum()) for rank in (0, 1)) for window in range(3)
    ]
    assert counts == [13, 7, 13]


# BatchNorm under DDP (broadcast_buffers=True, the default). DDP broadcasts rank 0's buffers in
# a forward that may sync: the very first one under no_sync() too, so a rank with no micro-batch
# in the first window left the others waiting in that broadcast. Rank 0 runs 3 micro-batches
# per window, rank 1 one, and none in window 0.
BN_ITEMS = {0: 6, 1: 2}
BN_MICRO, BN_WINDOWS = 2, 3


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def make_bn_net() -> BNNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return BNNet().double()


def bn_batch(window: int, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * window + rank)
    items = 0 if (window, rank) == (0, 1) else BN_ITEMS[rank]
    x = torch.randn(items, 4, generator=generator, dtype=torch.float64)
    return {"x": x, "y": torch.randn(items, 2, generator=generator, dtype=torch.float64)}


def bn_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    return LossSum((model(batch["x"]) - batch["y"]).pow(2).sum(), len(batch["x"]))


def batchnorm_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("micro", "pooled"):
        net = make_bn_net()
        ddp = DistributedDataParallel(net)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        acc = Accumulator(ddp, optimizer, micro_batch_size=BN_MICRO, batchnorm=mode)
        stepped = [acc.step(bn_batch(w, rank), bn_loss).stepped for w in range(BN_WINDOWS)]
        out[mode] = {
            "stepped": all(stepped),
            "params": _params(net),
            "buffers": {n: b.detach().clone() for n, b in net.named_buffers()},
        }
    return out


def batchnorm_reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """Full-batch steps over every rank's micro-batches (BatchNorm normalizes each micro-batch);
    the running statistics are rank 0's. Also returns rank 1's own (what it held unbroadcast)."""
    net = make_bn_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    own: dict[str, torch.Tensor] = {}
    for window in range(BN_WINDOWS):
        saved = [b.detach().clone() for b in net.bn.buffers()]
        optimizer.zero_grad(set_to_none=True)
        count = sum(len(bn_batch(window, rank)["x"]) for rank in (0, 1))
        for rank in (1, 0):  # rank 0 last: its statistics are the ones kept
            with torch.no_grad():
                for buffer, value in zip(net.bn.buffers(), saved, strict=True):
                    buffer.copy_(value)
            batch = bn_batch(window, rank)
            for start in range(0, len(batch["x"]), BN_MICRO):
                part = {k: v[start : start + BN_MICRO] for k, v in batch.items()}
                (bn_loss(net, part).value / count).backward()
            if rank == 1:
                own = {n: b.detach().clone() for n, b in net.named_buffers()}
        optimizer.step()
    buffers = {n: b.detach().clone() for n, b in net.named_buffers()}
    return _params(net), buffers, own


@pytest.mark.timeout(120)
def test_batchnorm_with_uneven_and_empty_first_windows_stays_equal_on_every_rank(
    tmp_path: Path,
) -> None:
    outcomes = spawn_ranks(batchnorm_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    params, buffers, own = batchnorm_reference()
    for mode in ("micro", "pooled"):
        zero, one = (o.result[mode] for o in outcomes)
        for got in (zero, one):
            assert got["stepped"], mode
            for name, value in params.items():
                torch.testing.assert_close(got["params"][name], value, **EXACT, msg=name)
            for name, value in zero["buffers"].items():  # rank 0's statistics everywhere
                assert torch.equal(got["buffers"][name], value), (mode, name)
    for name, value in buffers.items():  # "micro": as rank 0's micro-batches left them
        torch.testing.assert_close(outcomes[1].result["micro"]["buffers"][name], value, **EXACT)
    # NEGATIVE CONTROL: unbroadcast, rank 1 would hold its own statistics, far from rank 0's.
    assert (own["bn.running_mean"] - buffers["bn.running_mean"]).abs().max() > 1e-3


def streamed_failure_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`micro_step()` windows (3 micro-batches, then `Tokens(13)`) where rank 1's `loss_fn` raises
    in the second micro-batch; both ranks then run the next window over the same data."""
    from gradaccum import Tokens

    out: dict[str, Any] = {}
    for name, steps in (("fixed", 3), ("tokens", Tokens(13))):
        ddp = DistributedDataParallel(make_net())
        optimizer = make_optimizer(ddp.parameters())
        acc = Accumulator(ddp, optimizer, accumulation_steps=steps)
        before = copy.deepcopy(_params(ddp))
        batch = rank_batch(0, rank)

        def flaky(model: nn.Module, part: dict[str, Any]) -> LossSum:
            if rank == 1 and part.get("boom") is not None:
                raise ValueError("rank 1's loss failed")
            return masked_loss(model, part)

        raised, calls = None, 0
        try:
            for start in range(0, ITEMS, MICRO):
                part = {k: v[start : start + MICRO] for k, v in batch.items()}
                calls += 1
                if calls == 2:
                    part["boom"] = True  # a non-tensor leaf, passed as it is
                acc.micro_step(part, flaky)
        except Exception as error:  # every rank must raise, none may wait
            raised = f"{type(error).__name__}: {error}"
        unchanged = all(torch.equal(p, before[n]) for n, p in _params(ddp).items())
        grads_clear = all(p.grad is None for p in ddp.parameters())
        results = []
        for start in range(0, ITEMS, MICRO):  # window 0 again, whole: it must step exactly
            part = {k: v[start : start + MICRO] for k, v in batch.items()}
            results.append(acc.micro_step(part, masked_loss))
        if not any(r.stepped for r in results):
            results.append(acc.flush())
        out[name] = {
            "raised": raised,
            "calls": calls,
            "unchanged": unchanged,
            "grads_clear": grads_clear,
            "stepped": [r.stepped for r in results],
            "params": _params(ddp),
        }
    return out


@pytest.mark.timeout(120)
def test_a_rank_that_raises_in_micro_step_makes_every_rank_raise(tmp_path: Path) -> None:
    """Before the fix the failing rank forgot its window alone: the others went on, their
    windows paired with the wrong ones (or waited in a count's sum that never came)."""
    outcomes = spawn_ranks(streamed_failure_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    want = reference_params(windows=1)
    for name in ("fixed", "tokens"):
        other, failing = (o.result[name] for o in outcomes)
        assert failing["raised"] == "ValueError: rank 1's loss failed", name
        assert other["raised"] is not None, name
        assert other["raised"].startswith("RankMismatchError"), (name, other["raised"])
        assert "raised inside this accumulation window" in other["raised"]
        # fixed: rank 0 learns it at its window's boundary (3rd call); Tokens: at the 2nd count.
        assert other["calls"] == (3 if name == "fixed" else 2), name
        for got in (other, failing):
            assert got["unchanged"], name
            assert got["grads_clear"], name
            assert any(got["stepped"]), name
            for key, value in want.items():
                torch.testing.assert_close(got["params"][key], value, **EXACT, msg=key)


def join_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Uneven inputs under `DistributedDataParallel.join()`: rank 0 has 3 micro-batches, rank 1
    one. Before the fix rank 1 joined while rank 0 waited in the window's exchange (a hang)."""
    ddp = DistributedDataParallel(make_net())
    optimizer = make_optimizer(ddp.parameters())
    acc = Accumulator(ddp, optimizer, accumulation_steps=2)
    before = copy.deepcopy(_params(ddp))
    batch = rank_batch(0, rank)
    raised = []
    for drive in ("stream", "step"):
        try:
            with ddp.join():
                if drive == "step":
                    Accumulator(ddp, optimizer, micro_batch_size=MICRO).step(batch, masked_loss)
                for start in range(0, MICRO * (3 if rank == 0 else 1), MICRO):
                    acc.micro_step(
                        {k: v[start : start + MICRO] for k, v in batch.items()}, model_loss
                    )
                acc.flush()
        except ValueError as error:
            raised.append(str(error))
    unchanged = all(torch.equal(p, before[n]) for n, p in _params(ddp).items())
    return {"raised": raised, "unchanged": unchanged}


@pytest.mark.timeout(120)
def test_join_is_refused_on_every_rank_before_any_forward(tmp_path: Path) -> None:
    outcomes = spawn_ranks(join_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    for outcome in outcomes:
        assert len(outcome.result["raised"]) == 2, outcome.result
        for message in outcome.result["raised"]:
            assert "DistributedDataParallel.join() cannot run gradaccum windows" in message
            assert "DistributedSampler(drop_last=False)" in message
        assert outcome.result["unchanged"]


# Streams of different lengths (a sharded IterableDataset, a sampler that does not pad):
# `accumulation_steps=3`, then `flush()`. Rank 1 always has 6 micro-batches; rank 0 has 7 or 8
# (its last, partial window has no partner: rank 1's data ended on a boundary), 9 (a full window
# against rank 1's flush: refused on both) or 6 (nothing to flush anywhere).
STREAM_LENGTHS = (7, 8, 9, 6)


def stream_part(index: int, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + 10 * index + rank)
    x = torch.randn(2, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(2, 2, generator=generator, dtype=torch.float64)
    return {"x": x, "y": y, "keep": torch.ones(2, dtype=torch.bool)}


def uneven_stream_worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for length in STREAM_LENGTHS:
        ddp = DistributedDataParallel(make_net())
        acc = Accumulator(ddp, make_optimizer(ddp.parameters()), accumulation_steps=3)
        results: list[Any] = []
        before: dict[str, torch.Tensor] = {}
        try:
            for index in range(length if rank == 0 else 6):
                if index % 3 == 0:
                    before = copy.deepcopy(_params(ddp))
                results.append(acc.micro_step(stream_part(index, rank), masked_loss).stepped)
            if index % 3 == 2:  # the last window closed: flush() opens none here
                before = copy.deepcopy(_params(ddp))
            flushed = acc.flush()
            results.append(("flush", flushed.stepped, flushed.skipped))
        except RankMismatchError as error:
            results.append(str(error))
            results.append(all(torch.equal(p, before[n]) for n, p in _params(ddp).items()))
        dist.barrier()  # every rank leaves the stream at the same collective
        out[str(length)] = {"results": results, "params": _params(ddp)}
    return out


def stream_reference(length: int, *, drop_last: bool = False) -> dict[str, torch.Tensor]:
    lengths = (length, 6)
    windows = []
    for start in range(0, length, 3):
        window = [
            stream_part(index, rank)
            for rank in (0, 1)
            for index in range(start, min(start + 3, lengths[rank]))
        ]
        windows.append(window)
    if drop_last:
        windows = windows[:-1]
    model = make_net()
    return kept_items_reference(model, make_optimizer(model.parameters()), windows)


@pytest.mark.timeout(120)
def test_streams_of_different_lengths_flush_together_or_raise_on_every_rank(
    tmp_path: Path,
) -> None:
    """Before the fix a rank whose data ended on a window boundary made no collective in
    `flush()`, and the other rank's flush waited for it."""
    outcomes = spawn_ranks(uneven_stream_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    zero, one = (o.result for o in outcomes)
    for length in ("7", "8"):  # rank 1 joins rank 0's partial window: an exact step
        assert zero[length]["results"][-1] == ("flush", True, False), zero[length]
        assert one[length]["results"][-1] == ("flush", True, False), one[length]
        want = stream_reference(int(length))
        for got in (zero, one):
            for name, value in want.items():
                torch.testing.assert_close(got[length]["params"][name], value, **EXACT)
        # NEGATIVE CONTROL: without rank 0's last window the parameters are elsewhere.
        dropped = stream_reference(int(length), drop_last=True)
        assert max((dropped[n] - want[n]).abs().max().item() for n in want) > 1e-4
    for got in (zero, one):  # 9 against 6: a full window meets a flush; refused everywhere
        message, unchanged = got["9"]["results"][-2:]
        assert message.startswith("rank 1 called flush() (its data ended)"), message
        assert "DistributedSampler" in message
        assert unchanged is True
        assert got["6"]["results"][-1] == ("flush", False, False)  # nothing left anywhere


def comm_hook_worker(rank: int, world_size: int) -> dict[str, Any]:
    """DDP with the fp16 compression hook registered: it is never called (the library reduces
    in float64 itself), the user is told once, and the steps are exact."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DistributedDataParallel(make_net())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    acc = Accumulator(ddp, make_optimizer(ddp.parameters()), micro_batch_size=MICRO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for window in range(WINDOWS):
            assert acc.step(rank_batch(window, rank), masked_loss).stepped
    hook_warnings = [str(w.message) for w in caught if "communication hook" in str(w.message)]
    return {"warnings": hook_warnings, "params": _params(ddp)}


@pytest.mark.timeout(120)
def test_a_registered_comm_hook_is_named_unused_and_the_steps_stay_exact(tmp_path: Path) -> None:
    outcomes = spawn_ranks(comm_hook_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    want = reference_params()
    for outcome in outcomes:
        assert len(outcome.result["warnings"]) == 1, outcome.result["warnings"]
        assert "remove register_comm_hook()" in outcome.result["warnings"][0]
        for name, value in want.items():
            torch.testing.assert_close(outcome.result["params"][name], value, **EXACT)


def compiled_ddp_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`torch.compile(DistributedDataParallel(model))`, as PyTorch's docs combine them. Before
    the fix the compile wrapper hid the DDP model: the library ran a one-process window and DDP
    reduced (and averaged) every backward, which hung when ranks ran different numbers."""
    net = make_net()
    compiled = torch.compile(DistributedDataParallel(net), backend="aot_eager")
    acc = Accumulator(compiled, make_optimizer(compiled.parameters()), micro_batch_size=MICRO)
    for window in range(WINDOWS):
        batch = rank_batch(window, rank)
        if rank == 1:  # fewer micro-batches on rank 1: 1 against 3 (its dropped items cut off)
            batch = {k: v[:MICRO] for k, v in batch.items()}
        assert acc.step(batch, model_loss).stepped
    return {"params": _params(net)}


@pytest.mark.timeout(180)
def test_a_compiled_ddp_model_is_reduced_once_per_window_exactly(tmp_path: Path) -> None:
    outcomes = spawn_ranks(compiled_ddp_worker, tmp_path, timeout=150.0, pg_timeout=30.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    model = make_net()
    windows = [
        [rank_batch(w, 0), {k: v[:MICRO] for k, v in rank_batch(w, 1).items()}]
        for w in range(WINDOWS)
    ]
    want = kept_items_reference(model, make_optimizer(model.parameters()), windows)
    for outcome in outcomes:
        for name, value in want.items():
            torch.testing.assert_close(outcome.result["params"][name], value, **EXACT, msg=name)
    # NEGATIVE CONTROL: the mean of the two ranks' own means (DDP's averaging) is elsewhere.
    assert window0_gradient(per_rank_mean=True).sub(window0_gradient(False)).abs().max() > 1e-3


def unwrapped_model_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`Accumulator(ddp.module, ...)`: a slip that reduces nothing. The user is warned once (the
    DDP wrapper itself is not warned about), and the replicas do drift apart (the control)."""
    import warnings

    ddp = DistributedDataParallel(make_net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Accumulator(ddp, make_optimizer(ddp.parameters()), micro_batch_size=MICRO)
        wrapped = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accumulator(ddp.module, make_optimizer(ddp.parameters()), micro_batch_size=MICRO)
        for window in range(WINDOWS):
            acc.step(rank_batch(window, rank), masked_loss)
        unwrapped = [str(w.message) for w in caught if "not wrapped" in str(w.message)]
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {
        "wrapped": wrapped,
        "unwrapped": unwrapped,
        "drift": float((gathered[0] - gathered[1]).abs().max()),
    }


@pytest.mark.timeout(120)
def test_a_model_not_wrapped_for_its_ranks_is_warned_about_once(tmp_path: Path) -> None:
    outcomes = spawn_ranks(unwrapped_model_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    for outcome in outcomes:
        assert outcome.result["wrapped"] == []
        assert len(outcome.result["unwrapped"]) == 1, outcome.result["unwrapped"]
        message = outcome.result["unwrapped"][0]
        assert "2 ranks" in message
        assert "not ddp.module" in message
        assert outcome.result["drift"] > 1e-3  # control: the slip really leaves replicas apart


def tokens_flush_worker(rank: int, world_size: int) -> dict[str, Any]:
    """`Tokens` windows: rank 0's stream holds 4 micro-batches, rank 1's 3, then `flush()`.
    Rank 0's 4th micro-batch sums the window's counts over ranks while rank 1 flushes: before
    the fix the two collectives never met, and both ranks waited for the process group's
    timeout (a gloo error naming no cause)."""
    import time

    from gradaccum import Tokens

    ddp = DistributedDataParallel(make_net())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.1)
    acc = Accumulator(ddp, optimizer, accumulation_steps=Tokens(1000))
    params = [p.detach().clone() for p in ddp.parameters()]
    batch = rank_batch(0, 0)
    started, error = time.monotonic(), None
    try:
        for index in range(4 if rank == 0 else 3):
            acc.micro_step({k: v[index : index + 1] for k, v in batch.items()}, masked_loss)
        acc.flush()
    except RankMismatchError as caught:
        error = str(caught)
    unchanged = all(torch.equal(a, b) for a, b in zip(params, ddp.parameters(), strict=True))
    grads = [p.grad is None for p in ddp.parameters()]
    return {
        "error": error,
        "seconds": time.monotonic() - started,
        "unchanged": unchanged and not optimizer.state and all(grads),
        "open": acc._engine.window.is_open,
    }


# The process group's timeout of the test below: far above what its few micro-batches take even
# on a loaded machine (a 15 s bound under a 30 s timeout was within reach of CI's load), so that
# "told at once" and "told at the timeout" stay apart by a wide margin.
TOKENS_PG_TIMEOUT = 120.0


@pytest.mark.timeout(300)
def test_a_tokens_stream_flushed_early_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    outcomes = spawn_ranks(
        tokens_flush_worker, tmp_path, timeout=240.0, pg_timeout=TOKENS_PG_TIMEOUT
    )
    assert all(o.ok for o in outcomes), describe(outcomes)
    for outcome in outcomes:
        result = outcome.result
        assert result["error"] is not None, "no rank may step a mismatched window"
        assert "1 of 2 ranks called flush()" in result["error"]
        assert "same number of micro_step() calls" in result["error"]
        # Told at once, not when the process group's timeout expires.
        assert result["seconds"] < TOKENS_PG_TIMEOUT / 2, result["seconds"]
        assert result["unchanged"]
        assert not result["open"]


def _drop_stream(rank: int, lengths: tuple[int, int], flush: bool) -> dict[str, Any]:
    """`partial_window="drop"`, 2 micro-batches per window; this rank streams `lengths[rank]`."""
    ddp = DistributedDataParallel(make_net())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.1)
    acc = Accumulator(ddp, optimizer, accumulation_steps=2, partial_window="drop")
    batch, error, before = rank_batch(0, rank), None, None
    try:
        for index in range(lengths[rank]):
            if index % 2 == 0:
                before = [p.detach().clone() for p in ddp.parameters()]
            acc.micro_step({k: v[index : index + 1] for k, v in batch.items()}, masked_loss)
        if flush:
            acc.flush()
    except RankMismatchError as caught:
        error = str(caught)
    params = [p.detach().clone() for p in ddp.parameters()]
    unchanged = before is not None and all(
        torch.equal(a, b) for a, b in zip(before, params, strict=True)
    )
    grads_none = all(p.grad is None for p in ddp.parameters())
    return {"error": error, "params": params, "unchanged": unchanged, "grads_none": grads_none}


def drop_flush_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Streams of 4 and 3 micro-batches (rank 1's data ends first), then 4 and 5 and 3 and 3
    (every rank flushes together), against runs without the partial windows at all."""
    return {
        "mismatch": _drop_stream(rank, (4, 3), flush=True),
        "boundary": _drop_stream(rank, (4, 5), flush=True),
        "boundary_control": _drop_stream(rank, (4, 4), flush=False),
        "even": _drop_stream(rank, (3, 3), flush=True),
        "even_control": _drop_stream(rank, (2, 2), flush=False),
    }


@pytest.mark.timeout(120)
def test_a_dropping_flush_meets_the_other_ranks_exchange(tmp_path: Path) -> None:
    """Before the fix `partial_window="drop"` discarded the window locally: rank 0's last full
    window exchanged with rank 1's NEXT window (the next epoch's, silently), or waited."""
    outcomes = spawn_ranks(drop_flush_worker, tmp_path, timeout=90.0, pg_timeout=20.0)
    assert all(o.ok for o in outcomes), describe(outcomes)
    for outcome in outcomes:
        runs = outcome.result
        assert runs["mismatch"]["error"] is not None
        assert "rank 1 called flush()" in runs["mismatch"]["error"]
        assert runs["mismatch"]["unchanged"]
        assert runs["mismatch"]["grads_none"]
        for name in ("boundary", "even"):
            assert runs[name]["error"] is None
            assert runs[name]["grads_none"]
            for got, want in zip(
                runs[name]["params"], runs[f"{name}_control"]["params"], strict=True
            ):
                assert torch.equal(got, want), name
