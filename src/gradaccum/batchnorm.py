"""BatchNorm under gradient accumulation: detection, pooled or frozen statistics, alternatives.

Train-mode BatchNorm is not additive over micro-batches: it normalizes with micro-batch
statistics, its backward couples only one micro-batch's items, and it updates its running
statistics once per micro-batch. `BatchNormControl` runs the `Accumulator`'s `batchnorm=` modes:
`"micro"` (plain PyTorch, "ghost batch norm"), `"pooled"` (one running-statistics update per
window from the exact mean and variance of all its items; the normalization stays per
micro-batch) and `"frozen"` (eval-mode BatchNorm while accumulating). `convert_to_groupnorm`
makes a model exact; `recalibrate` re-estimates running statistics after training.

Example:
    >>> import torch
    >>> from gradaccum.batchnorm import BatchNormControl
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    >>> control = BatchNormControl(model, "pooled")
    >>> for micro_batch in torch.randn(12, 3).split(4):
    ...     with control.micro_context():
    ...         model(micro_batch).pow(2).sum().backward()
    >>> control.end_window()  # one update, as one forward of all 12 items would make
    >>> int(model[1].num_batches_tracked)
    1
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradaccum._averaged import named_trained_modules
from gradaccum._batchnorm_state import RUNNING, load_calls, load_start
from gradaccum._frozen_batchnorm import frozen
from gradaccum._groupnorm import batchnorm_modules, convert_to_groupnorm
from gradaccum._pooled_stats import (
    Record,
    merge,
    recording,
    tracked,
    update_running,
)
from gradaccum._structure import StructureWatch
from gradaccum._warnings import warn_user
from gradaccum._wrappers import known_name, unwrapped
from gradaccum.batching import to_device
from gradaccum.options import BatchNormMode, parse

__all__ = [
    "BatchNormAccumulationWarning",
    "BatchNormControl",
    "batchnorm_modules",
    "convert_to_groupnorm",
    "recalibrate",
    "warn_if_inexact",
]

_NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every `with`

STATE_VERSION = 1


class BatchNormAccumulationWarning(UserWarning):
    """BatchNorm layers in train mode make micro-batch accumulation inexact."""


def warn_if_inexact(model: nn.Module, micro_items: int, window_items: int) -> bool:
    """Warn if BatchNorm layers using batch statistics see micro-batches smaller than the window.

    Returns whether a `BatchNormAccumulationWarning` was issued: never if `micro_items`, the
    items per micro-batch, is at least `window_items`, the items per optimizer step.
    """
    # Batch statistics are used in train mode, and in eval mode too without running statistics.
    # An EMA copy the model holds (AveragedModel) is in train mode but never runs in a step.
    batch_stats = [
        (n, m)
        for n, m in named_trained_modules(model)
        if isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)
    ]
    names = [name or "<model>" for name, _ in batch_stats]
    if not names or micro_items >= window_items:
        return False
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    # A frozen teacher's or backbone's BatchNorm left in train mode by `model.train()`: it has
    # weights, none trainable, so eval mode (exact) changes nothing the optimizer trains.
    frozen = [
        n or "<model>" for n, m in batch_stats if _all_frozen(m) and m.running_mean is not None
    ]
    teacher = (
        f" Of these, {', '.join(frozen[:3])} train no parameter (a frozen teacher or backbone "
        "left in train mode by model.train()): put them in eval mode after each model.train() "
        "(teacher.eval()), where their running statistics make them exact."
        if frozen
        else ""
    )
    warn_user(
        BatchNormAccumulationWarning(
            f"BatchNorm layers ({shown}) normalize micro-batches of {micro_items} items but the "
            f"optimizer step covers {window_items}: accumulation is not exact. They use "
            "micro-batch statistics, their backward couples only one micro-batch's items, and "
            "their running statistics are updated once per micro-batch. Options: "
            "batchnorm='pooled' (running statistics from the whole window), batchnorm='frozen' "
            "(eval-mode BatchNorm, for fine-tuning), gradaccum.batchnorm.convert_to_groupnorm"
            "(model) (exact), gradaccum.batchnorm.recalibrate(model, loader, num_batches) after "
            f"training.{teacher}"
        )
    )
    return True


def _all_frozen(module: nn.Module) -> bool:
    """Whether `module` has parameters and none of them requires grad."""
    params = list(module.parameters(recurse=False))
    return bool(params) and not any(p.requires_grad for p in params)


def _check_freezable(modules: list[tuple[str, _BatchNorm]]) -> None:
    """Refuse "frozen" for BatchNorm without running statistics (eval mode uses batch ones).

    Raises:
        ValueError: Naming the layers built with `track_running_stats=False`, and the fixes.
    """
    untracked = [repr(name or "<model>") for name, m in modules if m.running_mean is None]
    if untracked:
        raise ValueError(
            f"batchnorm='frozen' cannot freeze BatchNorm layers {', '.join(untracked)}: built with "
            "track_running_stats=False, they normalize with batch statistics even in eval mode, so "
            "accumulation would be inexact. Use gradaccum.batchnorm.convert_to_groupnorm(model) "
            "(exact), track_running_stats=True, or batchnorm='micro' knowing it is inexact."
        )


@contextlib.contextmanager
def _one_row_note() -> Iterator[None]:
    """Say why a micro-batch of one row fails in a train-mode BatchNorm the full batch passes."""
    try:
        yield
    except ValueError as error:
        if "more than 1 value per channel" in str(error) and hasattr(error, "add_note"):
            error.add_note(
                "gradaccum: a train-mode BatchNorm got a micro-batch with one value per channel, "
                "typically a last micro-batch of 1 row (the batch size leaves a remainder of 1 "
                "over micro_batch_size; with micro_step, a loader's last batch). Pick a "
                "micro_batch_size that leaves no single row (or drop_last=True), use "
                "batchnorm='frozen', or convert_to_groupnorm(model)."
            )
        raise


class BatchNormControl:
    """Applies a `BatchNormMode` to a model's BatchNorm layers, one micro-batch at a time.

    Wrap each micro-batch's forward and backward in `micro_context()`, call `end_window()` when
    the optimizer steps and `discard_window()` when a window is dropped. Only modules in train
    mode are affected. Each process pools its own items: under DDP rank 0's buffers are then
    broadcast as usual, and SyncBatchNorm's pooled statistics cover this process's items only.

    Args:
        model: The model (possibly wrapped).
        mode: `"micro"`, `"pooled"` or `"frozen"` (or a `BatchNormMode`).

    Raises:
        ValueError: For an unknown mode, or "frozen" with BatchNorm layers that keep no running
            statistics (`track_running_stats=False`).
    """

    def __init__(self, model: nn.Module, mode: BatchNormMode | str) -> None:
        self.mode = parse(BatchNormMode, mode, "batchnorm")
        # Named inside a torch.compile / DDP wrapper: a state saved wrapped loads unwrapped.
        self.modules = batchnorm_modules(unwrapped(model))
        if self.mode is BatchNormMode.FROZEN:
            _check_freezable(self.modules)
        self._model = unwrapped(model)  # its warning names the layers inside a wrapper
        self._by_name = dict(self.modules)
        self._structure = StructureWatch(self._scan)  # a head set after building, with its own
        self._pending: Record = {}  # "pooled": the window's statistics so far
        # "micro": each statistic as the window began, by (module name, buffer name).
        self._saved: list[tuple[str, str, torch.Tensor, torch.Tensor]] = []
        self._resumed: list[tuple[str, str, torch.Tensor, torch.Tensor]] | None = None
        self._warned = False

    def _scan(self) -> list[tuple[str, _BatchNorm]]:
        return batchnorm_modules(self._model)

    def micro_context(self) -> contextlib.AbstractContextManager[None]:
        """The context for one micro-batch's forward and backward."""
        if self.mode is BatchNormMode.FROZEN:
            return frozen([m for _, m in self.modules])
        if self.mode is BatchNormMode.POOLED:
            return self._pooled()
        return _one_row_note() if self.modules else _NO_CONTEXT

    def warn_once(self, micro_items: int, window_items: int) -> bool:
        """`warn_if_inexact` at most once, in "micro" mode only; returns whether it warned.

        "frozen" is exact; "pooled" is chosen knowing that it normalizes per micro-batch.
        """
        if self._warned or self.mode is not BatchNormMode.MICRO:
            return False
        if not self.modules or micro_items >= window_items:  # the common cases, in O(1)
            return False
        self._warned = warn_if_inexact(self._model, micro_items, window_items)
        return self._warned

    @contextlib.contextmanager
    def _pooled(self) -> Iterator[None]:
        # In eval mode too: a loss_fn calling model.train() puts them in train mode mid-window.
        active = [(name, m) for name, m in self.modules if tracked(m)]
        # The hooks turn track_running_stats off in train mode: BatchNorm then gets no running
        # buffers, so it normalizes with micro-batch statistics but updates nothing.
        try:
            with _one_row_note(), recording(active, per_call=True) as record:
                yield
        finally:
            for _, module in active:
                module.track_running_stats = True
        # Reached only if the micro-batch completed: a failed one (e.g. OOM) adds nothing.
        for name, calls in record.items():
            pending = itertools.zip_longest(self._pending.get(name, []), calls)
            self._pending[name] = [merge(a, b) for a, b in pending]

    def end_window(self) -> None:
        """At the step: one update per BatchNorm call (k calls per forward: k), cleared first.

        Cleared before the updates, so one that raises leaves nothing for the next window.
        """
        pending, self._pending, self._saved = self._pending, {}, []
        for name, calls in pending.items():
            for stats in calls:
                update_running(self._by_name[name], stats)

    def open_window(self) -> None:
        """Remember the running statistics a window may change, to put them back if it fails.

        A train-mode BatchNorm in "micro" mode updates its buffers during a window ("pooled"
        updates them once, at the step; "frozen" never). Every tracked one is copied, in eval
        mode too, since a loss_fn calling model.train() puts it in train mode mid-window (and
        in "pooled" one that was in eval mode as the micro-batch began updates as in "micro"):
        a few vectors per layer, and nothing at all for a model without BatchNorm.
        """
        if (fresh := self._structure.look()) is not None:  # BatchNorm set after building
            if self.mode is BatchNormMode.FROZEN:
                _check_freezable(fresh)  # before anything changes
            added = {id(m) for _, m in fresh} - {id(m) for _, m in self.modules}
            self.modules, self._by_name, self._warned = (
                fresh,
                dict(fresh),
                self._warned and not added,
            )
            self._structure.settle(fresh)
        if self.mode is BatchNormMode.FROZEN or not self.modules:
            self._saved = []
            return
        self._saved = [
            (name, key, buffer, buffer.clone())
            for name, module in self.modules
            if tracked(module)  # eval mode too: a loss_fn may call model.train()
            for key in RUNNING
            if (buffer := getattr(module, key)) is not None
        ]

    def resume_window(self, is_open: bool) -> None:
        """After a load: an open window's start is the one loaded (older states: taken now)."""
        resumed, self._resumed = self._resumed, None
        if not is_open:
            self._saved = []
        elif resumed is not None:
            self._saved = resumed
        else:
            self.open_window()

    def forget_window(self) -> None:
        """Undo everything the window did: running statistics back, pooled statistics dropped."""
        with torch.no_grad():
            for _, _, buffer, saved in self._saved:
                buffer.copy_(saved)
        self._saved = []
        self._pending = {}

    def discard_window(self) -> None:
        """Forget the window's pooled statistics (the running ones are not touched)."""
        self._pending = {}

    def state_dict(self) -> dict[str, Any]:
        """The pending pooled statistics and, "micro", the open window's starting statistics.

        Plain data (`torch.load(weights_only=True)`). The start is what a window that fails
        after a resume puts back, whatever the model held when the state was loaded.
        """
        pending = {
            name: [None if s is None else {"count": s[0], "mean": s[1], "m2": s[2]} for s in calls]
            for name, calls in self._pending.items()
        }
        start = [[name, key, saved.clone()] for name, key, _, saved in self._saved]
        return {
            "version": STATE_VERSION,
            "mode": self.mode.value,
            "pending": pending,
            "start": start,
        }

    def check_mode(self, saved: object) -> None:
        """Raise ValueError unless a saved Accumulator used this `batchnorm` mode."""
        if saved != self.mode.value:
            raise ValueError(
                f"the saved Accumulator has batchnorm={saved!r} but this one has "
                f"batchnorm={self.mode.value!r}; build the Accumulator with the saved settings."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; raise ValueError naming any mismatch, changing nothing."""
        pending = state.get("pending") if isinstance(state, Mapping) else None
        if not isinstance(pending, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"batchnorm state: expected version {STATE_VERSION} and 'pending'.")
        if pending and self.mode is not BatchNormMode.POOLED:
            raise ValueError(
                f"batchnorm state holds pooled statistics of {sorted(pending)} but this "
                f"accumulator uses batchnorm={self.mode.value!r}; resume with 'pooled'."
            )
        names = {n: known_name(n, self._by_name) for n in pending}  # older: wrapper prefixes
        loaded = {
            names[n]: load_calls(n, self._by_name.get(names[n]), c) for n, c in pending.items()
        }
        start = state.get("start")  # absent from older states: taken again when loaded
        self._resumed = None if not start else load_start(start, self._by_name)
        self._pending = loaded


def _default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch[0] if isinstance(batch, (tuple, list)) else batch)


def recalibrate(
    model: nn.Module,
    loader: Iterable[Any],
    num_batches: int,
    *,
    forward: Callable[[nn.Module, Any], Any] | None = None,
) -> None:
    """Re-estimate every tracked BatchNorm's running statistics over `num_batches` batches.

    As PreciseBN does, the model runs forward without gradients, changing no parameter; each
    BatchNorm normalizes with its batch's statistics and every other module is in eval mode (no
    dropout). The new running mean and variance are the exact mean and unbiased variance of all
    the items each BatchNorm saw, each item weighing the same (a cumulative average, not an
    exponential one). `num_batches_tracked` and every training flag are left as they were.

    Args:
        model: The model.
        loader: Yields batches (tensors or nestings of them), moved to the model's device.
        num_batches: How many batches to use (fewer if the loader ends first).
        forward: `forward(model, batch)`; by default `model(batch)` for a tensor,
            `model(batch[0])` for a tuple or list and `model(**batch)` for a dict.

    Raises:
        ValueError: If `num_batches < 1` or the loader yields no item; nothing is changed then.
    """
    if not isinstance(num_batches, int) or isinstance(num_batches, bool) or num_batches < 1:
        raise ValueError(f"num_batches={num_batches!r} must be a positive int.")
    forward = forward or _default_forward
    with_stats = [(n, m) for n, m in batchnorm_modules(model) if tracked(m)]
    if not with_stats:
        return
    device = next(iter((*model.parameters(), *model.buffers()))).device
    # Only BatchNorm's track_running_stats is restored; other modules' entry is unused.
    flags = [
        (m, m.training, isinstance(m, _BatchNorm) and m.track_running_stats)
        for m in model.modules()
    ]
    model.eval()
    for _, module in with_stats:
        module.train(True)
    try:
        with torch.no_grad(), recording(with_stats, per_call=False) as record:
            for batch in itertools.islice(loader, num_batches):
                forward(model, to_device(batch, device))
    finally:
        for any_module, training, track in flags:
            any_module.training = training
            if isinstance(any_module, _BatchNorm):
                any_module.track_running_stats = track
    found = [(m, s) for n, m in with_stats if record.get(n) and (s := record[n][0]) is not None]
    if not found:
        raise ValueError("recalibrate(): the loader yielded no item; statistics are unchanged.")
    with torch.no_grad():
        for module, (count, mean, m2) in found:
            assert module.running_mean is not None  # tracked(m)
            assert module.running_var is not None
            module.running_mean.copy_(mean)
            module.running_var.copy_(m2 / (count - 1) if count > 1 else m2)
