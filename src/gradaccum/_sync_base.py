"""The gradient-sync interface (`GradSync`), the one-process strategy, and the model's group.

The distributed strategies are in `gradaccum._distributed_sync`; `gradaccum.sync` picks one.

Example:
    >>> import torch
    >>> sync = LocalSync()
    >>> sync.agree_on_plan(3, 8), sync.sum_over_ranks(5)
    (Plan(micro_batches=3, expected_items=None), 5)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from gradaccum import _compat
from gradaccum._agreement import OUT_OF_MEMORY, RankSummary, WindowAgreement
from gradaccum._warnings import warn_user

__all__ = [
    "FAILED_COUNT",
    "NO_CONTEXT",
    "GradSync",
    "LocalSync",
    "Plan",
    "check_comm_hook",
    "comm_hook_name",
    "device_for",
    "is_fsdp",
    "process_group",
    "uncompiled",
    "world_size",
]

NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every `with`
FAILED_COUNT = -(2**40)  # sent to `sum_over_ranks` by a rank whose micro-batch raised


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module `torch.compile` wrapped (`OptimizedModule._orig_mod`), else `model` itself.

    `torch.compile(DistributedDataParallel(model))` is how PyTorch's docs combine the two: the
    wrapper must not hide the DDP (or FSDP2) model from the library.
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether `fully_shard` (FSDP2) was applied to the model.

    Raises:
        RuntimeError: For an FSDP2 model on torch before 2.6, which gradaccum does not support.
    """
    fsdp_module = _compat.fsdp_module_type()  # None: a torch built without distributed support
    if fsdp_module is None or not isinstance(uncompiled(model), fsdp_module):
        return False
    _compat.check_fsdp2_supported()
    return True


def process_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The process group the model's gradients are reduced over, or None if not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    model = uncompiled(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        group: dist.ProcessGroup = model.process_group
        return group
    if is_fsdp(model):
        return _fsdp_group(model)
    return None


def _fsdp_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The group of an FSDP2 model's mesh, read from any sharded (DTensor) parameter.

    Which parameter does not matter, and some are plain tensors at times: with `fully_shard` on
    each block and then on the root, the root's own parameters are unsharded between its forward
    and its backward. A 2-D (HSDP) mesh reduces over all of its ranks.
    """
    dtensor = _compat.dtensor_type()
    for param in model.parameters():
        if isinstance(param, dtensor):
            mesh = param.device_mesh
            if mesh.ndim == 1:
                return mesh.get_group()
            world: dist.ProcessGroup | None = dist.group.WORLD
            return world
    return None


def comm_hook_name(model: torch.nn.Module) -> str | None:
    """The communication hook registered on a DDP model, by name; None if there is none.

    `register_comm_hook()` records a Python hook in `_comm_hooks`; a built-in one
    (`_register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)`) lives only in the C++
    reducer, whose logging data names either kind.
    """
    hooks = getattr(model, "_comm_hooks", None)
    if hooks:
        return str(getattr(hooks[0][0], "__qualname__", hooks[0][0]))
    logging_data = getattr(model, "_get_ddp_logging_data", None)
    if logging_data is None:
        return None
    try:
        name = logging_data().get("comm_hook")
    except RuntimeError:  # no logger (a DDP built without one): nothing recorded
        return None
    return str(name) if name else None


def check_comm_hook(model: torch.nn.Module, first_window: bool, warned: bool) -> bool:
    """Refuse a hook on a static graph's first window (DDP reduces it), else warn it is unused.

    Returns:
        Whether this call warned (once per `Accumulator`: `warned` says it already did).

    Raises:
        ValueError: In a `static_graph=True` model's first window, with a hook registered.
    """
    hook = comm_hook_name(model)  # register_comm_hook() or a built-in hook
    if first_window and hook:  # DDP reduces this window itself, through the hook
        raise ValueError(
            f"the DDP communication hook {hook} registered on this static_graph=True model "
            "would reduce its first window (DDP synchronizes it; a compression hook such as "
            "fp16_compress_hook rounds that step's gradients) and never a later one, which "
            "gradaccum reduces itself, exactly. Remove register_comm_hook() (or "
            "_register_builtin_comm_hook()), or wrap with static_graph=False. Nothing was "
            "changed."
        )
    if not hook or warned:
        return False
    warn_user(  # DDP's reducer, and so the hook, never runs here
        UserWarning(
            f"the DDP communication hook {hook} registered on this model is not used: "
            "gradaccum reduces each window's gradients itself, once, in their own dtype "
            "(exact); remove register_comm_hook() (or _register_builtin_comm_hook()) to "
            "silence this."
        )
    )
    return True


def world_size(model: torch.nn.Module) -> int:
    """Number of ranks the model's gradients are reduced over (1 when not distributed)."""
    group = process_group(model)
    return 1 if group is None else dist.get_world_size(group)


