"""A `micro_step()` micro-batch of no item on one DDP rank: it counts nothing; the window goes on.

A rank whose loader runs dry mid-window (a length-grouped or custom sampler's uneven shards, a
last partial micro-batch empty on one rank only) held a micro-batch of 0 rows: it was refused
on that rank ("the batch is empty"), and every rank discarded the window (`RankMismatchError`
on the others), although `step()` takes a rank with no item. Under DDP the window's gradients
are reduced once, by hand, at its boundary, so such a rank needs no forward: the micro-batch
is counted as one of the window's, with no item and no loss, and the step is the full-batch
step over the items the ranks did hold. A static graph's first window (DDP reduces in every
backward), FSDP2 (every forward is a collective) and one process still refuse it.

Example:
    >>> import torch
    >>> from gradaccum.sync import LocalSync
    >>> rank_items(torch.zeros(0, 3), 0, LocalSync(), fsdp=False)
    Traceback (most recent call last):
    ...
    ValueError: the batch is empty (0 items along the batch dimension); add items.
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.batching import batch_size
from gradaccum.divisor import Expectation
from gradaccum.sync import GradSync
from gradaccum.window import Window

__all__ = ["count_nothing", "rank_items"]


def rank_items(micro_batch: Any, batch_dim: int, sync: GradSync, *, fsdp: bool) -> int:
    """The micro-batch's items: 0 allowed on a DDP rank whose windows may be uneven.

    Raises:
        ValueError: For an empty micro-batch elsewhere, or one that has no items dimension.
    """
    empty = sync.world > 1 and not fsdp and getattr(sync, "uneven_windows", bool)()
    return batch_size(micro_batch, batch_dim=batch_dim, allow_empty=empty)


def count_nothing(window: Window, sync: GradSync, last: bool, expect: Expectation) -> bool:
    """Count an empty micro-batch in `window` (no forward, no backward); whether it is the last.

    A `Tokens` window sums the ranks' counts after every micro-batch: this rank joins that sum.
    A window empty on this rank until its end takes 1 as its backward denominator (it holds no
    gradient; the boundary rescales the others' to the largest).
    """
    window.add(torch.zeros((), dtype=torch.float64), 0, 0, 0)
    if expect.until is not None:
        last = sync.sum_of_counts(window.budget(0, expect.until_term)) >= expect.until
    if last and window.denominator is None:
        window.denominator = 1.0
    return last
