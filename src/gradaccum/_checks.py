"""Checks an `Accumulator` runs once, at construction, so that a window can never be stuck.

Everything here raises before anything is built, with a message that names the fix. The checks
cover the setups whose failure would otherwise surface in the middle of a window boundary, after
gradients were divided or the optimizer stepped: optimizers that need a closure, schedulers that
need a metric, sparse gradients, and settings of the wrong type.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import fields
from typing import Any

import torch

from gradaccum._averaged import averaged_parameter_ids, copied_parameter_ids
from gradaccum._batch_sizes import check_micro_batch_size
from gradaccum._other_optimizer import other_optimizer_message
from gradaccum._parameters import trainable_parameters
from gradaccum._state_layout import check_state_layout
from gradaccum._step_refusal import hooked_optimizer
from gradaccum._sync_base import is_fsdp
from gradaccum._warnings import warn_user
from gradaccum.options import SyncPolicy, Tokens
from gradaccum.recovery import is_auto
from gradaccum.sizing import MemoryPlan

__all__ = [
    "check_fsdp_support",
    "check_savable",
    "check_saved_state",
    "check_settings",
    "check_materialized",
    "check_max_grad_norm",
    "check_optimizer",
    "check_scheduler",
    "check_scheduler_optimizer",
    "check_sparse",
]

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def check_max_grad_norm(max_grad_norm: object) -> None:
    """Raise unless `max_grad_norm` is None or a positive finite number."""
    if max_grad_norm is None:
        return
    if (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, (int, float))
        or not 0 < max_grad_norm < math.inf
    ):
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a positive finite number.")


def check_optimizer(optimizer: object, model: torch.nn.Module) -> None:
    """Raise unless `optimizer` is an Optimizer over some of `model`'s trainable parameters.

    Optimizers whose `step` needs a closure (L-BFGS) re-evaluate the loss several times per
    step, which a window of micro-batches cannot offer; they are refused.
    """
    if isinstance(optimizer, (list, tuple)) and optimizer:
        kinds = ", ".join(type(o).__name__ for o in optimizer)
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__} of {len(optimizer)} ({kinds}); the "
            "Accumulator steps one torch.optim.Optimizer per window, and stepping only some "
            "would leave the others' gradients unused. Put every parameter in one optimizer, as "
            "param groups with their own lr and weight_decay; for two losses over two models (a "
            "GAN), build one Accumulator per model and its optimizer; for two optimizer types "
            "over one model (Muon for the 2-D weights, AdamW for the rest), pass one Optimizer "
            "that steps both (README, 'Two optimizers on one model')."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer={_short(optimizer)} must be a torch.optim.Optimizer, e.g. "
            "torch.optim.AdamW(model.parameters(), lr=1e-3)."
        )
    # A wrapper that never ran Optimizer.__init__: accelerate's AcceleratedOptimizer steps,
    # scales and skips by its own rules; a Lookahead (timm's, torch-optimizer's) adds to the step
    # of the optimizer it wraps, whose hooks watch it (`hooked_optimizer`).
    accelerate = type(optimizer).__module__.split(".")[0] == "accelerate"
    if accelerate or hooked_optimizer(optimizer) is None:
        inner = getattr(optimizer, "optimizer", None)
        if not accelerate:
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}, a wrapper that never ran "
                "torch.optim.Optimizer.__init__ and holds no optimizer sharing its param_groups "
                "(as .optimizer or .base_optimizer), so its steps cannot be watched. Call "
                "torch.optim.Optimizer.__init__ in its constructor, or keep the optimizer it "
                "wraps as .optimizer with param_groups = optimizer.param_groups (a Lookahead)."
            )
        fix = (
            f"pass the {type(inner).__name__} it wraps (optimizer.optimizer; a prepared "
            "scheduler's .scheduler)"
            if isinstance(inner, torch.optim.Optimizer)
            else "pass the torch optimizer it wraps"
        )
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}, a wrapper that never ran "
            f"torch.optim.Optimizer.__init__ (as accelerate's Accelerator.prepare returns); {fix}. "
            "The Accumulator does the accumulation, clipping and mixed precision itself."
        )
    model_ids = {id(p) for p in model.parameters() if p.requires_grad}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not model_ids:  # not the optimizer's fault: nothing in the model trains
        raise ValueError(
            f"{type(model).__name__} has no parameter with requires_grad=True, so no optimizer "
            "can train it. Unfreeze what should train (PEFT's merge_and_unload() returns the "
            "merged model with every weight frozen: model.requires_grad_(True) to train it "
            "whole), then build the optimizer over it."
        )
    if not model_ids & held:
        raise ValueError(
            "the optimizer holds none of the model's trainable parameters; build it from this "
            "model, e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)."
        )
    if _needs_argument(type(optimizer).step):
        raise ValueError(
            f"{type(optimizer).__name__}.step() needs a closure that re-evaluates the loss, "
            "which an accumulation window cannot provide; use an optimizer whose step() takes "
            "no argument (SGD, Adam, AdamW, ...)."
        )
    if callable(getattr(optimizer, "first_step", None)) and callable(
        getattr(optimizer, "second_step", None)
    ):  # SAM, ASAM, GSAM: step(closure) runs the second pass, which a window cannot give it
        raise ValueError(
            f"{type(optimizer).__name__} is a two-pass optimizer (first_step/second_step, as SAM): "
            "its step() needs a closure re-evaluating the loss at the perturbed weights, which an "
            "accumulation window cannot provide. Take both full-batch gradients with "
            "gradaccum.accumulate_grad: accumulate_grad(model, batch, loss_fn, micro_batch_size); "
            "optimizer.first_step(zero_grad=True); accumulate_grad(...) again; "
            "optimizer.second_step(zero_grad=True) (README, 'SAM')."
        )
    # An EMA/SWA copy the model holds (self.ema = AveragedModel(...)) is averaged, not trained.
    held |= averaged_parameter_ids(model)
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if outside:  # a user's own EMA class (`self.shadow = copy.deepcopy(net)`), by its structure
        held |= copied_parameter_ids(model, held)
        outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if outside:
        shown = ", ".join(outside[:3]) + (", ..." if len(outside) > 3 else "")
        warn_user(
            UserWarning(
                f"{len(outside)} trainable parameters of the model ({shown}) are in no param "
                "group of the optimizer: the Accumulator computes their gradients and clears "
                "them after every step, so nothing trains them (a second optimizer stepped after "
                "acc.step() would see no gradient). Add them to the optimizer (README, 'Two "
                "optimizers on one model'), or freeze them with requires_grad_(False). If "
                "another Accumulator steps them (a GAN's generator and discriminator in one "
                "module), give each Accumulator its own part as the model, "
                "Accumulator(gan.discriminator, d_optimizer): over the whole module, each "
                "window clears the other's gradients."
            )
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError(
            "SparseAdam needs sparse gradients, which gradaccum does not accumulate; use "
            "nn.Embedding(..., sparse=False) with Adam or AdamW."
        )
    if getattr(optimizer, "_overlap_with_ddp", False):  # ZeroRedundancyOptimizer
        raise ValueError(
            "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's communication "
            "hook, which never runs under gradaccum (it reduces each window's gradients "
            "itself), and its own step() does nothing: no parameter would ever move. Build it "
            "with overlap_with_ddp=False (the default); it still shards the optimizer state."
        )


def check_scheduler(scheduler: Any) -> None:
    """Raise unless `scheduler` is None or has a `step()` that needs no argument.

    `ReduceLROnPlateau.step(metrics)` needs a validation metric that only the caller has: step
    it yourself after validation, and pass `scheduler=None`.
    """
    if scheduler is None:
        return
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise TypeError(f"scheduler={scheduler!r} has no step(); pass an LRScheduler or None.")
    needed, name = _needs_argument(getattr(type(scheduler), "step", step)), type(scheduler).__name__
    if needed == ["metrics"]:  # ReduceLROnPlateau
        raise ValueError(
            f"{name}.step() needs an argument (a metric); the Accumulator steps its scheduler "
            f"with none. Pass scheduler=None and call {name}.step(val_loss) yourself after "
            "validation (between windows: when result.stepped is True)."
        )
    if needed:  # timm's schedulers: step(epoch), step_update(num_updates)
        raise ValueError(
            f"{name}.step() needs the argument {', '.join(needed)}, and the Accumulator steps "
            f"its scheduler with none. Pass scheduler=None and step {name} yourself as its "
            "documentation says, counting optimizer steps (when result.stepped is True) or "
            "epochs, never micro-batches."
        )


def check_scheduler_optimizer(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a scheduler that sets the learning rate of none of `optimizer`'s param groups.

    A scheduler built on an earlier optimizer (a notebook cell run again) would step silently
    while the optimizer the Accumulator steps keeps its learning rate. One built on a part of
    the optimizer (an optimizer stepping two, README) shares its groups, and is accepted.
    """
    scheduled = getattr(scheduler, "optimizer", None)
    if not isinstance(scheduled, torch.optim.Optimizer) or scheduled is optimizer:
        return
    mine = {id(group) for group in optimizer.param_groups}
    if not any(id(group) in mine for group in scheduled.param_groups):
        raise ValueError(other_optimizer_message(scheduler, scheduled, optimizer))


