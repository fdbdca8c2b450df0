"""Measuring the activation memory that autograd keeps between a forward and its backward.

A forward pass records, for its backward, the tensors each operation needs (a ReLU's output, a
Linear's input...). Those *saved tensors* are what a micro-batch shrinks: they grow with the number
of items in the batch, while parameters, gradients and optimizer state do not. This module counts
them exactly, with `torch.autograd.graph.saved_tensors_hooks`, instead of estimating them from
shapes or reading an allocator's counters (which do not exist on CPU and include unrelated memory).

What is counted: every distinct storage that autograd saves during `loss_fn(model, batch)`, at its
full size (a saved view keeps its whole storage alive). What is not counted: storages of the
model's parameters and buffers and of the batch's own tensors, which exist whether or not a graph
is built; temporaries freed during the forward; and the transient gradient buffers of the backward
itself. The result is the memory the graph holds at the end of the forward, which is the peak that
lasts until the backward releases it.

`track_tensor_bytes` follows every tensor storage that operations allocate while it is active, and
so measures the peak of a whole forward and backward, temporaries included, on any device.

`parse_bytes` reads a memory budget written as a byte count, such as `"512MiB"` or `"2GB"`.

Example:
    >>> import torch
    >>> from gradaccum.memory import measure_activation_bytes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    >>> measure_activation_bytes(model, torch.randn(3, 4), lambda m, x: m(x).sum())
    96
"""

from __future__ import annotations

import contextlib
import re
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gradaccum._loss_call import call_loss_fn

__all__ = ["TensorBytesTracker", "measure_activation_bytes", "parse_bytes", "track_tensor_bytes"]

# A number, then an optional unit: a decimal prefix (K, M, G, T), "i" for binary, "B" for bytes.
_BYTES_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
_UNIT_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_BYTE_FORMS = (
    "a number with an optional unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
    "(powers of 1024), case-insensitive and with the final B optional, e.g. 4096, 512MB or 2GiB"
)


