"""Child process for `tests/test_sizing.py`: peak RSS of real training under a memory plan.

Run as `python -m tests.rss_worker BUDGET`; prints one JSON line: the plan's choice and, for
`auto` and a sweep of sizes (fractions of the batch), the peak resident memory above the baseline
while training. The
baseline is the resident memory after imports, data and a warm-up step of a tiny model, right
before the measured model is built. Peaks are reset between runs through /proc/self/clear_refs.

The parent sets MALLOC_MMAP_THRESHOLD_ so that glibc returns freed tensor memory to the system at
once instead of raising its threshold and keeping it: then resident memory follows the tensors
alive, which is what a plan predicts (see docs/memory.md).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator, plan_micro_batch

BATCH = 4096
STEPS = 2


def model() -> nn.Module:
    """Wide element-wise layers: much activation memory per item, few FLOPs."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 1024), nn.Tanh(), nn.GELU(), nn.Sigmoid(), nn.Tanh(), nn.Linear(1024, 10)
    )


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) * 1024


def peak_above_baseline(size: int | str, budget: str, data) -> tuple[int, int]:
    """Train STEPS steps at `size` on a fresh model; (micro-batch size used, peak RSS growth)."""
    baseline = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    acc = Accumulator(
        net, optimizer, micro_batch_size=size, memory_budget=budget if size == "largest" else None
    )
    for _ in range(STEPS):
        used = acc.step(data, loss).micro_batch_size
    peak = status("VmHWM") - baseline
    del acc, optimizer, net
    return used, peak


def main() -> None:
    torch.set_num_threads(1)
    budget = sys.argv[1]
    sizes = [int(BATCH * f) for f in (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)]
    generator = torch.Generator().manual_seed(0)
    data = (torch.randn(BATCH, 64, generator=generator), torch.randint(0, 10, (BATCH,)))
    warm = nn.Linear(64, 10)
    Accumulator(warm, torch.optim.AdamW(warm.parameters()), micro_batch_size=4).step(
        (data[0][:8], data[1][:8]), loss
    )
    net = model()
    plan = plan_micro_batch(
        net, data, loss, torch.optim.AdamW(net.parameters()), memory_budget=budget
    )
    report = {"plan": plan.micro_batch_size, "predicted": plan.predicted_peak_bytes, "runs": {}}
    for size in ["largest", *sizes]:
        used, peak = peak_above_baseline(size, budget, data)
        report["runs"][str(size)] = {"used": used, "peak": peak}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