def check_materialized(model: torch.nn.Module) -> None:
    """Refuse a model whose parameters have no data yet (meta device, or lazy modules)."""
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"parameter {name} is on the meta device (it has no data); materialize the "
                "model first, e.g. model.to_empty(device='cpu') then initialize or load its "
                "weights."
            )
        if isinstance(param, torch.nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {name} is uninitialized (a lazy module); run one forward pass on a "
                "sample batch before building the Accumulator."
            )


def check_sparse(model: torch.nn.Module) -> None:
    """Refuse trainable embeddings with `sparse=True`: their gradients are not accumulated."""
    for name, module in model.named_modules():
        if isinstance(module, _SPARSE_MODULES) and module.sparse and module.weight.requires_grad:
            raise ValueError(
                f"{name or type(module).__name__} has sparse=True; gradaccum accumulates dense "
                "gradients only. Build it with sparse=False (and a dense optimizer such as "
                "AdamW), or freeze it."
            )


def _needs_argument(method: Any) -> list[str]:
    """The arguments calling the method `method` (read on the class) cannot go without.

    Read on the class: schedulers wrap the instance's `optimizer.step` in a `*args` wrapper.
    """
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: assume it takes none
        return []
    if inspect.isfunction(inspect.unwrap(method)) and parameters:
        parameters = parameters[1:]  # self
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def check_fsdp_support(model: torch.nn.Module, *, buffers: bool, policy: SyncPolicy) -> None:
    """Raise for settings FSDP2 does not support: `accum_dtype` buffers of deferred gradients.

    Under `SyncPolicy.WINDOW` FSDP2 keeps a window's gradient sums to itself until the last
    backward, where no buffer can see them; under `SyncPolicy.MICRO` every backward leaves a
    gradient shard, which the buffers accumulate.
    """
    if not is_fsdp(model):
        return
    if buffers and policy is SyncPolicy.WINDOW:
        raise ValueError(
            "accum_dtype buffers cannot see FSDP2's deferred gradients; pass "
            "sync_policy='micro' (every backward reduce-scatters into the buffers), or "
            "fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)) "
            "and leave accum_dtype=None."
        )


