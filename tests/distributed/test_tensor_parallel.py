"""Tensor parallel (`parallelize_module`), alone and with FSDP2 on a 2-D mesh: gloo CPU, exact.

Every rank of a tensor-parallel (TP) group sees the same batch; only the data-parallel (DP)
ranks see different ones. So the window's count is the sum over DP ranks, each batch once:

- TP alone over every rank (2 ranks): the `Accumulator` needs no reduction (DTensor's autograd
  reduces within the TP group), and the total norm of DTensor gradients is global. Exact for a
  mean with clipping and for `normalize="sum"`, without the warning that no gradient is reduced
  (before: a false alarm, "each rank steps on its own data alone").
- FSDP2 + TP on a (dp=2, tp=2) mesh (4 ranks, `fully_shard(model, mesh=mesh["dp"])`): FSDP2
  averages over the 2 DP ranks while the exchange ran over all 4, so every batch was counted
  twice: `normalize="sum"` stepped twice too far (a gradient norm of 14.9 for 7.46),
  `StepResult.count` was doubled and `Tokens(n)` windows closed early. Now one exchange row per
  DP index counts, and ranks of a TP group that counted differently are refused.
- `torch.distributed._composable.replicate` (DDP-based) averages every backward in its own hooks:
  it was driven as a plain model (13 % off on ragged counts, with a warning that no gradient is
  reduced); now refused at construction, naming `DistributedDataParallel`, which (given
  `device_mesh=`) is exact.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed._harness import fsdp_api, needs_fsdp2, run_ranks
from tests.distributed.test_uneven_windows import (
    EXACT,
    full_params,
    items,
    make_optimizer,
    make_tiny,
    masked_loss,
)

pytestmark = needs_fsdp2  # DTensor and tensor parallel on CPU: the same torch versions

MICRO = 3
STEP_DATA = [[(10, 7, 5), (11, 4, 1)], [(20, 5, 5), (21, 8, 7)]]  # [window][dp]: seed, n, kept
STREAMED = [[3, 3, 1, 2], [1, 0, 2, 3]]  # [dp][micro-batch]: items counted, Tokens(6) windows
TOKENS = 6
CLIP = 0.5


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise, rowwise = ColwiseParallel(), RowwiseParallel()
    return {"embed": colwise, "blocks.0.0": rowwise, "blocks.1.0": colwise, "head": rowwise}


def step_batch(window: int, dp: int) -> dict[str, torch.Tensor]:
    seed, n, kept = STEP_DATA[window][dp]
    return items(seed, n, kept)


def streamed_batch(dp: int, index: int) -> dict[str, torch.Tensor]:
    return items(500 + 10 * dp + index, MICRO, STREAMED[dp][index])


def tokens_windows(replicas: int = 1) -> list[list[int]]:
    """Each Tokens window's micro-batches, from the counts (each counted `replicas` times)."""
    windows: list[list[int]] = [[]]
    total = 0
    for index in range(len(STREAMED[0])):
        windows[-1].append(index)
        total += replicas * sum(row[index] for row in STREAMED)
        if total >= TOKENS:
            windows.append([])
            total = 0
    return [w for w in windows if w]


def reference(
    windows: list[list[dict[str, torch.Tensor]]], normalize: str, clip: float | None
) -> tuple[dict[str, torch.Tensor], list[tuple[float, int]]]:
    """One plain float64 full-batch step per window on one process: params, (norm, count)."""
    model = make_tiny()
    optimizer = make_optimizer(model)
    seen = []
    for batches in windows:
        x = torch.cat([b["x"][b["keep"]] for b in batches])
        y = torch.cat([b["y"][b["keep"]] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        loss = (model(x) - y).pow(2).sum()
        (loss / len(x) if normalize == "mean" else loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))
        seen.append((float(norm), len(x)))
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, seen


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "gradient is reduced" in str(w.message)]


def tp_alone_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for normalize, clip in (("mean", CLIP), ("sum", None)):
        model = parallelize_module(make_tiny(), mesh, tp_plan())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc = Accumulator(
                model,
                make_optimizer(model),
                micro_batch_size=MICRO,
                normalize=normalize,
                max_grad_norm=clip,
            )
            results = [acc.step(step_batch(w, 0), masked_loss) for w in range(len(STEP_DATA))]
        out[normalize] = {
            "params": full_params(model),
            "seen": [(r.grad_norm, r.count) for r in results],
            "warnings": ours(caught),
        }
    return out


