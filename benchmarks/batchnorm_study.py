"""The `shapes` BatchNorm study of docs/batchnorm.md: which `--bn` mode brings accumulation closer.

Every run is a `gradaccum train` process (one CPU thread each, at most `--jobs` at a time):

1. Pre-training, per seed: `--batch-size 16 --epochs P` from scratch, once with plain BatchNorm
   (`--bn micro`) and once with GroupNorm (`--bn group`). The seed also draws the dataset, so
   each seed repeats the whole pipeline.
2. The study, per seed: configs 16x1 (the full-batch reference), 8x2 and 4x4 (batch 16 by
   accumulation) and 8x1 (batch 8, what fits without accumulation), under `--bn micro`, `pooled`,
   `frozen` (all three `--init-from` the BatchNorm pre-training) and `group` (`--init-from` the
   GroupNorm pre-training), each for `--epochs E` at the task's fixed lr (no lr scaling).
3. One-step runs (first seed): the same 3 batch-16 configs x 4 modes with `--steps 1`, to measure
   how far 8x2 and 4x4 are from 16x1 after one optimizer step (parameters and BatchNorm buffers).

Then, in this process: `recalibrate` (the library's PreciseBN) on the final micro and pooled
models as an extra, post-hoc column; the tables (`OUT/results.md`, printed) and the figures
`docs/img/bn_study_curves.png`, `bn_study_gaps.png` and `bn_study_distance.png`.

A run whose folder already holds `summary.json` is not run again, so an interrupted study can be
restarted with the same command; change `--out` for a fresh one.

Usage (from the repository root; 12.4 minutes with the defaults on a shared 2-core machine):
    .venv/bin/python benchmarks/batchnorm_study.py [--out runs/bn-study] [--seeds 0 1 2]
        [--epochs 10] [--pretrain-epochs 2] [--jobs 2] [--img docs/img]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = ("micro", "pooled", "frozen", "group")
CONFIGS = ("16x1", "8x2", "4x4", "8x1")  # 16x1 is the full-batch reference of 8x2 and 4x4
ACCUMULATED = ("8x2", "4x4")
COLORS = {"16x1": "black", "8x2": "tab:blue", "4x4": "tab:red", "8x1": "tab:green"}


@dataclass(frozen=True)
class Run:
    """One `gradaccum train` process: its folder (relative to the study's) and its options."""

    name: str
    options: tuple[str, ...]

    def command(self, out: Path) -> list[str]:
        """The `gradaccum train` arguments, writing into `out / name`."""
        return ["train", *self.options, "--out", str(out / self.name)]


def batch_options(config: str) -> tuple[str, ...]:
    """`8x2` -> `--batch-size 16 --micro-batch-size 8`."""
    micro, steps = (int(part) for part in config.split("x"))
    return ("--batch-size", str(micro * steps), "--micro-batch-size", str(micro))


def pretrain_name(seed: int, mode: str) -> str:
    """The pre-training folder a mode starts from (GroupNorm has its own)."""
    return f"seed{seed}/pretrain-{'group' if mode == 'group' else 'bn'}"


def plan(seeds: list[int], epochs: int, pretrain_epochs: int) -> tuple[list[Run], list[Run]]:
    """The pre-training runs, and everything that starts from them."""
    task = ("--task", "shapes")
    pretrain, rest = [], []
    for seed in seeds:
        for mode in ("micro", "group"):
            options = (*task, "--batch-size", "16", "--epochs", str(pretrain_epochs))
            options += ("--seed", str(seed), "--bn", mode)
            pretrain.append(Run(pretrain_name(seed, mode), options))
    # Longest runs first (8x1 and 4x4 are the slowest), so two workers finish together.
    for config in ("8x1", "4x4", "8x2", "16x1"):
        for seed in seeds:
            for mode in MODES:
                start = f"{pretrain_name(seed, mode)}/checkpoint.pt"
                options = (*task, *batch_options(config), "--epochs", str(epochs))
                options += ("--seed", str(seed), "--bn", mode, "--init-from", "{out}/" + start)
                rest.append(Run(f"seed{seed}/{mode}/{config}", options))
    for mode in MODES:
        for config in ("16x1", *ACCUMULATED):
            start = f"{pretrain_name(seeds[0], mode)}/checkpoint.pt"
            options = (*task, *batch_options(config), "--steps", "1", "--seed", str(seeds[0]))
            options += ("--bn", mode, "--init-from", "{out}/" + start)
            rest.append(Run(f"step1/{mode}/{config}", options))
    return pretrain, rest


def execute(runs: list[Run], out: Path, jobs: int) -> float:
    """Run what is not done yet, `jobs` at a time; return the summed process seconds."""

    def one(run: Run) -> float:
        folder = out / run.name
        if (folder / "summary.json").is_file():
            return 0.0
        if folder.exists():  # an interrupted run of an earlier attempt: start it again
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        args = [part.replace("{out}", str(out)) for part in run.command(out)]
        log = out / "logs" / (run.name.replace("/", "_") + ".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with log.open("w") as stream:
            code = subprocess.call(
                [sys.executable, "-m", "gradaccum.cli", *args],
                stdout=stream,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        seconds = time.perf_counter() - started
        print(f"  {run.name}: exit {code}, {seconds:.1f} s", flush=True)
        if code != 0:
            raise RuntimeError(f"gradaccum {shlex.join(args)} exited {code}; see {log}")
        return seconds

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return sum(pool.map(one, runs))


# ---------------------------------------------------------------- reading the runs


def read_run(folder: Path) -> dict[str, Any]:
    """`summary.json` and `validation.jsonl` of one run."""
    summary = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "validation.jsonl").read_text().splitlines()]
    return {"summary": summary, "history": rows}


def load_model(folder: Path, mode: str, seed: int) -> torch.nn.Module:
    """The final model of a run, rebuilt from its `checkpoint.pt`."""
    from gradaccum.checkpoint import load_model_weights
    from gradaccum.experiments.tasks import get_task

    model = get_task("shapes").make_model(seed, "group" if mode == "group" else "batch")
    load_model_weights(folder / "checkpoint.pt", model)
    return model


def parameter_gap(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """`||theta - theta_ref|| / ||theta_ref||`, all parameters taken as one vector."""
    with torch.no_grad():
        ours = torch.cat([p.flatten() for p in model.parameters()])
        theirs = torch.cat([p.flatten() for p in reference.parameters()])
        return float((ours - theirs).norm() / theirs.norm())


def buffer_gaps(model: torch.nn.Module, reference: torch.nn.Module, buffer: str) -> list[float]:
    """Per BatchNorm layer, in forward order: `||b - b_ref|| / ||b_ref||` of one buffer."""
    from gradaccum.batchnorm import batchnorm_modules

    pairs = zip(batchnorm_modules(model), batchnorm_modules(reference), strict=True)
    gaps = []
    for (_, ours), (_, theirs) in pairs:
        mine, ref = getattr(ours, buffer), getattr(theirs, buffer)
        gaps.append(float((mine - ref).norm() / ref.norm()))
    return gaps


def recalibrated_metric(model: torch.nn.Module, seed: int) -> float:
    """Validation mIoU after `recalibrate` over the whole training set in batches of 16."""
    from gradaccum.batchnorm import recalibrate
    from gradaccum.experiments.tasks import get_task

    task = get_task("shapes")
    data = task.make_data(seed)
    images, labels = data.train
    loader = [(images[i : i + 16], labels[i : i + 16]) for i in range(0, len(labels), 16)]
    recalibrate(model, loader, num_batches=len(loader))
    return task.evaluate(model, data.val, 256)["metric"]


def analyse(out: Path, seeds: list[int]) -> dict[str, Any]:
    """Everything the tables and figures need."""
    runs = {
        (seed, mode, config): read_run(out / f"seed{seed}/{mode}/{config}")
        for seed in seeds
        for mode in MODES
        for config in CONFIGS
    }
    start = {
        (seed, mode): read_run(out / pretrain_name(seed, mode))["history"][-1]
        for seed in seeds
        for mode in ("micro", "group")
    }
    final_gap, pooled_vs_micro, recal = {}, {}, {}
    for seed in seeds:
        for mode in MODES:
            reference = load_model(out / f"seed{seed}/{mode}/16x1", mode, seed)
            for config in ACCUMULATED:
                model = load_model(out / f"seed{seed}/{mode}/{config}", mode, seed)
                final_gap[seed, mode, config] = parameter_gap(model, reference)
        for config in CONFIGS:
            micro = load_model(out / f"seed{seed}/micro/{config}", "micro", seed)
            pooled = load_model(out / f"seed{seed}/pooled/{config}", "pooled", seed)
            with torch.no_grad():
                pooled_vs_micro[seed, config] = max(
                    float((p - q).abs().max())
                    for p, q in zip(pooled.parameters(), micro.parameters(), strict=True)
                )
            recal[seed, "micro", config] = recalibrated_metric(micro, seed)
            recal[seed, "pooled", config] = recalibrated_metric(pooled, seed)
    step1: dict[str, Any] = {}
    for mode in MODES:
        reference = load_model(out / f"step1/{mode}/16x1", mode, seeds[0])
        for config in ACCUMULATED:
            model = load_model(out / f"step1/{mode}/{config}", mode, seeds[0])
            step1[mode, config, "params"] = parameter_gap(model, reference)
            if mode != "group":
                for buffer in ("running_mean", "running_var"):
                    step1[mode, config, buffer] = buffer_gaps(model, reference, buffer)
    return {
        "runs": runs,
        "start": start,
        "final_gap": final_gap,
        "pooled_vs_micro": pooled_vs_micro,
        "recal": recal,
        "step1": step1,
    }


# ---------------------------------------------------------------- tables


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def spread(values: list[float]) -> str:
    """`min-max`, or `-` with one seed."""
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else "-"


def final_metrics(result: dict[str, Any], seeds: list[int], mode: str, config: str) -> list[float]:
    """Final validation mIoU of each seed."""
    return [result["runs"][s, mode, config]["summary"]["final_metric"] for s in seeds]


def paired_gaps(result: dict[str, Any], seeds: list[int], mode: str, config: str) -> list[float]:
    """Per seed: final mIoU of `config` minus that of 16x1 (recalibrated for mode `+recal`)."""
    if mode.endswith("+recal"):
        base = mode.removesuffix("+recal")
        recal = result["recal"]
        return [recal[s, base, config] - recal[s, base, "16x1"] for s in seeds]
    ours, theirs = (final_metrics(result, seeds, mode, c) for c in (config, "16x1"))
    return [a - b for a, b in zip(ours, theirs, strict=True)]


def distance(
    result: dict[str, Any], seeds: list[int], mode: str, config: str, key: str
) -> list[float]:
    """Per fine-tuning epoch: |value - 16x1's value| of a validation `key`, mean over seeds.

    For `val_loss` the difference is relative to 16x1's loss.
    """
    runs = result["runs"]
    per_epoch = []
    for epoch in range(len(runs[seeds[0], mode, config]["history"])):
        gaps = []
        for seed in seeds:
            ours = runs[seed, mode, config]["history"][epoch][key]
            theirs = runs[seed, mode, "16x1"]["history"][epoch][key]
            gaps.append(abs(ours - theirs) / (abs(theirs) if key == "val_loss" else 1.0))
        per_epoch.append(mean(gaps))
    return per_epoch


def tables(result: dict[str, Any], seeds: list[int]) -> str:
    """The Markdown tables of `results.md` (the doc copies them)."""
    runs, recal = result["runs"], result["recal"]

    def last3(mode: str, config: str) -> float:
        return mean(
            [mean([h["val_metric"] for h in runs[s, mode, config]["history"][-3:]]) for s in seeds]
        )

    def each(mode: str, config: str, key: str) -> list[float]:
        if key == "loss":
            return [runs[s, mode, config]["history"][-1]["val_loss"] for s in seeds]
        return [runs[s, mode, config]["summary"][key] for s in seeds]

    n = len(seeds)
    lines = [
        f"Means over {n} seed{'s' if n > 1 else ''} ({', '.join(map(str, seeds))}); range = "
        "min-max over seeds; last 3 = mean of the last 3 epochs' validation mIoU; recalibrated "
        "= final weights after `recalibrate` on the training set (micro and pooled only).",
        "",
        "| mode | config | final mIoU | range | last 3 | best mIoU | final val loss "
        "| recalibrated mIoU | range | wall time |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        for config in CONFIGS:
            finals = final_metrics(result, seeds, mode, config)
            recals = [recal[s, mode, config] for s in seeds if (s, mode, config) in recal]
            recal_cells = f"{mean(recals):.3f} | {spread(recals)}" if recals else "- | -"
            lines.append(
                f"| {mode} | {config} | {mean(finals):.3f} | {spread(finals)} "
                f"| {last3(mode, config):.3f} | {mean(each(mode, config, 'best_metric')):.3f} "
                f"| {mean(each(mode, config, 'loss')):.4f} | {recal_cells} "
                f"| {mean(each(mode, config, 'wall_seconds')):.1f} s |"
            )
    lines += [
        "",
        "Final mIoU minus 16x1's final mIoU in the same mode, paired by seed (same data, "
        "initial weights and order): per seed, and the mean. Last columns: parameter gap to 16x1 "
        "at the end, ||theta - theta_16x1|| / ||theta_16x1|| over all parameters (mean over "
        "seeds).",
        "",
        "| mode | 8x2 - 16x1 | 4x4 - 16x1 | 8x1 - 16x1 | params 8x2 vs 16x1 | params 4x4 vs 16x1 |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for mode in (*MODES[:2], "micro+recal", *MODES[2:]):
        cells = []
        for config in (*ACCUMULATED, "8x1"):
            diffs = paired_gaps(result, seeds, mode, config)
            per_seed = ", ".join(f"{d:+.3f}" for d in diffs)
            cells.append(f"{per_seed} (mean {mean(diffs):+.3f})" if n > 1 else per_seed)
        base = mode.removesuffix("+recal")
        gaps = [mean([result["final_gap"][s, base, c] for s in seeds]) for c in ACCUMULATED]
        shown = "micro or pooled, recalibrated" if mode == "micro+recal" else mode
        lines.append(f"| {shown} | {' | '.join(cells)} | {gaps[0]:.2f} | {gaps[1]:.2f} |")
    epochs = len(runs[seeds[0], "micro", "16x1"]["history"])
    lines += [
        "",
        "|mIoU - 16x1's mIoU| after each fine-tuning epoch, same mode, mean over seeds:",
        "",
        "| mode | config | " + " | ".join(str(e) for e in range(1, epochs + 1)) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in range(epochs)) + " |",
    ]
    for mode in MODES:
        for config in ACCUMULATED:
            cells = " | ".join(
                f"{d:.2g}" for d in distance(result, seeds, mode, config, "val_metric")
            )
            lines.append(f"| {mode} | {config} | {cells} |")
    lines += ["", "Pooled minus micro, final mIoU, same seed and config (same weights):", ""]
    for config in CONFIGS:
        diffs = [
            a - b
            for a, b in zip(
                final_metrics(result, seeds, "pooled", config),
                final_metrics(result, seeds, "micro", config),
                strict=True,
            )
        ]
        lines.append(f"- {config}: {', '.join(f'{d:+.3f}' for d in diffs)}")
    worst = max(result["pooled_vs_micro"].values())
    lines += [
        "",
        f"Largest |parameter difference| between a pooled run and the micro run of the same seed "
        f"and config, at the end: {worst:.1e}.",
    ]
    step1 = result["step1"]
    lines += [
        "",
        f"After ONE optimizer step from the pre-trained weights (seed {seeds[0]}): relative gap "
        "to 16x1 of the parameters (all as one vector) and of each BatchNorm's running_var "
        "(first layer / median over the 10 layers / largest).",
        "",
        "| mode | params 8x2 | params 4x4 | running_var 8x2 | running_var 4x4 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES:
        cells = [f"{step1[mode, c, 'params']:.1e}" for c in ACCUMULATED]
        for config in ACCUMULATED:
            gaps = step1.get((mode, config, "running_var"))
            cells.append(
                "no BatchNorm"
                if gaps is None
                else f"{gaps[0]:.1e} / {statistics.median(gaps):.1e} / {max(gaps):.1e}"
            )
        lines.append(f"| {mode} | {' | '.join(cells)} |")
    walls = sum(r["summary"]["wall_seconds"] for r in runs.values())
    lines += ["", f"Training loops of the {len(runs)} study runs: {walls:.0f} s in all."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- figures


def plot_curves(result: dict[str, Any], seeds: list[int], path: Path) -> None:
    """Validation mIoU (top) and loss (bottom) per fine-tuning epoch: one column per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, start = result["runs"], result["start"]
    fig, axes = plt.subplots(2, len(MODES), figsize=(15, 7.5), sharex=True, sharey="row")
    for column, mode in enumerate(MODES):
        for config in CONFIGS:
            for row, key in enumerate(("val_metric", "val_loss")):
                first = [start[s, "group" if mode == "group" else "micro"][key] for s in seeds]
                series = [
                    [first[i]] + [h[key] for h in runs[s, mode, config]["history"]]
                    for i, s in enumerate(seeds)
                ]
                epochs = range(len(series[0]))
                per_epoch = list(zip(*series, strict=True))
                ax = axes[row, column]
                ax.plot(
                    epochs,
                    [mean(list(v)) for v in per_epoch],
                    color=COLORS[config],
                    label=config,
                    lw=1.8 if config != "8x1" else 1.2,
                    ls="--" if config == "8x1" else "-",
                )
                if len(seeds) > 1:
                    ax.fill_between(
                        epochs,
                        [min(v) for v in per_epoch],
                        [max(v) for v in per_epoch],
                        color=COLORS[config],
                        alpha=0.12,
                    )
        axes[0, column].set_title(f"--bn {mode}")
        axes[1, column].set_xlabel("fine-tuning epoch (0 = pre-trained start)")
    axes[0, 0].set_ylabel("validation mIoU (higher is better)")
    axes[1, 0].set_ylabel("validation loss (per-pixel CE)")
    axes[1, 0].set_yscale("log")
    axes[0, 0].legend(title="config", loc="lower right")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    band = f"; band = min-max over seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else ""
    fig.suptitle(f"shapes U-Net, fine-tuned from a short pre-training: mean{band}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gaps(result: dict[str, Any], seeds: list[int], path: Path) -> None:
    """Left: final mIoU minus 16x1's per seed; right: one-step running_var gap per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), width_ratios=(1.1, 1))
    configs = (*ACCUMULATED, "8x1")
    groups = ("micro", "pooled", "micro+recal", "frozen", "group")
    names = ("micro", "pooled", "micro or pooled\n+ recalibrate", "frozen", "group")
    width = 0.8 / len(configs)
    for index, config in enumerate(configs):
        for position, mode in enumerate(groups):
            diffs = paired_gaps(result, seeds, mode, config)
            x = position + (index - (len(configs) - 1) / 2) * width
            left.bar(
                x,
                mean(diffs),
                width * 0.9,
                color=COLORS[config],
                alpha=0.5,
                label=config if position == 0 else None,
            )
            left.scatter([x] * len(diffs), diffs, color=COLORS[config], s=14, zorder=3)
    left.axhline(0, color="black", lw=0.8)
    left.set_xticks(range(len(groups)), names)
    left.set_ylabel("val mIoU minus 16x1's (same mode, same seed)")
    left.set_title("Distance to the full batch at the end (bar = mean, dots = seeds)")
    left.legend()
    left.grid(axis="y", alpha=0.3)

    step1 = result["step1"]
    for mode, marker in (("micro", "o"), ("pooled", "s")):
        for config in ACCUMULATED:
            gaps = step1[mode, config, "running_var"]
            right.plot(
                range(1, len(gaps) + 1),
                [max(g, 1e-9) for g in gaps],
                marker=marker,
                color=COLORS[config],
                ls="-" if mode == "pooled" else ":",
                label=f"{mode} {config}",
            )
    right.set_yscale("log")
    right.set_xticks(range(1, 11))
    right.set_xlabel("BatchNorm layer, in forward order (1 = first, on the input convolution)")
    right.set_ylabel("||running_var - 16x1's|| / ||16x1's||  (exact 0 drawn at 1e-9)")
    right.set_title(f"After one step from the pre-trained weights (seed {seeds[0]})")
    right.legend()
    right.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_distance(result: dict[str, Any], seeds: list[int], path: Path) -> None:
    """How far 8x2 and 4x4 are from 16x1 after each epoch: mIoU and relative val loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(MODES, ("tab:gray", "tab:orange", "tab:purple", "tab:cyan"), strict=True))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    keys = (("val_metric", "|val mIoU - 16x1's|"), ("val_loss", "|val loss - 16x1's| / 16x1's"))
    for ax, (key, label) in zip(axes, keys, strict=True):
        for mode in MODES:
            for config in ACCUMULATED:
                gaps = distance(result, seeds, mode, config, key)
                ax.plot(
                    range(1, len(gaps) + 1),
                    [max(g, 1e-7) for g in gaps],
                    color=colors[mode],
                    ls="-" if config == "8x2" else "--",
                    marker="o" if config == "8x2" else "s",
                    ms=4,
                    label=f"{mode} {config}",
                )
        ax.set_yscale("log")
        ax.set_xlabel("fine-tuning epoch (25 optimizer steps each)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(ncol=2, fontsize=8)
    fig.suptitle(
        "Distance of the accumulated runs (8x2, 4x4) to the full batch (16x1) in the same mode, "
        "mean over seeds (0 drawn at 1e-7)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bn-study")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10, help="fine-tuning epochs")
    parser.add_argument("--pretrain-epochs", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    pretrain, rest = plan(args.seeds, args.epochs, args.pretrain_epochs)
    print(f"batchnorm study in {out}: {len(pretrain)} pre-training runs, {len(rest)} others")
    print("  e.g. gradaccum " + shlex.join(rest[0].command(Path("OUT"))).replace("{out}", "OUT"))
    process_seconds = execute(pretrain, out, args.jobs)
    process_seconds += execute(rest, out, args.jobs)
    training = time.perf_counter() - started
    result = analyse(out, args.seeds)
    text = tables(result, args.seeds)
    total = time.perf_counter() - started
    timing = (
        f"\nThis invocation: {training:.0f} s of training wall time ({process_seconds:.0f} s "
        f"summed over processes, {args.jobs} at a time), {total:.0f} s in all.\n"
    )
    (out / "results.md").write_text(text + timing)
    args.img.mkdir(parents=True, exist_ok=True)
    plot_curves(result, args.seeds, args.img / "bn_study_curves.png")
    plot_gaps(result, args.seeds, args.img / "bn_study_gaps.png")
    plot_distance(result, args.seeds, args.img / "bn_study_distance.png")
    print(text + timing)
    names = ("curves", "gaps", "distance")
    print("figures: " + ", ".join(str(args.img / f"bn_study_{name}.png") for name in names))


if __name__ == "__main__":
    main()
