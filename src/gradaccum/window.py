"""The window: what one accumulation window holds between its first micro-batch and its boundary.

A `Window` is bookkeeping only: running totals (items, micro-batches, loss sum, largest
micro-batch, the `denominator` and `loss_scale` of every backward: `gradaccum.divisor`); the
parameters it fills, fixed when it opens (the optimizer's, in order, then the model's other
trainable ones); gradients set aside for a failed window; marks of every gradient and weight after
each backward (a `zero_grad()`, a write: `_written`). `accumulate_grad` is the engine's
functional form: the exact full-batch gradient, no step (its example is in its docstring); a
learnable weight the loss holds outside the model is divided with the parameters
(`_loss_leaves`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch

from gradaccum._batch_sizes import check_batch_dim
from gradaccum._dtensor import like_param
from gradaccum._forward_state import ForwardState
from gradaccum._joined import JoinWatch
from gradaccum._layout_watch import SequenceFirstCheck
from gradaccum._loss_call import call_loss_fn, freed_graph_hint, refuse_grad_disabled
from gradaccum._loss_leaves import OutsideLeaves
from gradaccum._outcome import Outcome
from gradaccum._outputs import backward
from gradaccum._parameters import trainable_parameters
from gradaccum._state_layout import check_tensors_fit
from gradaccum._step_refusal import steps_refused
from gradaccum._terms import TermLedger
from gradaccum._window_registry import gradients_changed_error
from gradaccum._written import WeightMarks, kept_weights, weight_marks, written_error
from gradaccum.batching import batch_size, split_batch, to_device
from gradaccum.divisor import backward_denominator, divide_, folds_counts, grad_divisor, seeded_loss
from gradaccum.loss import (
    LossSum,
    LossTerms,
    TokenMeanCheck,
    backward_inside_error,
    counted_ahead,
    read_loss,
)
from gradaccum.options import Normalize, parse

__all__ = ["LossFn", "Outcome", "Window", "accumulate_grad"]

_GRAD, _NONES = operator.attrgetter("grad"), itertools.repeat(None)

LossFn = Callable[[torch.nn.Module, Any], "torch.Tensor | LossSum"]


class Window:
    """Totals, parameters and set-aside gradients of one accumulation window."""

    def __init__(
        self, optimizer: torch.optim.Optimizer | None = None, model: torch.nn.Module | None = None
    ) -> None:
        self.joins = JoinWatch(optimizer, model)  # the optimizer's parameters unfrozen mid-window
        self.params: list[torch.nn.Parameter] = []
        self.held = 0  # the first `held` params are the optimizer's
        self.running = False  # a micro-batch's loss_fn and backward run (`_commit.steps_refused`)
        self._close()

    def _close(self) -> None:
        self.committing = False  # set by `_commit.step_optimizer` around the window's own step
        self.count = self.micro_batches = 0
        self.saved = False  # its state was saved since its last micro-batch (`_open_window`)
        # The summed loss: a Python float for CPU losses, where reading a scalar costs less than
        # a tensor add; a device tensor elsewhere, where a read would wait for the device.
        self.loss_host = 0.0
        self.loss_sum: torch.Tensor | None = None
        self.largest_micro_batch = 0
        self.denominator: float | None = None  # fixed by the first micro-batch
        self.terms: TermLedger | None = None  # LossSum.terms windows only
        self.loss_scale = 1.0
        self._stashed: list[torch.Tensor | None] = []
        self._marks: list[tuple[torch.Tensor | None, int]] = []
        self._watched: tuple[torch.nn.Parameter, torch.Tensor | None, int] | None = None
        self._weights: WeightMarks | None = None  # the weights at the last mark (`_written`)

    def __getstate__(self) -> dict[str, Any]:
        """For `copy.deepcopy` and pickle: the state, with the open window's gradients.

        A copied Parameter loses its `.grad`, where an open window's sums live (a `zero_grad()`).
        """
        state = dict(self.__dict__)
        state["_grads"] = [p.grad for p in self.params]
        # Which marks still match their gradient: copies restart version counters at 0.
        state["_fresh"] = [g is None or g._version == v for g, v in self._marks]
        watched = self._watched
        state["_watched_fresh"] = (
            watched is not None
            and watched[0].grad is watched[1]
            and (watched[1] is None or watched[1]._version == watched[2])
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore `__getstate__` output: the gradients back on the (copied) parameters."""
        grads, fresh = state.pop("_grads"), state.pop("_fresh")
        watched_fresh = state.pop("_watched_fresh")
        self.__dict__.update(state)
        self._weights = None  # copies have other storages and counters
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad
        # A mark that matched before the copy matches after it; one that did not still does not.
        self._marks = [
            (g, (-1 if g is None else g._version) if ok else -2)
            for (g, _), ok in zip(self._marks, fresh, strict=True)
        ]
        if self._watched is not None:
            param, grad, _ = self._watched
            version = -1 if grad is None else grad._version
            self._watched = (param, grad, version if watched_fresh else -2)

    @property
    def is_open(self) -> bool:
        """Whether a micro-batch ran since the window opened."""
        return self.micro_batches > 0

    def open(self, params: list[torch.nn.Parameter], held: int, loss_scale: float) -> None:
        """Start a window: set the parameters' current gradients aside."""
        self.params, self.held, self.loss_scale = params, held, loss_scale
        self.joins.open(params[:held])
        self._stashed = list(map(_GRAD, params))  # most hold none: no Python step for those
        for param in itertools.compress(params, map(operator.is_not, self._stashed, _NONES)):
            param.grad = None

    def add(self, value: torch.Tensor, weight: int, count: int, items: int) -> None:
        """Count one micro-batch after its backward; its loss is read (CPU) or added on its device.

        It also remembers one gradient, for `check_no_backward_inside`.
        """
        watched = self._watched  # a parameter the model uses, if any got a gradient
        if watched is None:
            param = next((p for p in self.params if p.grad is not None), self.params[0])
        else:
            param = watched[0]
        grad = param.grad
        self._watched = (param, grad, -1 if grad is None else grad._version)
        if value.is_cpu:
            self.loss_host += value.item() * weight  # float64: no rounding to the loss's dtype
        else:
            if self.loss_sum is None:
                # The loss's own dtype (at least float32): a mixed-dtype add costs ~10x more.
                dtype = torch.promote_types(value.dtype, torch.float32)
                self.loss_sum = torch.zeros((), dtype=dtype, device=value.device)
            self.loss_sum.add_(value.data, alpha=weight)  # `.data`: detached, not dispatched
        self.count += count
        self.micro_batches, self.saved = self.micro_batches + 1, False  # unsaved progress
        self.largest_micro_batch = max(self.largest_micro_batch, items)

    def loss_total(self) -> float:
        """The summed loss so far as a float (0.0 before any micro-batch)."""
        on_device = 0.0 if self.loss_sum is None else float(self.loss_sum)
        return self.loss_host + on_device

    def check_no_backward_inside(self) -> None:
        """Raise if a gradient changed since the window's last backward: `loss_fn` ran its own.

        Called between a `loss_fn` and the window's backward of its loss, once per micro-batch:
        the first looks at every parameter (all were cleared when the window opened), the
        others at the one gradient `add` remembered.

        Raises:
            ValueError: Naming the fix (remove the `.backward()` from `loss_fn`).
        """
        if (watched := self._watched) is None:
            held = map(operator.is_not, map(_GRAD, self.params), _NONES)  # C-level: no frames
            touched = self.micro_batches == 0 and any(held)
        else:
            param, grad, version = watched
            touched = param.grad is not grad or (grad is not None and grad._version != version)
        if touched:
            raise backward_inside_error()

    def mark_gradients(self, *, weights: bool = True) -> None:
        """Remember each gradient (and weight) after a backward, to catch changes until the next."""
        self._marks = [(p.grad, -1 if p.grad is None else p.grad._version) for p in self.params]
        self._weights = weight_marks(self.params[: self.held], self._weights) if weights else None

    def carry(self) -> None:
        """An open window is carried: keep its weights' values (an evaluation: `_written`)."""
        self._weights = kept_weights(self._weights, self.params[: self.held])  # closed: None

    def touched_gradients(self) -> list[int]:
        """Indices of params whose gradient changed since the last mark (a user's `zero_grad`)."""
        return [
            index
            for index, (param, (grad, version)) in enumerate(
                zip(self.params, self._marks, strict=True)
            )
            if grad is not None and (param.grad is not grad or grad._version != version)
        ]

    def touched_gradients_error(self, names: dict[int, str], final: bool) -> RuntimeError | None:
        """The error for gradients (`zero_grad`) or weights changed since the last mark, if any."""
        stepped, count = self.params[: self.held], self.micro_batches
        written = written_error(stepped, self._weights, names, micro_batches=count, final=final)
        if written is not None:
            return written
        touched = self.touched_gradients()
        if not touched:
            return None
        params = [self.params[i] for i in touched]  # a zero_grad(), another backward:
        return gradients_changed_error(params, names, self)  # another window named

    def note_discarded(self, error: BaseException) -> None:
        """Add notes to `error`: the window was discarded, and a hint if the cause is known."""
        add_note = getattr(error, "add_note", None)
        if add_note is None:  # Python < 3.11
            return
        add_note(
            f"gradaccum: the open accumulation window ({self.micro_batches} micro-batches) was "
            "discarded; parameters, gradients, BatchNorm statistics and the buffers its forwards "
            "updated are as they were before it."
        )
        if isinstance(error, RuntimeError) and "graph a second time" in str(error):
            add_note(f"gradaccum: {freed_graph_hint(self.micro_batches)}")

    def budget(self, count: int, term: str | None) -> int:
        """What a `Tokens` window has counted, with a micro-batch of `count` (terms: `term`'s)."""
        return self.count + count if self.terms is None else self.terms.budget(term)

    def restore(self) -> None:
        """Forget the window: the gradients set aside come back, the totals are cleared."""
        self.joins.drop()
        for param, grad in zip(self.params, self._stashed, strict=True):
            param.grad = grad
        self._close()

    def close(self) -> None:
        """End a window whose gradients were used: clear every gradient and the totals."""
        self.joins.drop()  # done before the step already (`_commit.step_optimizer`)
        for param in self.params:
            param.grad = None
        self._close()

    def state_dict(self) -> dict[str, Any]:
        """Copies of the totals and partial gradients (plain data; a closed window saves none)."""
        if self.is_open and (refusal := self.joins.save_refusal(self.micro_batches)) is not None:
            raise refusal  # parameters joined mid-window: a resume would step them (`_joined`)
        params, self.saved = (self.params if self.is_open else []), True  # kept for a resume
        return {
            "count": self.count,
            "micro_batches": self.micro_batches,
            "loss_sum": None if self.loss_sum is None else self.loss_sum.detach().clone(),
            "loss_host": self.loss_host,
            "largest_micro_batch": self.largest_micro_batch,
            "denominator": self.denominator,
            "loss_scale": self.loss_scale,
            "param_shapes": [list(p.shape) for p in params],
            "terms": None if self.terms is None else self.terms.state_dict(),
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
        }

    def check_state(self, state: dict[str, Any], params: list[torch.nn.Parameter]) -> None:
        """Raise ValueError if a saved window does not fit `params`; change nothing."""
        shapes = [list(p.shape) for p in params]
        saved = state.get("param_shapes")
        if state.get("micro_batches") and saved != shapes:
            raise ValueError(
                f"the saved Accumulator window holds gradients of {len(saved or [])} parameters "
                f"with shapes {saved}, this model and optimizer have {len(shapes)} with shapes "
                f"{shapes}; load it into the same model and optimizer, with the parameters "
                "that require grad and the param groups as at the save."
            )
        if state.get("micro_batches"):
            check_tensors_fit(state["grads"], params, "window's gradients")
        terms = state.get("terms")
        if terms is not None and not TermLedger.valid_state(terms):
            raise ValueError(
                "the saved Accumulator window has a damaged LossSum.terms ledger; save it again "
                "with Accumulator.state_dict()."
            )

    def load_state_dict(
        self, state: dict[str, Any], params: list[torch.nn.Parameter], held: int
    ) -> None:
        """Restore `state_dict()` output into a window over `params` (call `check_state` first)."""
        if self.is_open:  # its own window is forgotten: the gradients set aside come back
            self.restore()  # (and it closes), or a later forgotten window would bring its sums
        self._close()
        self.params, self.held, self.saved = params, held, True  # a loaded window is in a file
        if not state["micro_batches"]:
            return
        self.count = int(state["count"])
        self.micro_batches = int(state["micro_batches"])
        loss_sum = state["loss_sum"]
        # Cloned: the window adds into loss_sum in place, which must not reach the caller's state.
        self.loss_sum = None if loss_sum is None else loss_sum.to(params[0].device).clone()
        self.loss_host = float(state.get("loss_host", 0.0))  # absent from older states
        self.largest_micro_batch = int(state["largest_micro_batch"])
        self.denominator = state["denominator"]
        self.loss_scale = float(state["loss_scale"])
        terms = state.get("terms")
        self.terms = None if terms is None else TermLedger.from_state(terms, params[0].device)
        self._stashed = [None] * len(params)
        self.joins.open(params[:held])
        for param, grad in zip(params, state["grads"], strict=True):
            param.grad = None if grad is None else like_param(grad, param).clone()
        self.mark_gradients(weights=False)  # load_checkpoint loads the weights after it