def two_d_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from gradaccum import Accumulator, Tokens

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()

    def build() -> nn.Module:
        model = parallelize_module(make_tiny(), mesh["tp"], tp_plan())
        fsdp_api().fully_shard(model, mesh=mesh["dp"])
        return model

    out: dict[str, Any] = {}
    for normalize, clip, policy in (("sum", None, "window"), ("mean", CLIP, "micro")):
        model = build()
        acc = Accumulator(
            model,
            make_optimizer(model),
            micro_batch_size=MICRO,
            normalize=normalize,
            max_grad_norm=clip,
            sync_policy=policy,
        )
        results = [acc.step(step_batch(w, dp), masked_loss) for w in range(len(STEP_DATA))]
        out[normalize] = {
            "params": full_params(model),
            "seen": [(r.grad_norm, r.count) for r in results],
        }
    model = build()
    acc = Accumulator(
        model, make_optimizer(model), accumulation_steps=Tokens(TOKENS), normalize="sum"
    )
    closed = [
        index
        for index in range(len(STREAMED[dp]))
        if acc.micro_step(streamed_batch(dp, index), masked_loss).stepped
    ]
    flushed = acc.flush()
    out["tokens"] = {"params": full_params(model), "closed": closed, "flushed": flushed.stepped}
    return out


def replicate_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed._composable import replicate
    from torch.distributed.device_mesh import init_device_mesh

    from gradaccum import Accumulator

    model = replicate(make_tiny())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(model)
    try:
        Accumulator(model, optimizer, micro_batch_size=MICRO)
    except ValueError as error:
        refused = str(error)
    else:
        refused = ""
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    unchanged = unchanged and not optimizer.state and all(p.grad is None for p in before.values())
    # The fix the message names: DistributedDataParallel, here given a device mesh.
    mesh = init_device_mesh("cpu", (world_size,))
    ddp = nn.parallel.DistributedDataParallel(make_tiny(), device_mesh=mesh)
    acc = Accumulator(ddp, make_optimizer(ddp), micro_batch_size=MICRO, normalize="sum")
    for window in range(len(STEP_DATA)):
        acc.step(step_batch(window, rank), masked_loss)
    return {"refused": refused, "unchanged": unchanged, "params": full_params(ddp)}


def step_windows() -> list[list[dict[str, torch.Tensor]]]:
    return [[step_batch(w, dp) for dp in range(2)] for w in range(len(STEP_DATA))]


def assert_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **EXACT, msg=f"{what} {name}")


@pytest.mark.timeout(120)
def test_tensor_parallel_alone_equals_the_full_batch_step_without_a_false_warning(
    tmp_path: Path,
) -> None:
    results = run_ranks(tp_alone_worker, tmp_path, world_size=2, timeout=90.0)
    for normalize, clip in (("mean", CLIP), ("sum", None)):
        want, seen = reference([[step_batch(w, 0)] for w in range(2)], normalize, clip)
        for rank, got in enumerate(results):
            case = got[normalize]
            assert_params(case["params"], want, f"rank {rank} {normalize}")
            for (norm, count), (ref_norm, ref_count) in zip(case["seen"], seen, strict=True):
                assert count == ref_count
                assert norm == pytest.approx(ref_norm, rel=1e-10)  # the global norm
            assert case["warnings"] == [], case["warnings"]  # every rank sees the same batch


@pytest.mark.timeout(150)
def test_fsdp2_with_tensor_parallel_counts_each_batch_once(tmp_path: Path) -> None:
    results = run_ranks(two_d_worker, tmp_path, world_size=4, timeout=120.0, pg_timeout=60.0)
    streamed = [[streamed_batch(dp, i) for dp in range(2) for i in w] for w in tokens_windows()]
    complete = [w for w in tokens_windows() if sum(STREAMED[d][i] for d in (0, 1) for i in w) >= 6]
    assert len(complete) == 2
    assert tokens_windows(replicas=2) != tokens_windows()  # double counting would show
    for normalize, clip in (("sum", None), ("mean", CLIP)):
        want, seen = reference(step_windows(), normalize, clip)
        for rank, got in enumerate(results):
            case = got[normalize]
            assert_params(case["params"], want, f"rank {rank} {normalize}")
            for (norm, count), (ref_norm, ref_count) in zip(case["seen"], seen, strict=True):
                assert count == ref_count, (rank, normalize)  # not the TP degree times it
                assert norm == pytest.approx(ref_norm, rel=1e-10)
    want, _ = reference(streamed, "sum", None)
    for rank, got in enumerate(results):
        assert got["tokens"]["closed"] == [w[-1] for w in complete], rank
        assert got["tokens"]["flushed"] == (len(complete) < len(tokens_windows()))
        assert_params(got["tokens"]["params"], want, f"rank {rank} tokens")


