"""What ranks tell each other about a window, and what they agree on (plain data).

Example:
    >>> summary = RankSummary(count=5, loss_sum=2.5, micro_batches=3, denominator=8.0)
    >>> summary.failed, WindowAgreement(count=5, loss_sum=2.5).failed_ranks
    (0, ())
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "FAILED",
    "OUT_OF_MEMORY",
    "RankMismatchError",
    "RankSummary",
    "WindowAgreement",
    "check_flushing_alike",
    "check_terms_alike",
    "check_windows_alike",
    "terms_signature",
]

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
        term_names: The terms' names, in order (empty without terms).
        term_weights: Their weights, in the same order.
    """

    count: int
    loss_sum: float
    micro_batches: int
    denominator: float
    failed: int = 0
    has_grad: tuple[bool, ...] = ()
    graph: bool = True
    terms: tuple[float, ...] = ()
    term_names: tuple[str, ...] = ()
    term_weights: tuple[float, ...] = ()

    @property
    def signature(self) -> float:
        """`terms_signature` of this window's terms; 0 for a window without terms."""
        return terms_signature(self.term_names, self.term_weights) if self.term_names else 0.0


def terms_signature(names: Sequence[str], weights: Sequence[float]) -> float:
    """A number naming a `LossSum.terms` window's terms, in order, with their weights.

    Ranks sum the terms' counts and sums position by position, so they must agree on what each
    position is; exact in float64 (a CRC-32 plus one, so never the 0 of a window without terms).
    """
    return float(zlib.crc32(repr((tuple(names), tuple(weights))).encode()) + 1)


def check_terms_alike(
    micro_batches: Sequence[float], signatures: Sequence[float], names: Sequence[str]
) -> None:
    """Raise on every rank if the ranks that ran micro-batches returned different terms.

    Before, the terms' counts and sums were added position by position whatever each rank
    named them: terms in another order, or a term missing on one rank, gave a silently wrong
    step (the ranks still agreed with each other).

    Args:
        micro_batches: Each rank's micro-batches (a rank that ran none has no terms to match).
        signatures: Each rank's `terms_signature` (0: its loss had no terms).
        names: This rank's term names, for the message.

    Raises:
        RankMismatchError: If they differ.
    """
    running = [
        (r, sig)
        for r, (sig, runs) in enumerate(zip(signatures, micro_batches, strict=True))
        if runs > 0
    ]
    odd = [r for r, sig in running if sig != running[0][1]]
    if not odd:
        return
    raise RankMismatchError(
        f"rank {', '.join(map(str, odd))} returned other LossSum.terms than the first rank to "
        f"run a micro-batch (names, order or weights; this rank's: {list(names) or 'no terms'}), "
        "whose counts and sums are added position by position over ranks. Return the same "
        "terms, in the same order and with the same weights, on every rank; a term a rank has "
        "nothing for this window goes in with count 0 (e.g. aux=Term(loss.new_zeros(()), "
        "count=0)). The window was discarded on every rank, and nothing was stepped."
    )


def check_windows_alike(table: torch.Tensor, *, uneven: bool, rescales: bool) -> None:
    """Raise unless ranks ran windows this backend can reconcile.

    Micro-batch counts may differ where `uneven_windows()`. Backward denominators must be
    equal, except that DDP rescales powers of two to the largest before it reduces; FSDP2
    reduces inside the backward, so its ranks must have scaled alike.
    """
    counts, denominators = set(table[:, 2].tolist()), set(table[:, 3].tolist())
    if len(denominators) == 1 and (uneven or len(counts) == 1):
        return
    if uneven and rescales and all(math.frexp(d)[0] == 0.5 for d in denominators):
        return
    listing = "; ".join(
        f"rank {rank}: {int(row[2])} micro-batches, gradient denominator {row[3].item():g}"
        for rank, row in enumerate(table)
    )
    raise RankMismatchError(
        f"ranks ran accumulation windows this backend cannot reconcile ({listing}). Give "
        "every rank first micro-batches of the same size in micro_step() (step() agrees "
        "by itself), or drop the uneven remainder (e.g. DistributedSampler(drop_last=True))."
    )


def check_flushing_alike(flushing: torch.Tensor) -> None:
    """Raise on every rank if some ranks' data ended (`flush()`) while others closed a full window.

    Raises:
        RankMismatchError: Naming the ranks at `flush()`.
    """
    if 0 < int(flushing.sum().item()) < len(flushing):
        ranks = ", ".join(str(rank) for rank in torch.nonzero(flushing).flatten().tolist())
        raise RankMismatchError(
            f"rank {ranks} called flush() (its data ended) while the other ranks closed a full "
            "window and have more: the ranks hold different numbers of micro-batches. The "
            "window was discarded on every rank. Give every rank the same number of "
            "micro_step() calls per epoch (DistributedSampler pads its shards unless "
            "drop_last=True), or use step(), whose ranks may hold different numbers of items."
        )


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