def check_settings(
    model: object,
    optimizer: object,
    *,
    micro_batch_size: object,
    accumulation_steps: object,
    memory_budget: object,
    max_grad_norm: object,
    scheduler: object,
) -> bool:
    """Every construction-time check of an `Accumulator`; whether it sizes micro-batches itself.

    Raises:
        TypeError: If `model` is not a `torch.nn.Module`.
        ValueError: For any invalid setting; the message names the fix.
    """
    if not isinstance(model, torch.nn.Module):
        what = "a class" if isinstance(model, type) else type(model).__name__
        swapped = (
            " The model comes first: Accumulator(model, optimizer, ...)."
            if isinstance(model, torch.optim.Optimizer)
            else ""
        )
        raise TypeError(
            f"model={_short(model)} must be a torch.nn.Module instance, not {what}: pass the "
            "module itself (e.g. MyModel(), not MyModel or a function; the loss goes in "
            f"loss_fn).{swapped}"
        )
    auto = is_auto(micro_batch_size, memory_budget)
    if micro_batch_size is not None and not auto:
        check_micro_batch_size(micro_batch_size)
    if accumulation_steps is not None and not isinstance(accumulation_steps, Tokens):
        check_micro_batch_size(accumulation_steps, "accumulation_steps")
    check_materialized(model)
    trainable_parameters(model)  # raises for a fully frozen model, naming the fix
    check_max_grad_norm(max_grad_norm)
    check_scheduler(scheduler)
    check_optimizer(optimizer, model)
    assert isinstance(optimizer, torch.optim.Optimizer)  # check_optimizer said so
    check_scheduler_optimizer(scheduler, optimizer)
    check_sparse(model)
    return auto