def device_for(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    accelerator = _compat.current_accelerator()
    return accelerator if accelerator is not None else torch.device("cpu")


class GradSync:
    """The single-process strategy, and the interface every backend implements."""

    world = 1
    rank = 0
    averaged_over = 1  # what the backend's own reduction divides the summed gradient by
    replicas = 1  # ranks that see each batch (FSDP2 with tensor parallel: the TP degree)
    syncs_last_backward = False  # whether the last backward itself reduces gradients
    defers = False  # whether the backend holds unreduced sums until a synchronized backward
    joins_flush = False  # whether a rank with no open window joins `flush()`'s exchange (DDP)
    flushing = False  # set while `flush()` closes a window (ranks must all be flushing)
    tokens = False  # set by `flush()` for `Tokens` windows, which sum counts per micro-batch
    frozen_batchnorm = (
        False  # batchnorm="frozen": BatchNorm layers run in eval mode (no collective)
    )

    def micro_context(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        """The context a micro-batch's forward and backward run in."""
        return NO_CONTEXT

    def backward_context(self, *, reduce: bool) -> contextlib.AbstractContextManager[None]:
        """The context of a backward that reduces (`reduce`) or only accumulates gradients."""
        return NO_CONTEXT

    def exchange(self, mine: RankSummary) -> WindowAgreement:
        """Agree on the window over ranks (one small collective when distributed)."""
        return WindowAgreement(
            mine.count,
            mine.loss_sum,
            mine.denominator,
            (0,) if mine.failed else (),
            mine.failed == OUT_OF_MEMORY,
            mine.has_grad,
            mine.graph,
            mine.terms,
        )

    def reduce(self, grads: Sequence[torch.Tensor]) -> None:
        """Sum `grads` over ranks in place (each rank passes the same shapes, same order)."""

    def average_unsharded(
        self,
        entries: Sequence[tuple[int, torch.nn.Parameter, torch.Tensor | None]],
        zeros: Callable[[int, torch.nn.Parameter], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Gradients the backend does not reduce (FSDP2: unsharded parameters), reduced alike.

        `entries` are `(index, param, grad)`; the gradients that exist are returned.
        """
        return [grad for *_, grad in entries if grad is not None]

    def agree_on_plan(self, micro_batches: int, first_items: int) -> Plan:
        """Agree, before any forward, on how many micro-batches every rank runs (see `Plan`)."""
        return Plan(micro_batches, None)

    def sum_over_ranks(self, value: int) -> int:
        """`value` summed over ranks: one all-reduce of one number when distributed."""
        return value

    def sum_of_counts(self, value: int) -> int:
        """Items counted over ranks (`sum_over_ranks`), each batch once, not once per replica."""
        return self.sum_over_ranks(value) // self.replicas

    def common_denominator(self, denominator: float) -> float:
        """The backward denominator every rank uses, from this rank's choice (see FSDP2)."""
        return denominator

    def begin_window(self) -> None:
        """A window opens."""

    def end_window(self) -> None:
        """A window ended: stepped, skipped or forgotten."""
        self.flushing = False

    def forget_window(self) -> None:
        """A window is forgotten: undo what the backend holds for it."""

    def check_resume(self, open_window: bool, origin: Sequence[int] | None = None) -> None:
        """Raise ValueError if a saved window cannot continue on this backend or rank.

        An open window holds the partial gradients and counts of the rank that saved it
        (`origin`: its rank and world size; None in states saved before it was recorded):
        continuing it on another rank, or with another number of ranks, would count that
        rank's items twice and lose this one's, a silently wrong step.
        """
        if not open_window or origin is None or tuple(origin) == (self.rank, self.world):
            return
        saved_rank, saved_world = origin
        raise ValueError(
            f"this Accumulator state holds an open window saved on rank {saved_rank} of "
            f"{saved_world}, whose partial gradients and counts are that rank's own; it cannot "
            f"continue on rank {self.rank} of {self.world}. Save a checkpoint from every rank "
            "to its own file (e.g. f'ckpt-rank{rank}.pt') and load each rank's own, or save at "
            "a window boundary (after a step), where every rank's state is the same."
        )

    def sync_buffers(self) -> None:
        """A step was taken on every rank: make the module's buffers equal over ranks."""

    def keeps_local(self, param: torch.nn.Parameter) -> bool:
        """Whether `param`'s gradient stays this rank's own, never reduced over ranks.

        A DDP model's ignored parameters (`_set_params_and_buffers_to_ignore_for_model`).
        """
        return False


class Plan(NamedTuple):
    """What a rank runs in a window given whole (`step()`).

    Attributes:
        micro_batches: Micro-batches to run: the rank's own, then zero-item ones up to this
            number (FSDP2, whose every forward and backward is a collective).
        expected_items: The window's expected count over all ranks, from which every rank
            derives the same backward denominator (FSDP2 reduces inside the backward); None
            when each rank may choose its own.
    """

    micro_batches: int
    expected_items: int | None


class LocalSync(GradSync):
    """One process: nothing to defer, exchange or reduce."""