def accumulate_grad(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    normalize: Normalize | str = "mean",
    *,
    batch_dim: int = 0,
) -> LossSum:
    """Fill every `.grad` with the exact full-batch gradient, computed micro-batch by micro-batch.

    Existing gradients are replaced; no optimizer step. On error the previous gradients and the
    buffers the forwards updated (BatchNorm statistics) are put back. Sums are in each parameter's
    dtype: bf16/fp16 weights round per micro-batch (`Accumulator(accum_dtype=...)` sums in fp32).

    Args:
        model: The model.
        batch: The whole batch (a tensor or nesting of them sharing the leading dimension).
        loss_fn: `loss_fn(model, micro_batch) -> Tensor | LossSum`.
        micro_batch_size: Items per micro-batch.
        normalize: `"mean"` for `sum(value) / sum(count)`, `"sum"` for `sum(value)`.
        batch_dim: The items' dimension of every tensor in the batch, as for
            `Accumulator(batch_dim=...)`: 0, or 1 for sequence-first `(S, B, ...)` batches.

    Returns:
        `LossSum(value, count)`: the detached summed loss and the total count. With `"mean"`,
        the objective is `value / count`.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> loss = lambda m, x: m(x).pow(2).mean()
        >>> result = accumulate_grad(model, torch.randn(5, 2), loss, micro_batch_size=2)
        >>> model.weight.grad.shape, result.count
        (torch.Size([1, 2]), 5)
    """
    objective = parse(Normalize, normalize, "normalize")
    refuse_grad_disabled("accumulate_grad()")  # before any loss_fn runs
    batch_dim = check_batch_dim(batch_dim)  # the Accumulator's check and message
    micro_batches = split_batch(batch, micro_batch_size, batch_dim=batch_dim)
    total_items = batch_size(batch, batch_dim=batch_dim)
    ahead = counted_ahead(loss_fn, micro_batches)
    counted = ahead if isinstance(ahead, int) else None
    params = trainable_parameters(model)
    device = params[0].device
    window = Window()
    window.open(params, len(params), loss_scale=1.0)
    token_mean, layout = TokenMeanCheck(model), SequenceFirstCheck(model, batch_dim, carried=False)
    forward = ForwardState(model)  # put back on failure, as the note says (BatchNorm statistics)
    outside = OutsideLeaves(params, batch)  # a learnable loss weight: replaced, divided, put back
    try:
        with steps_refused(window):  # an optimizer stepped in the backward
            for micro_batch in micro_batches:
                items = batch_size(micro_batch, batch_dim=batch_dim)
                with layout.watch(items, total_items):  # a sequence-first RNN cut in time: warns
                    result = call_loss_fn(loss_fn, model, to_device(micro_batch, device))
                window.check_no_backward_inside()
                if isinstance(result, LossTerms):
                    raise ValueError(
                        "accumulate_grad takes a loss with one denominator; a LossSum.terms loss "
                        "divides each term by its own window count: use Accumulator.step."
                    )
                value, weight, count = read_loss(result, items, needs_graph=True)
                token_mean.check(result, micro_batch, items, len(micro_batches), loss_fn)
                if window.denominator is None:
                    # A count known up front (a mean's items, or counted ahead): in each backward
                    folded = (total_items if weight > 1 else counted) or None
                    folded = folded if folds_counts(value.dtype) else None  # bf16: exact seeds
                    window.denominator = backward_denominator(
                        objective, expected_items=count * len(micro_batches), window_items=folded
                    )
                if value.requires_grad:
                    outside.take(value)
                    root, seed = seeded_loss(value, weight, window.denominator)
                    backward([root], None if seed is None else [seed])
                window.add(value, weight, count, items)
    except BaseException as error:
        window.note_discarded(error)
        window.restore()
        forward.restore()
        outside.restore()
        raise
    if window.count > 0 or objective is Normalize.SUM:
        assert window.denominator is not None  # split_batch guarantees a micro-batch
        divisor = grad_divisor(window.count, objective, window.denominator)
        divide_([p.grad for p in params if p.grad is not None] + outside.grads(), divisor)
    dtype = torch.promote_types(value.dtype, torch.float32)  # the loss's, as the window summed it
    total = torch.tensor(window.loss_total(), dtype=dtype, device=value.device)
    return LossSum(total, window.count)
