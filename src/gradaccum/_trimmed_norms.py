"""Norms over the padded axis, which a token budget's trimming would change: refused by name.

`step(max_tokens=...)` trims each micro-batch to its longest row. That is exact when every
position is computed from its own row's real positions (attention with a mask, per-position
norms), but not through a GroupNorm or InstanceNorm that normalizes over the sequence axis,
padding included: Wav2Vec2, HuBERT and WavLM with `feat_extract_norm="group"` normalize their
first convolution's output over time, so a row trimmed of padding is normalized over fewer
positions than in the full batch (1.6e-2 off in three steps, silently). Such a layer sees an
input whose extent past the channels changes with the micro-batch's width; the first time it
does, the window is refused (nothing changed), naming the layer and the fix.

The step differs from the full-batch one exactly when a micro-batch is narrower than the
batch's `attention_mask` (a row then loses padding it was normalized over) and such a norm's
extent follows the width. With micro-batches of several widths, their extents are compared.
When every micro-batch has the same trimmed width (one micro-batch, or a batch padded past
its longest row, `padding="max_length"`), there is nothing to compare them with: the norms'
extents at the batch's width are read first from one untrimmed row (no_grad, eval mode, the
random state put back; once per model until a window shows them independent of the width).

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
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from gradaccum._loss_call import call_loss_fn
from gradaccum._sync_base import is_fsdp
from gradaccum._wrappers import unwrapped
from gradaccum.batching import slice_batch, to_device

__all__ = ["trimmed_norms_refused"]

_NORMS = (nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
# Models whose norms kept their extent from the batch's width to a trimmed one: not probed again.
_WIDTH_FREE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@contextmanager
def trimmed_norms_refused(
    model: nn.Module,
    micro_batches: Sequence[Any],
    batch: Any = None,
    loss_fn: Callable[..., Any] | None = None,
) -> Iterator[None]:
    """Within, a norm over the trimmed axis raises at its first input of another extent.

    Args:
        model: The model the window runs; its GroupNorm and InstanceNorm layers are watched.
        micro_batches: The packed micro-batches.
        batch: The batch they were packed from: nothing is watched when no micro-batch is
            narrower than its `attention_mask` (nothing was trimmed).
        loss_fn: Runs one untrimmed row of `batch` first when all micro-batches were trimmed
            to one width, so that their extents are compared with the batch's.
    """
    widths = [_width(micro_batch) for micro_batch in micro_batches]
    known, full = {w for w in widths if w is not None}, _width(batch)
    uniform = len(known) == 1
    trimmed = len(known) > 1 or (uniform and full is not None and max(known) < full)
    norms = [(name, m) for name, m in model.named_modules() if isinstance(m, _NORMS)]
    probe = uniform and loss_fn is not None and model not in _WIDTH_FREE and not is_fsdp(model)
    if not norms or not trimmed or (uniform and not probe):
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
                raise ValueError(_message(name, module, seen[index], extent, widths, full))

        return on_norm

    handles = [model.register_forward_pre_hook(on_model)]
    handles += [m.register_forward_pre_hook(watcher(name)) for name, m in norms]
    try:
        if probe:
            assert loss_fn is not None  # for mypy: `probe` says so
            _untrimmed_row(model, loss_fn, slice_batch(batch, 0, 1))  # the first call (read)
            calls[0] = int(bool(first))  # none seen (it raised first): compared among themselves
        probed = probe and bool(first)
        yield
        if probed:  # the norms' extents agreed at the batch's width and the trimmed one
            _WIDTH_FREE.add(model)
    finally:
        for handle in handles:
            handle.remove()


def _untrimmed_row(model: nn.Module, loss_fn: Callable[..., Any], row: Any) -> None:
    """Run `loss_fn` on one row at the batch's width, changing nothing: the norms' extents.

    It runs the model inside DDP/DataParallel/compile: a DDP forward's buffer broadcast, which
    other ranks would not join, is left out (an FSDP model, whose forward gathers, is not run).
    """
    model = unwrapped(model)
    modes = [(module, module.training) for module in model.modules()]
    device = next((p.device for p in model.parameters()), None)  # where the window moves rows
    row = row if device is None else to_device(row, device)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        model.eval()  # no BatchNorm statistics counted, no dropout drawn; the same shapes
        try:
            call_loss_fn(loss_fn, model, row)
        except Exception:  # the extents seen before it are read; the window then runs
            pass
        finally:
            for module, training in modes:
                module.training = training


def _width(micro_batch: Any) -> int | None:
    mask = micro_batch.get("attention_mask") if isinstance(micro_batch, Mapping) else None
    return mask.shape[1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def _message(
    name: str, module: nn.Module, was: int, now: int, widths: Sequence[Any], full: int | None
) -> str:
    known = ", ".join(map(str, sorted({w for w in widths if w is not None}, reverse=True)))
    layer = f"{type(module).__name__} at {name or 'the model'}"
    return (
        f"step(max_tokens=...) trims each micro-batch to its longest row (widths {known}; the "
        f"batch's is {full}), but {layer} normalizes over that axis, padding included: its "
        f"input spans {was} positions in one micro-batch (or the untrimmed batch) and {now} in "
        "another, so a trimmed row is normalized over other positions than in the full batch "
        "and the step would not be the full-batch one (nothing was changed). Use "
        "step(batch, loss_fn) with micro_batch_size= (rows are not trimmed: exact), or a model "
        "whose norms are per position (Wav2Vec2/HuBERT: feat_extract_norm='layer')."
    )
