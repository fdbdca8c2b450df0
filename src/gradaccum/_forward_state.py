"""What a forward may change in place, copied to be put back (planning probes, `accumulate_grad`).

Separate from `_probe` so that `window` (whose `accumulate_grad` puts it back when a micro-batch
fails) does not import the planner.
"""

from __future__ import annotations

import torch

__all__ = ["ForwardState"]


class ForwardState:
    """What a forward may change in place, copied to be put back after a probe.

    Every buffer (BatchNorm statistics, spectral norm's power-iteration vectors, a VQ-VAE's EMA
    codebook, a quantization observer's range; updated in place or by reassigning the attribute)
    and the weight of each `nn.Embedding(max_norm=...)`, which renormalizes the rows it looks up.
    Other parameters are not copied: that would double the memory being planned.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._saved = [
            (module, key, buffer, buffer.detach().clone())
            for module in model.modules()
            for key, buffer in module._buffers.items()
            if buffer is not None
        ]
        self._weights = [
            (module.weight, module.weight.detach().clone())
            for module in model.modules()
            if isinstance(module, torch.nn.Embedding) and module.max_norm is not None
        ]

    def restore(self) -> None:
        """Put every copied tensor back: the same objects, their values as when copied."""
        with torch.no_grad():
            for module, key, buffer, old in self._saved:
                module._buffers[key] = buffer  # a forward may have reassigned the attribute
                if buffer.shape != old.shape:  # resized in place (a per-channel observer's)
                    buffer.resize_(old.shape)
                if not torch.equal(buffer, old):  # unchanged ones keep their version counters
                    buffer.copy_(old)
            for weight, old in self._weights:
                if not torch.equal(weight, old):
                    weight.copy_(old)
