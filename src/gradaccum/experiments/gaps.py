"""How far apart the final weights of two runs are: the "equal / differs" table.

`tensor_gap` is the largest over tensors of `||p - p_ref|| / ||p_ref||`; the table's verdict uses
the gap of the whole model, `||w - w_ref|| / ||w_ref||` over every weight, and names the worst
tensor beside it. An element-wise (or per-tensor) test would mostly measure AdamW: it divides by
`sqrt(v) + eps`, so a weight whose gradient is zero in exact arithmetic (an attention key bias: a
shift shared by all keys changes no softmax) turns rounding noise into steps of about lr, whatever
the split: on charlm that tensor ends 1e-4 apart while the model is 2e-6 apart.

`gap_rows` compares the final checkpoint of every run with a reference run, taken among the configs
of the first effective batch that two configs share: its `Bx1` config if given, else the first one.
Configs with the reference's effective batch see the same batches, so on an additive task they must
be "equal" (below `rtol`); the others are the controls. Over a long float32 run, though,
rounding differences of 1e-7 per step grow (training amplifies them), so such a config may end
apart; then the table says for how many steps its loss agreed with the reference's (each
`metrics.jsonl`), which tells drift after many equal steps from a different update (BatchNorm).

Example:
    >>> a = {"w": torch.tensor([3.0, 4.0])}
    >>> tensor_gap({"w": torch.tensor([3.0, 4.5])}, a)
    (0.1, 'w')
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GapRow", "format_gaps", "gap_rows", "tensor_gap"]


def tensor_gap(
    params: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> tuple[float, str]:
    """Largest over tensors of `||p - p_ref|| / ||p_ref||`, and the name of that tensor.

    Raises:
        ValueError: If the two hold different names, or a reference tensor is all zeros while
            the other is not (no relative gap exists).
    """
    if params.keys() != reference.keys():
        raise ValueError("the two models have different parameters")
    worst, worst_name = 0.0, ""
    for name, ref in reference.items():
        diff = float((params[name].detach().double() - ref.detach().double()).norm())
        scale = float(ref.detach().double().norm())
        if scale == 0.0 and diff > 0.0:
            raise ValueError(f"reference tensor {name} is all zeros; no relative gap exists")
        gap = diff / scale if scale else 0.0
        if gap >= worst:
            worst, worst_name = gap, name
    return worst, worst_name


@dataclass(frozen=True)
class GapRow:
    """One config against the reference: its effective batch, the gap and the verdict."""

    config: str
    effective_batch: int
    gap: float  # of the whole model
    tensor: str  # the tensor with the largest gap of its own
    tensor_gap: float
    equal: bool
    # Same effective batch as the reference but not equal: the leading steps whose loss agreed
    # with the reference's within rtol, and the steps logged (None when unknown or not needed).
    agreed: tuple[int, int] | None = None


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return {k: v for k, v in payload["model"].items() if torch.is_floating_point(v)}


def _losses(checkpoint: Path) -> list[float]:
    metrics = checkpoint.parent / "metrics.jsonl"
    if not metrics.is_file():
        return []
    lines = metrics.read_text(encoding="utf-8").splitlines()
    return [float(json.loads(line)["loss"]) for line in lines if line.strip()]


def _agreed(run: Path, reference: Path, rtol: float) -> tuple[int, int] | None:
    """Leading steps whose losses agree within `rtol`, and the steps both logged."""
    ours, theirs = _losses(run), _losses(reference)
    steps = min(len(ours), len(theirs))
    if not steps:
        return None
    pairs = list(zip(ours[:steps], theirs[:steps], strict=True))
    agreed = next((i for i, (a, b) in enumerate(pairs) if abs(a - b) > rtol * abs(b)), steps)
    return agreed, steps


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return sum(float(t.double().norm()) ** 2 for t in tensors.values()) ** 0.5


def gap_rows(
    checkpoints: Mapping[str, Path], batches: Mapping[str, int], rtol: float
) -> tuple[str, list[GapRow]]:
    """The reference config and every other config's gap against it (see the module doc).

    Args:
        checkpoints: The final `checkpoint.pt` of each config, in table order.
        batches: The effective batch of each config.
        rtol: The largest gap that counts as equal.
    """
    labels = list(checkpoints)
    shared = [b for b in batches.values() if list(batches.values()).count(b) > 1]
    group = [label for label in labels if batches[label] == (shared or [batches[labels[0]]])[0]]
    reference = next((label for label in group if label == f"{batches[label]}x1"), group[0])
    weights = _weights(checkpoints[reference])
    rows = []
    for label in labels:
        if label != reference:
            other = _weights(checkpoints[label])
            worst, tensor = tensor_gap(other, weights)
            gap = _norm({k: other[k].double() - v.double() for k, v in weights.items()}) / _norm(
                weights
            )
            agreed = None
            if gap >= rtol and batches[label] == batches[reference]:
                agreed = _agreed(checkpoints[label], checkpoints[reference], rtol)
            rows.append(GapRow(label, batches[label], gap, tensor, worst, gap < rtol, agreed))
    return reference, rows


def format_gaps(reference: str, rows: list[GapRow], rtol: float, *, markdown: bool = False) -> str:
    """The rows as an aligned text table (or markdown), with one line on how to read it."""
    headers = ["config", "effective batch", f"param gap vs {reference}", "verdict", "worst tensor"]
    cells = [
        [
            r.config,
            str(r.effective_batch),
            f"{r.gap:.1e}",
            "equal" if r.equal else "differs",
            f"{r.tensor} {r.tensor_gap:.1e}",
        ]
        for r in rows
    ]
    note = (
        f"Final weights vs {reference}: ||w - w_ref|| / ||w_ref||, equal below {rtol:g}. Configs "
        "with its effective batch see the same batches, so on a task without BatchNorm they must "
        "be equal; the others differ."
    )
    for r in rows:
        if r.agreed is not None:
            note += (
                f" {r.config} has its effective batch but ends apart: its loss agreed with "
                f"{reference}'s to {rtol:g} for the first {r.agreed[0]} of {r.agreed[1]} steps"
                + (
                    ", then drifted: float32 rounding, grown over a long run."
                    if r.agreed[0] >= min(10, r.agreed[1])
                    else ": a different update (BatchNorm?); `gradaccum check` names the cause."
                )
            )
    if markdown:
        lines = [
            "| " + " | ".join(row) + " |"
            for row in [headers, ["---", "---:", "---:", "---", "---"], *cells]
        ]
        return "\n".join([*lines, "", note])
    widths = [max(map(len, column)) for column in zip(headers, *cells, strict=True)]
    lines = [
        "  ".join(
            c.rjust(w) if i in (1, 2) else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [headers, *cells]
    ]
    return "\n".join([*lines, note])
