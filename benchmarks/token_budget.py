"""Token-budget micro-batches against a fixed micro-batch size, on length-skewed charlm rows.

The rows are cut from the bundled charlm text with long-tailed lengths (log-normal, median 24
characters, clipped to 8..256), 64 rows per window. Both configurations train the charlm
transformer (2 layers, d_model 64, causal attention) with AdamW, one thread, on the same windows:

- **fixed**: `Accumulator(micro_batch_size=8)`: 8 rows per micro-batch, in data order, each
  micro-batch trimmed to its longest row by the task's loss (so the fixed size already drops the
  padding it can);
- **budget**: `step(batch, loss_fn, max_tokens=8 * 257)`: the same worst case (8 rows of the
  longest possible length), rows sorted by length and packed within it.

Printed per configuration: micro-batches per window, the padded tokens the forward passes
process, the fraction of them that is padding, the median wall time per window (the two
alternate window by window, 3 rounds over every window), and the peak of tensor memory during
one window (the window with the longest row; `_measure.peak_allocated_bytes`). Both
configurations take the same step up to rounding: the parameter gap after one window is
printed too.

Usage:
    .venv/bin/python benchmarks/token_budget.py [--windows N] [--rounds R] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from typing import Any

import torch

from _measure import peak_allocated_bytes
from gradaccum import Accumulator
from gradaccum.experiments.tasks import charlm

ROWS, MICRO, LONGEST = 64, 8, 256
BUDGET = MICRO * (LONGEST + 1)


def make_windows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` windows of ROWS rows with long-tailed lengths, right-padded to LONGEST + 1."""
    text = " ".join(charlm.load_lines())
    generator = torch.Generator().manual_seed(seed)
    windows, cursor = [], 0
    for _ in range(count):
        lengths = torch.empty(ROWS).log_normal_(math.log(24), 1.0, generator=generator)
        tokens = torch.full((ROWS, LONGEST + 1), charlm.PAD, dtype=torch.int64)
        labels = torch.full((ROWS, LONGEST + 1), charlm.IGNORE_INDEX, dtype=torch.int64)
        for row, length in enumerate(lengths.clamp(8, LONGEST).long().tolist()):
            if cursor + length > len(text):
                cursor = 0
            ids = charlm.encode(text[cursor : cursor + length])
            cursor += length
            tokens[row, : length + 1] = torch.tensor([charlm.BOS, *ids])
            labels[row, : length + 1] = torch.tensor([*ids, charlm.EOL])
        mask = (labels != charlm.IGNORE_INDEX).long()
        windows.append({"tokens": tokens, "labels": labels, "attention_mask": mask})
    return windows


def padded_tokens(micro_batches: list[dict[str, Any]]) -> int:
    """Tokens the forward passes process: rows x each micro-batch's longest row."""
    total = 0
    for micro_batch in micro_batches:
        real = (micro_batch["labels"] != charlm.IGNORE_INDEX).sum(dim=1)
        total += micro_batch["labels"].shape[0] * max(int(real.max()), 1)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=12, help="windows per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every window")
    parser.add_argument("--quick", action="store_true", help="2 windows, 1 round (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.windows, args.rounds = 2, 1
    if args.windows < 1 or args.rounds < 1:
        parser.error("--windows and --rounds must be >= 1")
    torch.set_num_threads(1)

    task = charlm.CharLMTask()
    windows = make_windows(args.windows)
    model = charlm.CharTransformer(charlm.vocab_size(), LONGEST + 1)
    models = {"fixed": model, "budget": copy.deepcopy(model)}
    accs = {
        name: Accumulator(m, torch.optim.AdamW(m.parameters(), lr=1e-3), micro_batch_size=MICRO)
        for name, m in models.items()
    }
    runs = {
        "fixed": lambda w: accs["fixed"].step(w, task.loss_fn),
        "budget": lambda w: accs["budget"].step(w, task.loss_fn, max_tokens=BUDGET),
    }
    runs["fixed"](windows[0])  # the same first step on both, to compare the updates
    runs["budget"](windows[0])
    gap = max(
        float((a - b).detach().abs().max())
        for a, b in zip(models["fixed"].parameters(), models["budget"].parameters(), strict=True)
    )

    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for index, window in enumerate(windows):
            order = list(runs) if (round_ + index) % 2 == 0 else list(runs)[::-1]
            for name in order:
                start = time.perf_counter()
                runs[name](window)
                times[name].append(time.perf_counter() - start)

    from gradaccum import split_batch
    from gradaccum.packing import pack_by_tokens

    splits = {
        "fixed": [split_batch(w, MICRO) for w in windows],
        "budget": [pack_by_tokens(w, BUDGET) for w in windows],
    }
    real = sum(int((w["labels"] != charlm.IGNORE_INDEX).sum()) for w in windows)
    longest = max(windows, key=lambda w: int(w["attention_mask"].sum(dim=1).max()))
    print(
        f"charlm rows with log-normal lengths (median 24, clipped 8..{LONGEST}), {ROWS} rows per "
        f"window, {args.windows} windows x {args.rounds} rounds, torch.set_num_threads(1)"
    )
    header = (
        f"{'config':<26} {'micro/window':>12} {'padded tok':>11} {'padding':>8} "
        f"{'ms/window':>10} {'peak MiB':>9}"
    )
    print(header)
    print("-" * len(header))
    medians = {}
    for name, label in (("fixed", f"fixed {MICRO} rows"), ("budget", f"max_tokens={BUDGET}")):
        micro = statistics.mean(len(s) for s in splits[name])
        padded = sum(padded_tokens(s) for s in splits[name])
        medians[name] = statistics.median(times[name])
        peak = peak_allocated_bytes(lambda n=name: runs[n](longest)).peak_bytes / 2**20
        print(
            f"{label:<26} {micro:>12.1f} {padded:>11,} {1 - real / padded:>8.1%} "
            f"{medians[name] * 1e3:>10.1f} {peak:>9.1f}"
        )
    print()
    print(f"real tokens: {real:,}; largest parameter gap after one window: {gap:.1e}")
    print(f"speed-up of the token budget: {medians['fixed'] / medians['budget']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
