"""Modules and parameters set on a model after the Accumulator was built (a replaced head).

Fine-tuning replaces modules of a built model: a new head (`model.fc = nn.Linear(...)`, a
classifier with its own BatchNorm), an adapter injected, `convert_to_groupnorm`. The engine reads
the model's parameters, BatchNorm layers and forward-updated buffers once (walking the modules
each window would cost time), so a module set afterwards was not seen: its BatchNorm ran
per micro-batch under `batchnorm="pooled"` and was neither warned of under `"micro"` nor put
back by a failed window, and a new parameter the optimizer does not hold trained silently never.

`StructureWatch` says when such a reading may be stale. torch's global registration hooks for
modules and parameters (`Module.__setattr__`, `add_module`, `register_parameter`) bump one
process-wide counter, so a window costs one integer comparison; after a registration anywhere
(a model built, a head set), the reading is taken again once and compared.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> watch = StructureWatch(lambda: [id(m) for m in model.modules()])
    >>> watch.look() is None
    True
    >>> model.append(torch.nn.BatchNorm1d(2))
    Sequential(...)
    >>> fresh = watch.look(); fresh is not None and len(fresh)
    3
    >>> watch.settle(fresh); watch.look() is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from torch.nn.modules import module as _module

__all__ = ["StructureWatch"]

T = TypeVar("T")
_generation = [0]  # registrations of a module or parameter on any module, in this process
_installed = [False]


def _registered(*_: object) -> None:  # returns None: torch keeps the registered object
    _generation[0] += 1


def _install() -> None:
    if not _installed[0]:
        _module.register_module_module_registration_hook(_registered)
        _module.register_module_parameter_registration_hook(_registered)
        _installed[0] = True


class StructureWatch(Generic[T]):
    """A reading of a model's structure, taken again when a module or parameter was set since.

    Args:
        read: Reads what the caller keeps (parameter or module identities); compared with `==`.
    """

    def __init__(self, read: Callable[[], T]) -> None:
        _install()
        self._read = read
        self._seen = _generation[0]
        self.value = read()  # the reading in use

    def look(self) -> T | None:
        """The new reading if it differs from the settled one, else None (O(1) usually).

        Not settled: the caller settles it once it has taken it in, so a refusal is repeated.
        """
        if _generation[0] == self._seen:
            return None
        seen, value = _generation[0], self._read()
        if value == self.value:
            self._seen = seen
            return None
        return value

    def settle(self, value: T) -> None:
        """Take `value` (from `look`) as the reading in use."""
        self._seen, self.value = _generation[0], value
