"""The ledger of a window whose loss has several terms (`LossSum.terms`).

The objective is `sum_t weight_t * S_t / D_t`, where `S_t` is the term's sum over the window
and `D_t` its window count (over every micro-batch and rank), or a constant. A backward can only
divide by a number it knows, and a window learns its counts at its end. So:

- terms whose `D_t` is known when the window opens (a constant denominator, `normalize="sum"`,
  or a count the loss gave ahead) go into ONE backward, each divided by its final `D_t`;
- each other term gets its own gradient, divided by a provisional power of two `c_t`, and is
  multiplied by `c_t / D_t` at the boundary. The first such term rides the main backward when no
  term is known; every further one costs one more pass (`torch.autograd.grad`, the graph kept)
  and one gradient buffer. Exactness has that price only when the counts are not given ahead.

Example:
    >>> import torch
    >>> from gradaccum.loss import ReadTerm
    >>> from gradaccum.options import Normalize
    >>> terms = [ReadTerm("ce", torch.tensor(6.0), 1.0, 3, None),
    ...          ReadTerm("aux", torch.tensor(1.0), 0.5, 0, 4.0)]
    >>> ledger = TermLedger(terms, Normalize.MEAN, expected_micro_batches=2, ahead=None)
    >>> ledger.extra, ledger.main_is_known
    ((0,), True)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gradaccum._agreement import WindowAgreement
from gradaccum._tensor_parallel import loss_parallel_context
from gradaccum.divisor import Expectation, backward_denominator, scaled_loss
from gradaccum.loss import MAX_TERMS, ReadTerm
from gradaccum.options import Normalize
from gradaccum.precision import PrecisionRuntime
from gradaccum.sync import GradSync

__all__ = ["TermLedger"]


class TermLedger:
    """Per-term counts, sums, denominators and gradient buffers of one window.

    Args:
        first: The window's first micro-batch's terms (they fix names and denominators).
        normalize: The Accumulator's objective: "sum" divides no term by its count.
        expected_micro_batches: Micro-batches the window plans, for provisional denominators.
        ahead: Window counts per term given ahead by the loss (`items_counted`), or None.
    """

    def __init__(
        self,
        first: Sequence[ReadTerm],
        normalize: Normalize,
        *,
        expected_micro_batches: int,
        ahead: Mapping[str, float] | None,
    ) -> None:
        self.names = tuple(t.name for t in first)
        self.weights = tuple(t.weight for t in first)
        self.fixed: list[float | None] = []  # the final D_t where known at the window's start
        self.scales: list[float] = []  # what each term's backward divides by
        self.from_ahead: list[bool] = []  # D_t is a count given ahead, checked at the boundary
        for term in first:
            counted = term.denominator is None and normalize is Normalize.MEAN
            given = ahead.get(term.name) if ahead is not None and counted else None
            if term.denominator is not None:
                fixed: float | None = term.denominator
            elif not counted:
                fixed = 1.0
            else:
                fixed = float(given) if given else None
            self.fixed.append(fixed)
            self.from_ahead.append(bool(given))
            expected = math.ceil(term.count * expected_micro_batches)  # its magnitude only
            self.scales.append(
                fixed or backward_denominator(normalize, expected_items=expected, window_items=None)
            )
        unknown = [i for i, fixed in enumerate(self.fixed) if fixed is None]
        self.main_is_known = len(unknown) < len(self.names)
        main_unknown = () if self.main_is_known else tuple(unknown[:1])
        self.main = tuple(i for i in range(len(self.names)) if self.fixed[i] is not None)
        self.main += main_unknown
        self.extra = tuple(i for i in unknown if i not in main_unknown)
        self.counts = [0.0] * len(self.names)  # items, or summed weights (a weighted mean)
        self._sums: list[torch.Tensor | None] = [None] * len(self.names)  # read at the boundary
        self.buffers: dict[int, list[torch.Tensor | None]] = {}

    @classmethod
    def for_micro_batch(
        cls,
        ledger: TermLedger | None,
        terms: Sequence[ReadTerm],
        normalize: Normalize,
        expect: Expectation,
        *,
        fsdp: bool = False,
        sync: GradSync | None = None,
    ) -> TermLedger:
        """The window's ledger: `ledger`, checked against `terms`, or a new one from them.

        Raises:
            ValueError: Under FSDP2 (`fsdp`), which does not support terms yet, or for terms
                needing their own pass where the backend averages every backward (`sync`).
        """
        if fsdp:
            raise ValueError(
                "LossSum.terms is not supported with FSDP2 yet (each term would need its own "
                "reduce-scatter); return one LossSum, or use DDP."
            )
        if ledger is None:
            ahead = expect.counted if isinstance(expect.counted, dict) else None
            ledger = cls(terms, normalize, expected_micro_batches=expect.micro_batches, ahead=ahead)
            if ledger.extra and sync is not None and sync.averaged_over > 1:
                raise ValueError(  # DDP's hooks and sink also fire in the extra pass: garbled
                    "LossSum.terms whose counts the window learns at its end need one gradient "
                    "pass per term, which the first window of a DistributedDataParallel("
                    "static_graph=True) model cannot run (DDP reduces every backward in it; the "
                    "ranks' gradients diverged). Wrap with static_graph=False, or start with one "
                    "window of a single LossSum. Nothing was changed."
                )
            return ledger
        ledger.check(terms)
        return ledger

    # ------------------------------------------------------------------ micro-batches

    def roots(
        self, terms: Sequence[ReadTerm]
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """Count one micro-batch; return its roots.

        They are the main root (the logged total when no main term has a graph), the logged
        weighted total (detached) and the extra terms' roots.
        """
        main = self.main_root(terms)
        logged = self.add(terms)
        return (logged if main is None else main), logged, self.extra_roots(terms)

    def backward_extra(
        self,
        extra: Sequence[tuple[int, torch.Tensor]],
        params: Sequence[torch.Tensor],
        loss_scale: float,
        runtime: PrecisionRuntime,
    ) -> None:
        """Each extra term's gradient into its buffer, the graph kept for the main backward."""
        for index, root in extra:
            scaled = scaled_loss(root, 1, 1.0, loss_scale)
            with loss_parallel_context([scaled]):  # a term computed in loss_parallel()
                grads = torch.autograd.grad(scaled, params, retain_graph=True, allow_unused=True)
            self.absorb(index, [runtime.widened(g) for g in grads])

    def check(self, terms: Sequence[ReadTerm]) -> None:
        """Raise ValueError if a later micro-batch's terms differ from the first's."""
        names = tuple(t.name for t in terms)
        if names != self.names:
            raise ValueError(
                f"this micro-batch's loss has terms {list(names)}, the window's first had "
                f"{list(self.names)}; return the same terms, in the same order, every time. A "
                "term with no item in a micro-batch is still returned, counting 0: e.g. "
                "Term(aux[mask].sum(), count=mask.sum()), or Term(torch.zeros(()), count=0)."
            )
        for term, fixed in zip(terms, self.fixed, strict=True):
            if term.denominator is not None and term.denominator != fixed:
                raise ValueError(
                    f"term {term.name!r} changed its denominator from {fixed} to "
                    f"{term.denominator} inside one window; keep a constant denominator constant."
                )

    def main_root(self, terms: Sequence[ReadTerm]) -> torch.Tensor | None:
        """The main backward's loss: the known terms (or the first unknown one), scaled."""
        parts = [self._scaled(terms, i) for i in self.main if terms[i].value.requires_grad]
        return sum(parts[1:], parts[0]) if parts else None

    def extra_roots(self, terms: Sequence[ReadTerm]) -> list[tuple[int, torch.Tensor]]:
        """The terms that need a gradient of their own, scaled by their provisional `c_t`."""
        return [(i, self._scaled(terms, i)) for i in self.extra if terms[i].value.requires_grad]

    def absorb(self, index: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one extra term's gradient (one entry per window parameter) to its buffer."""
        buffer = self.buffers.setdefault(index, [None] * len(grads))
        for position, grad in enumerate(grads):
            if grad is None:
                continue
            held = buffer[position]
            buffer[position] = grad.detach().clone() if held is None else held.add_(grad)

    def add(self, terms: Sequence[ReadTerm]) -> torch.Tensor:
        """Count one micro-batch; return its weighted summed loss, detached (for finiteness)."""
        values = []
        for index, term in enumerate(terms):
            self.counts[index] += term.count
            value = term.value.detach()
            held = self._sums[index]
            if held is None:
                dtype = torch.promote_types(value.dtype, torch.float32)
                self._sums[index] = value.to(dtype).clone()
            else:
                held.add_(value)
            values.append(value * term.weight)
        total: torch.Tensor = sum(values[1:], values[0])
        return total

    @property
    def sums(self) -> list[float]:
        """Each term's summed value so far (one device read per term)."""
        return [0.0 if total is None else float(total) for total in self._sums]

    def budget(self, term: str | None) -> int:
        """The window's count so far of `term`, the one a `Tokens` budget counts.

        Raises:
            ValueError: If `term` is None or not a term of this loss (before any backward).
        """
        if term not in self.names:
            raise ValueError(
                f"Tokens(..., term={term!r}): a LossSum.terms loss counts each term apart, so a "
                "Tokens window must name the term whose count fills it (its rows would be "
                f"another budget): one of {list(self.names)}, e.g. Tokens(65536, "
                f"term={self.names[0]!r})."
            )
        return math.ceil(self.counts[self.names.index(term)])

    def pending_objective(self) -> Callable[[], float]:
        """A reader of this rank's objective so far, each term over its own count so far.

        Later micro-batches do not change what it reads; it reads the device only when called.
        It holds a copy of the ledger without its gradient buffers: a result kept for logging
        must not keep them alive.
        """
        reader = copy.copy(self)  # names, weights and denominators: small and never changed
        reader.buffers, reader._sums, counts = {}, [], list(self.counts)
        sums = [None if t is None else t.clone() for t in self._sums]
        return lambda: reader.objective(
            reader.means(counts, [0.0 if t is None else float(t) for t in sums])
        )

    def summary(self) -> tuple[float, ...]:
        """This rank's counts and sums, padded to `MAX_TERMS` pairs for the exchange."""
        flat: list[float] = []
        for count, total in zip(self.counts, self.sums, strict=True):
            flat += [float(count), total]
        return tuple(flat + [0.0] * (2 * MAX_TERMS - len(flat)))

    def has_gradient(self, position: int) -> bool:
        """Whether an extra term's buffer holds a gradient for window parameter `position`."""
        return any(buffer[position] is not None for buffer in self.buffers.values())

    # ------------------------------------------------------------------ the boundary

    def totals(self, agreement: WindowAgreement) -> tuple[list[float], list[float]]:
        """Each term's count and sum over the window and every rank."""
        if agreement.terms:
            counts, sums = agreement.term_totals()
        else:  # one process: the agreement carries no term
            counts, sums = [float(c) for c in self.counts], self.sums
        return counts[: len(self.names)], sums[: len(self.names)]

    def global_counts(self, agreement: WindowAgreement) -> list[float]:
        """Each term's count over the window and every rank (checked against any given ahead)."""
        counts = self.totals(agreement)[0]
        self.check_ahead(counts)
        return counts

    def report(self, agreement: WindowAgreement) -> tuple[dict[str, float], float]:
        """Each term's window mean over every rank, and the objective."""
        means = self.means(*self.totals(agreement))
        return means, self.objective(means)

    def denominators(self, global_counts: Sequence[float]) -> list[float]:
        """Each term's `D_t`: its fixed denominator, else its count over the window and ranks."""
        return [
            fixed if fixed is not None else float(count)
            for fixed, count in zip(self.fixed, global_counts, strict=True)
        ]

    def check_ahead(self, global_counts: Sequence[float]) -> None:
        """Raise ValueError if a count given ahead is not what the loss then counted."""
        for name, fixed, count, given in zip(
            self.names, self.fixed, global_counts, self.from_ahead, strict=True
        ):
            if given and fixed != count:
                raise ValueError(
                    f"items_counted said term {name!r} counts {fixed:g} items in this window, "
                    f"but the loss counted {count:g}; make items_counted agree with the loss. "
                    "The window was discarded."
                )

    def combine(
        self, position: int, grad: torch.Tensor | None, global_counts: Sequence[float]
    ) -> torch.Tensor | None:
        """The objective's gradient for window parameter `position`.

        It is made from the main gradient `grad` (scaled in place) and the extra terms' buffers.
        """
        denominators = self.denominators(global_counts)
        if grad is not None and not self.main_is_known:
            only = self.main[0]
            grad.mul_(_ratio(self.scales[only], denominators[only]))
        for index in self.extra:
            part = self.buffers.get(index, [None] * (position + 1))[position]
            if part is None:
                continue
            factor = _ratio(self.scales[index], denominators[index])
            grad = part.mul_(factor) if grad is None else grad.add_(part, alpha=factor)
        return grad

    def means(
        self, global_counts: Sequence[float], global_sums: Sequence[float]
    ) -> dict[str, float]:
        """Each term's window mean, `S_t / D_t` (0.0 for a term that counted nothing)."""
        denominators = self.denominators(global_counts)
        return {
            name: (total / d if d else 0.0)
            for name, total, d in zip(self.names, global_sums, denominators, strict=True)
        }

    def objective(self, means: Mapping[str, float]) -> float:
        """`sum_t weight_t * mean_t`."""
        return math.fsum(w * means[n] for n, w in zip(self.names, self.weights, strict=True))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Plain data: names, weights, denominators, counts, sums and buffers."""
        return {
            "names": list(self.names),
            "weights": list(self.weights),
            "fixed": list(self.fixed),
            "from_ahead": list(self.from_ahead),
            "scales": list(self.scales),
            "main": list(self.main),
            "extra": list(self.extra),
            "counts": list(self.counts),
            "sums": [None if t is None else t.detach().clone() for t in self._sums],
            "buffers": {
                str(i): [None if g is None else g.detach().clone() for g in b]
                for i, b in self.buffers.items()
            },
        }

    @staticmethod
    def valid_state(state: object) -> bool:
        """Whether `state` has the layout `state_dict()` writes (checked before any load)."""
        keys = ("names", "weights", "fixed", "from_ahead", "scales", "main", "extra")
        if not isinstance(state, Mapping) or not isinstance(state.get("buffers"), Mapping):
            return False
        lists = [state.get(key) for key in (*keys, "counts", "sums")]
        if not all(isinstance(value, list) for value in lists):
            return False
        width = len(state["names"])
        widths = ("weights", "fixed", "from_ahead", "scales", "counts", "sums")
        if not all(len(state[key]) == width for key in widths):
            return False
        buffers = state["buffers"].values()
        tensors = [*state["sums"], *(g for b in buffers if isinstance(b, list) for g in b)]
        return all(isinstance(b, list) for b in buffers) and all(
            t is None or isinstance(t, torch.Tensor) for t in tensors
        )

    @classmethod
    def from_state(cls, state: Mapping[str, Any], device: torch.device) -> TermLedger:
        """Rebuild a ledger from `state_dict()` output."""
        ledger = cls.__new__(cls)
        ledger.names = tuple(state["names"])
        ledger.weights = tuple(float(w) for w in state["weights"])
        ledger.fixed = [None if f is None else float(f) for f in state["fixed"]]
        ledger.from_ahead = [bool(f) for f in state["from_ahead"]]
        ledger.scales = [float(s) for s in state["scales"]]
        ledger.main = tuple(int(i) for i in state["main"])
        ledger.extra = tuple(int(i) for i in state["extra"])
        ledger.main_is_known = all(ledger.fixed[i] is not None for i in ledger.main)
        ledger.counts = [float(c) for c in state["counts"]]
        ledger._sums = [None if t is None else t.to(device).clone() for t in state["sums"]]
        ledger.buffers = {
            int(i): [None if g is None else g.to(device).clone() for g in b]
            for i, b in state["buffers"].items()
        }
        return ledger

    # ------------------------------------------------------------------ helpers

    def _scaled(self, terms: Sequence[ReadTerm], index: int) -> torch.Tensor:
        factor = self.weights[index] / self.scales[index]
        return terms[index].value * factor if factor != 1.0 else terms[index].value


def _ratio(scale: float, denominator: float) -> float:
    """`c_t / D_t`; 0 for a term that counted nothing (a mean over no item adds nothing)."""
    return scale / denominator if denominator else 0.0
