"""What ranks tell each other about a window, and what they agree on (plain data).

Example:
    >>> summary = RankSummary(count=5, loss_sum=2.5, micro_batches=3, denominator=8.0)
    >>> summary.failed, WindowAgreement(count=5, loss_sum=2.5).failed_ranks
    (0, ())
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FAILED", "OUT_OF_MEMORY", "RankMismatchError", "RankSummary", "WindowAgreement"]

FAILED, OUT_OF_MEMORY = 1, 2  # RankSummary.failed: why a rank's window failed


class RankMismatchError(RuntimeError):
    """Ranks ran windows that cannot be reconciled, or one failed; every rank raises it."""


@dataclass(frozen=True)
class RankSummary:
    """What one rank says about its window at the exchange.

    Attributes:
        count: Items counted by this rank.
        loss_sum: This rank's summed loss.
        micro_batches: Micro-batches this rank ran.
        denominator: The window's backward denominator (must agree across ranks).
        failed: 0, or why this rank's window failed: `FAILED` or `OUT_OF_MEMORY`.
        has_grad: Per window parameter, whether this rank holds a gradient for it.
        graph: Whether this rank's last micro-batch can run a backward.
        terms: `LossSum.terms` windows: each term's count and sum, in pairs, padded to
            `MAX_TERMS` pairs (empty otherwise).
    """

    count: int
    loss_sum: float
    micro_batches: int
    denominator: float
    failed: int = 0
    has_grad: tuple[bool, ...] = ()
    graph: bool = True
    terms: tuple[float, ...] = ()


@dataclass(frozen=True)
class WindowAgreement:
    """The window over all ranks: summed count and loss, and what every rank must do next.

    Attributes:
        count: Items counted over all ranks.
        loss_sum: Summed loss over all ranks.
        denominator: The largest of the ranks' backward denominators (powers of two when they
            differ): every rank rescales its gradients to it before they are summed.
        failed_ranks: Ranks that raised inside the window (the window is then forgotten).
        all_out_of_memory: Every failed rank ran out of memory (all of them rerun smaller).
        has_grad: Per window parameter, whether any rank holds a gradient for it.
        all_graphs: Every rank's last micro-batch can run a backward.
        terms: Each term's count and sum over all ranks, in pairs (`RankSummary.terms`).
    """

    count: int
    loss_sum: float
    denominator: float = 1.0
    failed_ranks: tuple[int, ...] = ()
    all_out_of_memory: bool = False
    has_grad: tuple[bool, ...] = ()
    all_graphs: bool = True
    terms: tuple[float, ...] = ()

    def term_totals(self) -> tuple[list[float], list[float]]:
        """The terms' global counts and sums, as two lists."""
        return list(self.terms[0::2]), list(self.terms[1::2])

    def failure(self) -> BaseException:
        """What a rank raises when another rank's window failed (out of memory: rerun)."""
        ranks = ", ".join(str(rank) for rank in self.failed_ranks)
        if self.all_out_of_memory:
            return torch.OutOfMemoryError(
                f"rank {ranks} ran out of memory in this window; every rank reruns it smaller."
            )
        return RankMismatchError(
            f"rank {ranks} raised inside this accumulation window (see its own traceback); the "
            "window was discarded on every rank, and nothing was stepped."
        )