@pytest.mark.timeout(120)
def test_composable_replicate_is_refused_naming_ddp_which_is_exact(tmp_path: Path) -> None:
    results = run_ranks(replicate_worker, tmp_path, world_size=2, timeout=90.0)
    want, _ = reference(step_windows(), "sum", None)
    for rank, got in enumerate(results):
        assert "DistributedDataParallel(model)" in got["refused"], got["refused"]
        assert "Nothing was changed" in got["refused"]
        assert got["unchanged"], rank
        assert_params(got["params"], want, f"rank {rank} ddp(device_mesh)")


def test_ranks_of_a_tensor_parallel_group_that_counted_differently_are_refused() -> None:
    from gradaccum._agreement import RankMismatchError
    from gradaccum._tensor_parallel import one_row_per_batch

    alike = torch.tensor([[5.0, 0.0], [5.0, 0.0], [2.0, 1.0], [2.0, 1.0]])
    assert one_row_per_batch(alike, 1)[:, 0].sum().item() == 7.0  # each batch once
    apart = torch.tensor([[5.0, 0.0], [4.0, 0.0], [2.0, 1.0], [2.0, 1.0]])
    with pytest.raises(RankMismatchError, match="must see the same batch"):
        one_row_per_batch(apart, 1)


class TinyLM(nn.Module):
    """Embedding, a LayerNorm'd residual MLP and a vocabulary head: the tensor-parallel LM shape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)
        self.norm1 = nn.LayerNorm(8)
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.norm2 = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        hidden = hidden + self.ff(self.norm1(hidden))
        return self.out(self.norm2(hidden))


def make_lm() -> TinyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyLM().double()
        with torch.no_grad():  # LayerNorm's weights away from 1, its biases from 0
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
        return model


LM_WINDOWS = [(1, 5, 1), (2, 3, 0), (3, 4, 2)]  # seed, rows, padded positions at the end


def lm_batch(seed: int, rows: int, padded: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 8, (rows, 4), generator=generator)
    labels = torch.randint(0, 8, (rows, 4), generator=generator)
    labels[:, 4 - padded :] = -100
    return {"ids": ids, "labels": labels}


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], inside: bool = True) -> Any:
    """Token cross-entropy sum; `inside`: computed in `loss_parallel()`, as torch's docs show."""
    from torch.distributed.tensor.parallel import loss_parallel

    from gradaccum import LossSum

    logits, labels = model(batch["ids"]).flatten(0, 1), batch["labels"].flatten()
    with loss_parallel() if inside else contextlib.nullcontext():
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum", ignore_index=-100)
    return LossSum(loss, int((labels != -100).sum()))


def outside_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    return lm_loss(model, batch, inside=False)


def sequence_parallel_plan() -> dict[str, Any]:
    """torch's tutorial plan: sequence-sharded norms, vocabulary-sharded logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm1": SequenceParallel(),
        "ff": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "ff.0": ColwiseParallel(),
        "ff.2": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "out": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }


def loss_parallel_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for case in ("step", "micro_step", "step inside loss_parallel"):
        model = parallelize_module(make_lm(), mesh, sequence_parallel_plan())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        sizes: dict[str, Any] = {"accumulation_steps": 8} if case == "micro_step" else {}
        acc = Accumulator(model, optimizer, micro_batch_size=2, max_grad_norm=CLIP, **sizes)
        norms = []
        for window in LM_WINDOWS:
            batch = lm_batch(*window)
            if case == "step":
                norms.append(acc.step(batch, lm_loss).grad_norm)
            elif case == "micro_step":  # the window's rows one by one, closed by flush()
                rows = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(window[1])]
                for row in rows:
                    acc.micro_step(row, lm_loss)
                norms.append(acc.flush().grad_norm)
            else:  # the whole step in the context, the loss_fn without its own
                with loss_parallel():
                    norms.append(acc.step(batch, outside_loss).grad_norm)
        out[case] = {"params": full_params(model), "norms": norms}
    return out


def lm_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    model = make_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    norms = []
    for window in LM_WINDOWS:
        batch = lm_batch(*window)
        optimizer.zero_grad(set_to_none=True)
        value = outside_loss(model, batch)
        (value.value / value.count).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


@pytest.mark.timeout(150)
def test_a_loss_computed_in_loss_parallel_is_backpropagated_in_it_exactly(
    tmp_path: Path,
) -> None:
    """torch's `loss_parallel()` (vocabulary-sharded logits, with SequenceParallel norms) needs
    the backward inside the context too: the library's backward ran after `loss_fn` had left
    it and raised "aten.nll_loss_backward.default got mixed torch.Tensor and DTensor" on every
    rank. Now it is entered for the backward; a step run inside the context stays exact too."""
    results = run_ranks(loss_parallel_worker, tmp_path, world_size=2, timeout=120.0)
    want, norms = lm_reference()
    for rank, got in enumerate(results):
        for case, seen in got.items():
            assert_params(seen["params"], want, f"rank {rank} {case}")
            assert seen["norms"] == pytest.approx(norms, rel=1e-10), (rank, case)


def test_the_loss_parallel_context_is_entered_only_for_a_class_sharded_cross_entropy() -> None:
    from gradaccum._tensor_parallel import loss_parallel_context

    logits = torch.randn(3, 4, requires_grad=True)
    loss = nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2]), reduction="sum")
    assert isinstance(loss_parallel_context([loss]), contextlib.nullcontext)  # plain tensors


def optimizer_full_params(optimizer: torch.optim.Optimizer, names: list[str]) -> Any:
    """The full parameters from DDP's local shards (DDP keeps their layout as `_st_info`)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in zip(names, optimizer.param_groups[0]["params"], strict=True):
        layout = param._st_info
        full = DTensor.from_local(
            param.detach(), layout.mesh, layout.placements, shape=layout.shape, stride=layout.stride
        ).full_tensor()
        out[name] = full.clone()
    return out


