"""Running BatchNorm statistics under accumulation: "micro" vs "pooled" against the full batch.

A fixed (untrained) two-layer conv net with a BatchNorm2d after each conv sees the same stream
of windows of B = 32 synthetic images three ways:

- reference: one plain full-batch forward per window (what a B = 32 GPU would do);
- "micro" (plain PyTorch): the window as micro-batches of m images, m in {4, 8, 16};
- "pooled" (`gradaccum.batchnorm.BatchNormControl`): the same micro-batches, one update per window.

Only the running statistics matter here, so no parameter is trained and the micro-batches run
forward only (the backward changes no running statistic). Everything is float64, so the pooled
first layer's gap is rounding (~1e-16). The second BatchNorm's inputs were normalized per
micro-batch by the first one in every mode but the reference: "pooled" gives the exact statistics
of the inputs it saw, which are not the full batch's.

Printed: the relative gap ||running_var - reference|| / ||reference|| per layer after the last
window (and running_mean); the figure plots the running_var gap over the windows.

Usage:
    .venv/bin/python benchmarks/batchnorm_stats.py [--windows 40] [--out docs/img/...png]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from torch import nn

from gradaccum.batchnorm import BatchNormControl, batchnorm_modules

BATCH = 32
MICRO_SIZES = (4, 8, 16)
OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "batchnorm_running_stats.png"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
    ).double()


def make_window(generator: torch.Generator) -> torch.Tensor:
    """Images whose brightness and contrast vary per image, so micro-batch statistics vary."""
    shape = (BATCH, 3, 12, 12)
    brightness = torch.randn(BATCH, 1, 1, 1, generator=generator, dtype=torch.float64)
    contrast = torch.rand(BATCH, 1, 1, 1, generator=generator, dtype=torch.float64) * 1.5 + 0.25
    noise = torch.randn(shape, generator=generator, dtype=torch.float64)
    return noise * contrast + brightness


def relative_gap(model: nn.Module, reference: nn.Module, buffer: str) -> list[float]:
    gaps = []
    for (_, bn), (_, ref) in zip(
        batchnorm_modules(model), batchnorm_modules(reference), strict=True
    ):
        ours, theirs = getattr(bn, buffer), getattr(ref, buffer)
        gaps.append(float((ours - theirs).norm() / theirs.norm()))
    return gaps


def run(windows: int) -> dict[str, list[list[float]]]:
    """Per configuration, per window: [layer 1 var gap, layer 2 var gap, layer 1 mean gap, ...]."""
    reference = make_model()
    runs: dict[str, tuple[nn.Module, int, BatchNormControl | None]] = {}
    for m in MICRO_SIZES:
        model = copy.deepcopy(reference)
        runs[f"micro, m={m}"] = (model, m, None)
    for m in (4, 16):
        model = copy.deepcopy(reference)
        runs[f"pooled, m={m}"] = (model, m, BatchNormControl(model, "pooled"))
    generator = torch.Generator().manual_seed(1)
    history: dict[str, list[list[float]]] = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(windows):
            x = make_window(generator)
            reference(x)
            for name, (model, m, control) in runs.items():
                for chunk in x.split(m):
                    if control is None:
                        model(chunk)
                    else:
                        with control.micro_context():
                            model(chunk)
                if control is not None:
                    control.end_window()
                gaps = relative_gap(model, reference, "running_var")
                history[name].append(gaps + relative_gap(model, reference, "running_mean"))
    return history


def plot(history: dict[str, list[list[float]]], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2, sharey=True)
    titles = ("BatchNorm 1 (input: conv of the images)", "BatchNorm 2 (behind BatchNorm 1)")
    for layer, (ax, title) in enumerate(zip(axes, titles, strict=True)):
        for name, rows in history.items():
            values = [max(row[layer], 1e-17) for row in rows]
            style = "-" if name.startswith("micro") else "--"
            ax.semilogy(range(1, len(values) + 1), values, style, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("window (optimizer step)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("running_var gap to full batch (relative)")
    axes[1].legend(fontsize=8)
    figure.suptitle(f"Running variance after each window of {BATCH} images, float64", fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    history = run(args.windows)
    print(f"after {args.windows} windows of {BATCH}: relative gap to the full batch")
    print(f"{'config':<14} {'var, BN1':>10} {'var, BN2':>10} {'mean, BN1':>10} {'mean, BN2':>10}")
    for name, rows in history.items():
        print(f"{name:<14} " + " ".join(f"{v:>10.2e}" for v in rows[-1]))
    first = {name: rows[0] for name, rows in history.items()}
    print("after 1 window:  " + "  ".join(f"{n}: {v[0]:.1e}/{v[1]:.1e}" for n, v in first.items()))
    plot(history, args.out)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
