"""FSDP2's sync policy: one reduce-scatter per window, or one per micro-batch, both exact.

`sync_policy="window"` defers the reduce-scatter to the window's last backward (each rank holds
the unsharded gradient sums for the window); `"micro"` lets every backward reduce-scatter (each
rank holds only its shard, at N times the communication). Both must give the single-process
full-batch step (float64, rtol 1e-10) in every uneven-window scenario of
`test_uneven_windows.py`, on 2 gloo ranks and both recipes. The reduce-scatters are counted, and
`accum_dtype=torch.float32` buffers, which only the micro policy can feed, beat plain bf16
accumulation against float64 by a factor.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed._harness import fsdp_api, needs_fsdp2, run_ranks
from tests.distributed.test_uneven_windows import (
    EXACT,
    make_tiny,
    masked_loss,
    reference,
    shard,
    uneven_worker,
)

pytestmark = needs_fsdp2

MICRO_BATCHES = 4
BF16_ITEMS = 64  # micro-batches of one item: 64 bf16 additions per gradient element


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("recipe", "world_size"), [("blocks+root", 2), ("root", 2), ("blocks+root", 4), ("root", 4)]
)
def test_the_micro_policy_equals_the_full_batch_step(
    tmp_path: Path, recipe: str, world_size: int
) -> None:
    results = run_ranks(uneven_worker, tmp_path, recipe, "micro", world_size=world_size,
                        timeout=150.0, pg_timeout=60.0)  # fmt: skip
    expected = reference(world_size)
    for rank, got in enumerate(results):
        for name, want in expected.items():
            torch.testing.assert_close(got["params"][name], want, **EXACT, msg=f"{rank} {name}")


def _count_reduce_scatters() -> list[int]:
    calls = [0]
    real = dist.reduce_scatter_single

    @functools.wraps(real)
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted  # this spawned rank only
    return calls


def _batch(
    rank: int, dtype: torch.dtype, items: int = 3 * MICRO_BATCHES
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(items, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(items, 2, generator=generator, dtype=torch.float64) + 1.0
    keep = torch.ones(len(x), dtype=torch.bool)
    return {"x": x.to(dtype), "y": y.to(dtype), "keep": keep}


def policy_worker(rank: int, world_size: int, recipe: str) -> dict[str, Any]:
    from gradaccum import Accumulator

    calls = _count_reduce_scatters()
    out: dict[str, Any] = {}
    for policy in ("window", "micro"):
        model = shard(make_tiny(), world_size, recipe)
        acc = Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            micro_batch_size=3,
            sync_policy=policy,
        )
        before = calls[0]
        acc.step(_batch(rank, torch.float64), masked_loss)
        out[policy] = calls[0] - before
    # bf16 parameters: fp32 buffers (micro policy) against plain bf16 accumulation.
    variants = {
        "bf16": ({}, False),
        "buffers": ({"accum_dtype": torch.float32}, False),
        # fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)): FSDP2 reduces
        # in float32 and hands back bf16 shards, which the buffers then sum in float32.
        "bf16 mp": ({}, True),
        "buffers mp": ({"accum_dtype": torch.float32}, True),
    }
    for name, (options, mixed) in variants.items():
        model = make_tiny().to(torch.bfloat16)
        if mixed:
            model = _shard_mixed(model, world_size, recipe)
        else:
            model = shard(model, world_size, recipe)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        seen: dict[str, list[torch.Tensor]] = {}

        def hook(opt: Any, args: Any, kwargs: Any, model: Any = model, seen: Any = seen) -> None:
            seen["grads"] = [p.grad.full_tensor().double() for p in model.parameters()]

        optimizer.register_step_pre_hook(hook)
        acc = Accumulator(model, optimizer, micro_batch_size=1, sync_policy="micro", **options)
        acc.step(_batch(rank, torch.bfloat16, BF16_ITEMS), masked_loss)
        out[name] = torch.cat([g.flatten() for g in seen["grads"]])
    return out


def _shard_mixed(model: torch.nn.Module, world_size: int, recipe: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    MixedPrecisionPolicy = fsdp_api().MixedPrecisionPolicy
    fully_shard = fsdp_api().fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if recipe == "blocks+root":
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _bf16_reference_grad() -> torch.Tensor:
    """The float64 gradient at the bf16 model's weights, over both ranks' items."""
    model = make_tiny().to(torch.bfloat16).double()
    batches = [_batch(rank, torch.bfloat16, BF16_ITEMS) for rank in (0, 1)]
    x = torch.cat([b["x"] for b in batches]).double()
    y = torch.cat([b["y"] for b in batches]).double()
    (model(x) - y).pow(2).sum().div(len(x)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("recipe", ["blocks+root", "root"])
def test_reduce_scatters_per_window_and_fp32_buffers(tmp_path: Path, recipe: str) -> None:
    results = run_ranks(policy_worker, tmp_path, recipe, timeout=120.0, pg_timeout=30.0)
    groups = 3 if recipe == "blocks+root" else 1  # parameter groups: one per fully_shard call
    want = _bf16_reference_grad()
    for got in results:
        assert got["window"] == groups  # one per group per window
        assert got["micro"] == groups * MICRO_BATCHES  # one per group per micro-batch
        for suffix in ("", " mp"):
            native = float((got["bf16" + suffix] - want).norm() / want.norm())
            buffered = float((got["buffers" + suffix] - want).norm() / want.norm())
            print(
                f"\nbf16 FSDP2 ({recipe}{suffix}), {BF16_ITEMS} micro-batches: fp32 buffers "
                f"{buffered:.2e}, native bf16 {native:.2e}, x{native / buffered:.1f}"
            )
            # Both carry the bf16 forward/backward rounding; the buffers remove the summation's.
            assert native >= 2.0 * buffered, (suffix, native, buffered)