def check_saved_state(state: object, version: int, settings: dict[str, Any]) -> bool:
    """Raise unless `state` is an undamaged `Accumulator.state_dict()` of `version` and `settings`.

    `micro_batch_size` may differ: a window never stays open across `step()` calls, and the
    split changes no result beyond rounding, so a run may resume at another size (or "auto").

    Returns:
        Whether the saved `micro_batch_size` is this one (an auto state is kept only then).

    Raises:
        ValueError: Naming what differs, and the fix.
    """
    if not isinstance(state, dict) or "version" not in state:
        raise ValueError("not an Accumulator state: pass what Accumulator.state_dict() returned.")
    if state["version"] != version:
        raise ValueError(
            f"Accumulator state version {state['version']!r} is not supported; this "
            f"gradaccum reads version {version}."
        )
    saved_settings = state.get("settings")
    if not isinstance(saved_settings, dict):
        raise ValueError(
            "not an Accumulator state: its settings are missing; pass what "
            "Accumulator.state_dict() returned."
        )
    for name, mine in settings.items():
        saved = saved_settings.get(name)
        if saved != mine and name != "micro_batch_size":
            settable = name == "accumulation_steps" and saved is not None  # a ramp may set it
            fix = f" (or set acc.{name} = {saved} before loading)" if settable else ""
            raise ValueError(
                f"the saved Accumulator has {name}={saved!r} but this one has {name}={mine!r}; "
                f"build the Accumulator with the saved settings{fix}."
            )
    check_state_layout(
        state, [f.name for f in fields(MemoryPlan)]
    )  # every value a load reads, before any component loads its part
    return bool(saved_settings.get("micro_batch_size") == settings.get("micro_batch_size"))


def check_savable(broken: str | None, *, deferred: bool, open_window: bool) -> None:
    """Refuse to save a state after a half-done step, or an open window the backend keeps.

    After `PartialStepError` (`broken`), the weights are half-updated: saving them as a resumable
    state would hide it. Under FSDP2's `sync_policy="window"` an open window's partial sums live
    inside FSDP2 until the window's last backward.

    Raises:
        ValueError: Naming the fixes.
    """
    if broken is not None:
        raise ValueError(
            "the Accumulator state is not saved: the last optimizer step failed halfway, so the "
            f"weights are half-updated. {broken}"
        )
    if deferred and open_window:
        raise ValueError(
            "an open window under FSDP2's sync_policy='window' cannot be saved (FSDP2 holds its "
            "partial gradient sums until the last backward); save at a window boundary, or "
            "build the Accumulator with sync_policy='micro'."
        )


def _short(value: object) -> str:
    """`repr(value)` for a message of one line: a multi-line or long repr gives way to the type.

    An optimizer's or a model's repr spans many lines (every param group, every layer).
    """
    text = repr(value)
    return text if "\n" not in text and len(text) <= 80 else f"<{type(value).__name__}>"
