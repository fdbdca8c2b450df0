"""Norms over the padded axis, which a token budget's trimming would change: refused by name.

`step(max_tokens=...)` trims each micro-batch to its longest row. That is exact when every
position is computed from its own row's real positions (attention with a mask, per-position
norms), but not through a GroupNorm or InstanceNorm that normalizes over the sequence axis,
padding included: Wav2Vec2, HuBERT and WavLM with `feat_extract_norm="group"` normalize their
first convolution's output over time, so a row trimmed of padding is normalized over fewer
positions than in the full batch (1.6e-2 off in three steps, silently). Such a layer sees an
input whose extent past the channels changes with the micro-batch's width; the first time it
does, the window is refused (nothing changed), naming the layer and the fix.

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv1d(1, 2, 3), torch.nn.GroupNorm(1, 2))
    >>> batches = [{"attention_mask": torch.ones(2, w)} for w in (10, 7)]
    >>> with trimmed_norms_refused(net, batches):
    ...     _ = net(torch.zeros(2, 1, 10))
    ...     try:
    ...         _ = net(torch.zeros(2, 1, 7))
    ...     except ValueError as error:
    ...         print(str(error)[:60])
    step(max_tokens=...) trims each micro-batch to its longest r
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["trimmed_norms_refused"]

_NORMS = (nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


@contextmanager
def trimmed_norms_refused(model: nn.Module, micro_batches: Sequence[Any]) -> Iterator[None]:
    """Within, a norm over the trimmed axis raises at its first input of another extent.

    Args:
        model: The model the window runs; its GroupNorm and InstanceNorm layers are watched.
        micro_batches: The packed micro-batches; nothing is watched when their
            `attention_mask`s are all as wide, as nothing was trimmed differently.
    """
    widths = [_width(micro_batch) for micro_batch in micro_batches]
    norms = [(name, m) for name, m in model.named_modules() if isinstance(m, _NORMS)]
    if not norms or len({w for w in widths if w is not None}) < 2:
        yield
        return
    first: dict[str, list[int]] = {}  # each norm's extents in the model's first call
    position: dict[str, int] = {}
    calls = [0]

    def on_model(module: nn.Module, args: Any) -> None:
        calls[0] += 1
        position.clear()

    def watcher(name: str) -> Any:
        def on_norm(module: nn.Module, args: Any) -> None:
            if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 3:
                return  # nothing past the channels: normalized per position
            extent = math.prod(args[0].shape[2:])
            seen = first.setdefault(name, [])
            index = position[name] = position.get(name, -1) + 1
            if calls[0] <= 1:
                seen.append(extent)
            elif index < len(seen) and seen[index] != extent:
                raise ValueError(_message(name, module, seen[index], extent, widths))

        return on_norm

    handles = [model.register_forward_pre_hook(on_model)]
    handles += [m.register_forward_pre_hook(watcher(name)) for name, m in norms]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _width(micro_batch: Any) -> int | None:
    mask = micro_batch.get("attention_mask") if isinstance(micro_batch, Mapping) else None
    return mask.shape[1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def _message(name: str, module: nn.Module, was: int, now: int, widths: Sequence[Any]) -> str:
    known = sorted({w for w in widths if w is not None}, reverse=True)
    return (
        f"step(max_tokens=...) trims each micro-batch to its longest row (widths "
        f"{', '.join(map(str, known))}), but {type(module).__name__} at {name or 'the model'} "
        f"normalizes over that axis, padding included: its input spans {was} positions in one "
        f"micro-batch and {now} in another, so a trimmed row is normalized over other positions "
        "than in the full batch and the step would not be the full-batch one (nothing was "
        "changed). Use step(batch, loss_fn) with micro_batch_size= (rows are not trimmed: "
        "exact), or a model whose norms are per position (Wav2Vec2/HuBERT: "
        "feat_extract_norm='layer')."
    )