def measure_activation_bytes(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[torch.nn.Module, Any], Any],
) -> int:
    """Return the bytes of activations autograd saves for the backward of `loss_fn(model, batch)`.

    The forward runs once, under `torch.autograd.graph.saved_tensors_hooks`, and every saved
    tensor's storage is recorded by its address, so a storage saved several times (a ReLU output
    that the next Linear saves again, views of one tensor) is counted once. The graph is then
    released without a backward: no `.grad` is touched and the model's parameters are unchanged.
    The forward runs in the model's current mode and under the caller's autocast, if any.

    Storages of the model's parameters and buffers, and of every tensor in `batch`, are left out:
    they are held anyway. So the micro-batch views made by `gradaccum.split_batch` do not count
    the whole batch they view. Tensors captured by `loss_fn` from elsewhere (a target held in a
    closure, say) are counted if autograd saves them; pass them in `batch` to leave them out.

    Args:
        model: The model whose forward is measured.
        batch: What `loss_fn` receives: a tensor or any nesting of dicts, lists and tuples.
        loss_fn: `loss_fn(model, batch)`, e.g. returning a scalar tensor or a `gradaccum.LossSum`;
            its result is only used to keep the graph alive while measuring.

    Returns:
        The total size in bytes of the distinct storages saved for backward; 0 if the forward
        builds no graph (under `torch.no_grad()`, or with nothing requiring grad).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
        ...                             torch.nn.Linear(32, 1))
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> small = measure_activation_bytes(model, (torch.randn(8, 16), torch.randn(8, 1)), mse)
        >>> large = measure_activation_bytes(model, (torch.randn(32, 16), torch.randn(32, 1)), mse)
        >>> small, large // small  # the Tanh output and the prediction: 8 * (32 + 1) * 4 bytes
        (1056, 4)
    """
    held = {_storage_address(t) for t in _held_tensors(model, batch)}
    saved: dict[tuple[torch.device, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_address(tensor)
        if key is not None and key not in held:
            saved[key] = max(saved.get(key, 0), tensor.untyped_storage().nbytes())
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        result = call_loss_fn(loss_fn, model, batch)
    # Every saved storage stays alive until `result` (and so its graph) is dropped below, so no
    # address in `saved` can have been reused by another storage during the forward.
    del result
    return sum(saved.values())


# TorchDispatchMode is unannotated in torch's source, so its implicit __init_subclass__ call is
# an untyped call.
class TensorBytesTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live and peak bytes of the tensor storages allocated by operations while active.

    Every operation goes through `__torch_dispatch__`; each output storage that is not one of the
    operation's inputs (an in-place result or a view) is new memory. A finalizer on the storage
    object (PyTorch keeps one Python object per live storage) subtracts it when it is freed, even
    if autograd held it out of Python's sight. Storages allocated before tracking are not
    counted, so `peak` is the growth above what already existed: a micro-batch's activations,
    gradient temporaries and any new `.grad`.

    Attributes:
        live: Bytes allocated while tracking that are still alive.
        peak: The largest `live` seen.
    """

    def __init__(self, include_meta: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.include_meta = include_meta
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __enter__(self) -> TensorBytesTracker:
        # Dynamo refuses to compile a frame under a Python dispatch mode, and remembers it: a
        # torch.compile'd model measured here ran eagerly for good after. Compiled functions run
        # eagerly while tracking (their graphs save at most what eager saves), compiled after.
        self._eager = _compiled_run_eagerly()
        self._eager.__enter__()
        try:
            super().__enter__()  # type: ignore[no-untyped-call]  # unannotated in torch
        except BaseException:
            self._eager.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            super().__exit__(*exc_info)  # type: ignore[no-untyped-call]  # unannotated in torch
        finally:
            self._eager.__exit__(*exc_info)

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload[..., Any],
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.include_meta and func is _READ_SCALAR and args[0].is_meta:
            return _stand_in(args[0].dtype)  # a replay's `.item()` (Adafactor's): sizes only
        result = func(*args, **(kwargs or {}))
        dense = self._counted
        inputs = {id(_storage_of(t)) for t in tree_leaves((args, kwargs)) if dense(t)}
        for tensor in tree_leaves(result):
            if not dense(tensor):
                continue
            storage = _storage_of(tensor)
            key = id(storage)
            if key in inputs or key in self._alive:
                continue
            size = storage.nbytes()
            self._alive.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)
        return result

    def _counted(self, value: object) -> bool:
        return _is_dense(value) or (
            self.include_meta and isinstance(value, torch.Tensor) and value.device.type == "meta"
        )

    def _freed(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.live -= size


_READ_SCALAR = torch.ops.aten._local_scalar_dense.default


def _stand_in(dtype: torch.dtype) -> bool | int | float:
    """The value a meta tensor's `.item()` reads in a replay, which has no values: one.

    A replay measures sizes; an optimizer reading a value (torch's Adafactor scales its step by
    `param.norm().item()`) raised "Tensor.item() cannot be called on meta tensors" from
    `plan_micro_batch` and `micro_batch_size="auto"`. What a read decides does not size state.
    """
    if dtype is torch.bool:
        return True
    return 1.0 if dtype.is_floating_point or dtype.is_complex else 1


def track_tensor_bytes(include_meta: bool = False) -> TensorBytesTracker:
    """A context manager measuring the peak tensor bytes allocated inside it.

    Args:
        include_meta: Count meta-device tensors too (sizes without memory, for replays); a
            meta tensor's `.item()` then reads 1.

    Example:
        >>> import torch
        >>> x = torch.randn(256, 256, requires_grad=True)
        >>> with track_tensor_bytes() as tracker:
        ...     (x @ x).tanh().sum().backward()
        >>> tracker.peak >= 2 * 256 * 256 * 4, tracker.live  # product and tanh output, then freed
        (True, 262144)
    """
    return TensorBytesTracker(include_meta)


def _compiled_run_eagerly() -> contextlib.AbstractContextManager[Any]:
    """`torch.compiler.set_stance("force_eager")`, if anything compiled (older torch: nothing)."""
    if "torch._dynamo" not in sys.modules or not hasattr(torch.compiler, "set_stance"):
        return contextlib.nullcontext()
    stance: contextlib.AbstractContextManager[Any] = torch.compiler.set_stance("force_eager")
    return stance


def _is_dense(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_sparse and value.device.type != "meta"


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage:
    return tensor.untyped_storage()


def parse_bytes(value: str | int) -> int:
    """Return the number of bytes that a byte count such as `"2GiB"` or `"512MB"` stands for.

    Accepted forms: an int, or a string holding a number (whole or decimal, no sign or exponent)
    with an optional unit. Binary units (KiB, MiB, GiB, TiB) are powers of 1024 and decimal ones
    (KB, MB, GB, TB) powers of 1000; units are case-insensitive, the final "B" may be left out
    after a prefix (`"2Gi"`, `"2G"`), and spaces may stand around the number and before the
    unit. A fractional count of bytes is rounded down (exactly: no float rounding).

    Args:
        value: The byte count, e.g. `"2GiB"`, `"512 MB"`, `"1.5KiB"`, `"4096"` or `4096`.

    Returns:
        The number of bytes, at least 1.

    Raises:
        ValueError: If `value` is not in an accepted form (the message lists them), or is less
            than one byte.
        TypeError: If `value` is neither a str nor an int (a bool is refused too).

    Example:
        >>> parse_bytes("2GiB"), parse_bytes("512MB"), parse_bytes("1.5KiB"), parse_bytes(4096)
        (2147483648, 512000000, 1536, 4096)
    """
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"a byte count is a str or an int, not {type(value).__name__}")
    if isinstance(value, int):
        count = value
    else:
        match = _BYTES_PATTERN.fullmatch(value.strip())
        if match is None or (match.group(3) and not match.group(2)):
            raise ValueError(
                f"{value!r} is not a size: it is not a byte count of an accepted form, "
                f"{_BYTE_FORMS}"
            )
        number, prefix, binary, _ = match.groups()
        base = 1024 if binary else 1000
        count = int(Fraction(number) * base ** _UNIT_POWERS[prefix.lower()])
    if count < 1:
        raise ValueError(f"{value!r} must be more than 0 bytes, counted in whole bytes")
    return count


def _held_tensors(model: torch.nn.Module, batch: Any) -> Iterator[torch.Tensor]:
    """Tensors that exist whether or not a graph is built: parameters, buffers, the batch."""
    yield from model.parameters()
    yield from model.buffers()
    yield from _batch_tensors(batch)


def _batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _batch_tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _batch_tensors(value)


def _storage_address(tensor: torch.Tensor) -> tuple[torch.device, int] | None:
    """Identify a tensor's storage by device and address; None if it has no plain storage."""
    if tensor.is_sparse or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return None
    if storage.nbytes() == 0:
        return None
    return tensor.device, storage.data_ptr()
