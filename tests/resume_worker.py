"""A tiny training run that checkpoints often and can die on purpose, for the kill-and-resume tests.

Run as a script (in a subprocess) it trains one variant, writes `ckpt.pt` into `--out` after every
micro-step (streaming drive) or every step (whole-batch drive), and at the end writes `final.pt`
with the model, optimizer and counters. Flags make it die by SIGKILL right after a given position's
checkpoint (`--die-after`), or halfway through writing one (`--crash-in-save-at`), and resume from
`ckpt.pt` (`--resume`). Imported, `train()` gives the uninterrupted reference in-process.

The data depend on Python's and NumPy's global RNGs and the model has dropout (torch's RNG), so a
resume is exact only if the checkpoint restores all three RNG states too.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradaccum import Accumulator, load_checkpoint, save_checkpoint

VARIANTS = ("base", "whole", "bf16", "fp16")
WINDOWS = 3  # windows (optimizer steps attempted) per run
FEATURES, OUTPUTS = 4, 2


def _dtype(variant: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float32}.get(variant, torch.float64)


def build(variant: str, n: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, Accumulator]:
    """Model, optimizer, scheduler and Accumulator of one variant, all seeded alike every time."""
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Linear(FEATURES, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, OUTPUTS)
    ).to(_dtype(variant))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    options: dict[str, Any] = {"accumulation_steps": n}
    if variant == "whole":
        options = {"micro_batch_size": 2}
    elif variant == "bf16":
        options.update(precision="bf16", accum_dtype=torch.float32)
    elif variant == "fp16":
        options.update(precision="fp16")
    accumulator = Accumulator(model, optimizer, scheduler=scheduler, **options)
    return model, optimizer, scheduler, accumulator


def batch(variant: str, n: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data at `position`, drawn from the global Python and NumPy RNGs."""
    size = random.randint(3, 6) if variant == "whole" else random.randint(1, 3)
    x = torch.from_numpy(np.random.standard_normal((size, FEATURES))).to(_dtype(variant))
    y = torch.from_numpy(np.random.standard_normal((size, OUTPUTS))).to(_dtype(variant))
    if variant == "fp16" and position == n + 1:
        x = x * 1e6  # overflows fp16 under autocast: this whole window is skipped
    return x, y


def loss_fn(model: nn.Module, micro_batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error: a scalar mean, weighted by the micro-batch's size."""
    x, y = micro_batch
    return nn.functional.mse_loss(model(x), y)


def positions(variant: str, n: int) -> int:
    """How many `micro_step` (or `step`) calls one run makes."""
    return WINDOWS + 1 if variant == "whole" else WINDOWS * n


def train(
    variant: str,
    n: int,
    out: Path | None = None,
    *,
    die_after: int | None = None,
    resume: bool = False,
    drop_accumulator: bool = False,
    crash_in_save_at: int | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Run (or finish) one training run and return its final state.

    Args:
        variant: One of `VARIANTS`.
        n: Micro-batches per window (streaming variants).
        out: Folder for `ckpt.pt`; None trains without checkpoints.
        die_after: SIGKILL this process right after the checkpoint of this position.
        resume: Continue from `out/ckpt.pt`.
        drop_accumulator: On resume, leave out the Accumulator state (a negative control).
        crash_in_save_at: SIGKILL this process halfway through writing this position's checkpoint.
        stop_after: Return right after the checkpoint of this position (to stop in-process).
    """
    model, optimizer, scheduler, acc = build(variant, n)
    start = 0
    if resume:
        assert out is not None
        extra = load_checkpoint(
            out / "ckpt.pt",
            model=model,
            optimizer=optimizer,
            accumulator=None if drop_accumulator else acc,
            scheduler=scheduler,
            restore_rng=True,  # the data and dropout draw from the global RNGs
        )
        assert extra is not None
        start = extra["position"] + 1
    for position in range(start, positions(variant, n)):
        data = batch(variant, n, position)
        if variant == "whole":
            acc.step(data, loss_fn)
        else:
            acc.micro_step(data, loss_fn)
        if out is None:
            continue
        if position == crash_in_save_at:
            torch.save = _dying_save
        save_checkpoint(
            out / "ckpt.pt",
            model=model,
            optimizer=optimizer,
            accumulator=acc,
            scheduler=scheduler,
            extra={"position": position},
        )
        if position == die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if position == stop_after:
            break
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "counters": [acc.nonfinite_windows, acc.empty_windows],
        "scale": None if acc.scaler is None else acc.scaler.get_scale(),
    }


_real_save = torch.save


def _dying_save(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
    """Write half of the serialized checkpoint, make it durable, then die mid-write."""
    buffer = io.BytesIO()
    _real_save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    handle.write(data[: len(data) // 2])
    handle.flush()
    os.fsync(handle.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--crash-in-save-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--drop-accumulator", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    final = train(
        args.variant,
        args.n,
        args.out,
        die_after=args.die_after,
        resume=args.resume,
        drop_accumulator=args.drop_accumulator,
        crash_in_save_at=args.crash_in_save_at,
    )
    torch.save(final, args.out / "final.pt")
    print("done", flush=True)


if __name__ == "__main__":
    main()