def ddp_tensor_parallel_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    out: dict[str, Any] = {}
    for normalize, clip in (("mean", CLIP), ("sum", None)):
        model = parallelize_module(make_tiny(), mesh["tp"], tp_plan())
        names = [name for name, _ in model.named_parameters()]
        ddp = nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
        optimizer = make_optimizer(ddp)
        acc = Accumulator(
            ddp, optimizer, micro_batch_size=MICRO, normalize=normalize, max_grad_norm=clip
        )
        results = [acc.step(step_batch(w, dp), masked_loss) for w in range(len(STEP_DATA))]
        out[normalize] = {
            "params": optimizer_full_params(optimizer, names),
            "seen": [(r.grad_norm, r.count) for r in results],
        }
    return out


@pytest.mark.timeout(150)
def test_ddp_over_a_tensor_parallel_model_clips_by_the_global_norm(tmp_path: Path) -> None:
    """`DistributedDataParallel(parallelize_module(...), device_mesh=mesh["dp"])` on a (dp=2,
    tp=2) mesh: DDP trains each DTensor parameter's local shard, so the gradients were plain
    tensors and their norm each rank's own: the two ranks of a tensor-parallel group clipped by
    different norms (0.25 off, silently) and `StepResult.grad_norm` was a shard's (6.80 for
    8.08). The shards are now read as DTensors for the norm and the clip."""
    results = run_ranks(
        ddp_tensor_parallel_worker, tmp_path, world_size=4, timeout=120.0, pg_timeout=60.0
    )
    for normalize, clip in (("mean", CLIP), ("sum", None)):
        want, seen = reference(step_windows(), normalize, clip)
        for rank, got in enumerate(results):
            case = got[normalize]
            assert_params(case["params"], want, f"rank {rank} {normalize}")
            for (norm, count), (ref_norm, ref_count) in zip(case["seen"], seen, strict=True):
                assert count == ref_count, (rank, normalize)
                assert norm == pytest.approx(ref_norm, rel=1e-10), (rank, normalize)


UNEVEN_LM = [[(1, 5, 1), (2, 1, 0)], [(3, 2, 0), (4, 6, 3)]]  # [window][dp]: 3 and 1 micro-batches


def fsdp2_loss_parallel_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from gradaccum import Accumulator

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model = parallelize_module(make_lm(), mesh["tp"], sequence_parallel_plan())
    fsdp_api().fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=2, max_grad_norm=CLIP)
    norms = [acc.step(lm_batch(*window[dp]), lm_loss).grad_norm for window in UNEVEN_LM]
    return {"params": full_params(model), "norms": norms}


@pytest.mark.timeout(150)
def test_fsdp2_tensor_parallel_uneven_windows_with_loss_parallel_are_exact(tmp_path: Path) -> None:
    """FSDP2 + TP with a `loss_parallel()` cross-entropy of `logits.flatten(0, 1)`, one data-
    parallel rank planning 3 micro-batches and the other 1: the latter runs zero-item ones (an
    empty slice of its batch), where torch's `loss_parallel` refuses the flattened empty logits
    ("requires exactly one mesh dim to shard tensor dimension 1"). That rank raised and the
    others waited for it. The loss of a micro-batch counting nothing is not needed: the zeros go
    through the model's outputs, and the steps are the full-batch steps."""
    results = run_ranks(
        fsdp2_loss_parallel_worker, tmp_path, world_size=4, timeout=120.0, pg_timeout=60.0
    )
    model = make_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    norms = []
    for window in UNEVEN_LM:
        optimizer.zero_grad(set_to_none=True)
        losses = [outside_loss(model, lm_batch(*batch)) for batch in window]
        (sum(x.value for x in losses) / sum(x.count for x in losses)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for rank, got in enumerate(results):
        assert_params(got["params"], want, f"rank {rank}")
        assert got["norms"] == pytest.approx(norms, rel=1e-10), rank
