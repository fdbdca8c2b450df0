"""A plain-scalar loss on a batch whose integer targets hold -100: a token mean read by rows.

A scalar loss is read as a mean over the micro-batch's rows. Targets holding -100 (the
`ignore_index` of `torch.nn.functional.cross_entropy` and the Hugging Face convention for
unscored positions) mean the scalar is a mean over the targets that count, and weighting it by
rows is not the full-batch mean. `TokenMeanCheck` looks at the first few micro-batches and warns
once.

Example:
    >>> import torch, warnings
    >>> batch = (torch.randn(2, 3), torch.tensor([1, -100]))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_if_token_mean(batch)
    True
    >>> caught[0].category.__name__
    'TokenMeanWarning'
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from gradaccum._batch_ratio import batch_ratio_problem
from gradaccum._batch_stats import batch_statistic_problem
from gradaccum._copied_loop import (
    CopiedLoopWarning,
    division_problem,
    mean_problem,
    scaler_problem,
    sum_problem,
    window_count_problem,
)
from gradaccum._forgotten_leaves import ForgottenLeaves
from gradaccum._in_batch import in_batch_problem
from gradaccum._nll_mean import ctc_without_nll, nll_mean_problem, unshifted_count_problem
from gradaccum._outside_weights import OutsideWeights
from gradaccum._pairs import split_pairs_problem
from gradaccum._scaled_loss import scale_problem
from gradaccum._teacher import teacher_problem
from gradaccum._warnings import warn_user
from gradaccum._weighted_mean import (
    divided_sum_problem,
    masked_mean_problem,
    masked_means_per_row,
    per_row_change_problem,
)

__all__ = ["TokenMeanCheck", "TokenMeanWarning", "warn_if_token_mean"]

_IGNORE_INDEX = -100  # cross_entropy's default ignore_index, and Hugging Face's unscored label


class TokenMeanWarning(UserWarning):
    """A plain-scalar loss on a batch with unscored label positions: a token mean read by rows."""


def _targets(micro_batch: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Where a micro-batch's integer targets may be, named as the user would index them.

    A dict's `labels` (or `shift_labels`, a causal LM's shifted by the pipeline) when it has
    them; otherwise every integer tensor at the top level of a dict, tuple or list (`(x, y)`
    batches, `{"x": ..., "target": ...}`): inputs such as token ids or masks never hold -100.
    """
    if isinstance(micro_batch, Mapping):
        named = [key for key in ("labels", "shift_labels") if key in micro_batch]
        keys = named[:1] or list(micro_batch)
        items = [(f"[{key!r}]", micro_batch[key]) for key in keys]
    elif isinstance(micro_batch, (tuple, list)):
        items = [(f"[{index}]", value) for index, value in enumerate(micro_batch)]
    else:
        return
    for where, value in items:
        # Unsigned tensors (uint8 images, bool masks) cannot hold -100, yet `== -100` wraps
        # to 156 in uint8: every image with a pixel of 156 warned of unscored labels.
        if (
            isinstance(value, torch.Tensor)
            and value.dtype.is_signed
            and not (value.is_floating_point() or value.is_complex())
        ):
            yield where, value


def _labelled(micro_batch: object) -> bool:
    """Whether `micro_batch` names its targets, as Hugging Face batches do (`labels`)."""
    return isinstance(micro_batch, Mapping) and any(
        key in micro_batch for key in ("labels", "shift_labels")
    )


def warn_if_token_mean(micro_batch: object, loss: object = None, rows: int = 0) -> bool:
    """Warn if a plain-scalar loss is a mean over targets, not rows: a mean read by rows.

    Called for losses returned as plain scalars (a mean over the micro-batch's rows). Targets
    holding -100 (unscored positions) mean the scalar is a mean over the scored targets, and
    weighting it by rows is not the full-batch mean. The `loss`'s graph is read too
    (`nll_mean_problem`): a `cross_entropy` / `nll_loss` mean whose targets hold its own
    `ignore_index` (255 in segmentation), or that is class-weighted (`weight=`), or a sum
    divided by something other than the rows (`sum(w * loss) / sum(w)`: `divided_sum_problem`).

    Returns:
        Whether it warned.
    """
    problem = nll_mean_problem(loss, micro_batch, rows) if isinstance(loss, torch.Tensor) else None
    if problem is not None:
        warn_user(TokenMeanWarning(problem))
        return True
    # CTC's -100-padded targets (a Hugging Face *ForCTC model): its mean is a mean of rows.
    ctc = isinstance(loss, torch.Tensor) and ctc_without_nll(loss)
    for where, labels in [] if ctc else _targets(micro_batch):
        ignored = labels == _IGNORE_INDEX
        # Targets are class indices and -100; signed PCM audio (int16) holds -100 among other
        # negative samples: it is an input, and warned of every clip that had that sample.
        if not bool(ignored.any()) or bool(((labels < 0) & ~ignored).any()):
            continue
        warn_user(
            TokenMeanWarning(
                "loss_fn returned a plain scalar, read as a mean over the micro-batch's "
                f"{labels.shape[0]} rows, but the batch's labels (batch{where}) hold "
                f"{_IGNORE_INDEX} (unscored positions, ignore_index): a mean over the scored "
                "targets is being weighted by rows, which is not the full-batch mean. Return "
                "gradaccum.LossSum(sum_of_losses (reduction='sum'), "
                "count=number_of_scored_targets) instead."
            )
        )
        return True
    problem = divided_sum_problem(loss, rows) if isinstance(loss, torch.Tensor) else None
    if problem is None and isinstance(loss, torch.Tensor):  # `F.mse_loss(p[mask], y[mask])`
        problem = masked_mean_problem(loss, rows)
    if problem is not None:  # per-sample weights, a mask: `sum(w * loss) / sum(w)`
        warn_user(TokenMeanWarning(problem))
        return True
    return False


class TokenMeanCheck:
    """Warns once if plain-scalar losses come from batches with -100 labels (a token mean).

    Only the first `checks` plain-scalar micro-batches are inspected (each check reads the
    labels, a device sync on an accelerator), and none after one warned. A micro-batch of one
    row is checked too: the token mean of one row, weighted by 1, is still not the window's
    token mean.

    Args:
        checks: Plain-scalar micro-batches to inspect at most.
    """

    def __init__(self, model: torch.nn.Module | None = None, checks: int = 8) -> None:
        self.model = model  # a module loss_fn runs outside it: a teacher in train mode
        self.outside = OutsideWeights(model)  # outside modules' weights written mid-window
        self.leaves = ForgottenLeaves()  # a loss weight no one steps (Accumulator only)
        self.left = checks
        self.copied_left = checks  # `_copied_loop`'s and the pairs' checks, of any loss
        self.copied = True  # no copied loop's line told yet
        # Micro-batches divided by their window's micro-batches, all of them from the first
        # (-1 once one was not: a count from the data, `sum / n_tokens`, equal to it by chance).
        self.divisions = 0
        # Each kind told once, on its own: one told must not silence the other.
        self.unshifted, self.pairs = True, True  # an unshifted count; pairs cut by the split
        self.in_batch = True  # a loss comparing the rows with each other (in-batch negatives)
        self.ratio = True  # a ratio of sums or a spread over the rows (a batch Dice, VICReg)
        # A statistic of the micro-batch (advantages centered, mixup): told once each; a
        # mixup on its second micro-batch (-1 once targets held other labels: mixed before).
        self.centered, self.mixed = True, 0
        # Class weights fitting a micro-batch's label counts (True: none yet; then the first
        # ones seen): told when another micro-batch's differ, drawn in loss_fn.
        self.weights: bool | str = True
        self.per_row: tuple[int, ...] | None = None  # the window's masked means' values per row
        self._coupled = False  # a warning above told: the micro-batch's size is in the objective

    def check(
        self,
        result: object,
        micro_batch: object,
        items: int = 0,
        micro_batches: int = 0,
        loss_fn: object = None,
    ) -> None:
        """Inspect `micro_batch` if `loss_fn` returned a plain scalar for it.

        Any loss is looked at for a copied loop's line (`_copied_loop`): `items` rows, one of
        `micro_batches` in the window (0 when not known up front); `loss_fn` for a module it
        runs outside the model in train mode (`_teacher`).

        Raises:
            ValueError: If the loss was multiplied by a GradScaler's scale (before any backward,
                so the window is forgotten and nothing changes).
        """
        self.leaves.check(result, micro_batch)
        moved = self.outside.check(loss_fn)  # another window's step inside this one
        if moved:
            warn_user(UserWarning(moved))
        if self.copied_left:
            scaled = scaler_problem(result)  # before the count: a retry is refused again
            if scaled is not None:
                raise ValueError(scaled)
            self.copied_left -= 1
            divided = division_problem(result, micro_batches, items) or scale_problem(
                result, micro_batches, items
            )
            if self.divisions >= 0:
                self.divisions = self.divisions + 1 if divided is not None else -1
            problem = self.copied and (sum_problem(result, items) or mean_problem(result))
            problem = problem or (divided if self.copied and self.divisions > 1 else None)
            if self.copied and not problem and _labelled(micro_batch):  # num_items_in_batch
                labels = next((value for _, value in _targets(micro_batch)), None)
                problem = window_count_problem(result, labels, items)
            unshifted = self.unshifted and unshifted_count_problem(result, items)
            if unshifted:  # a causal LM's count taken before its labels' shift
                warn_user(TokenMeanWarning(unshifted))
                self.unshifted = False
            in_batch = self.in_batch and in_batch_problem(result, items, micro_batches)
            if in_batch:  # rows compared with each other, which a split cuts apart
                warn_user(UserWarning(in_batch))
                self.in_batch, self._coupled = False, True
            ratio = (
                self.in_batch and self.ratio and batch_ratio_problem(result, items, micro_batches)
            )
            if ratio:  # a Dice over the batch, a std over the rows: another objective per split
                warn_user(UserWarning(ratio))
                self.ratio, self._coupled = False, True
            pairs = (
                not in_batch and self.pairs and split_pairs_problem(result, items, micro_batches)
            )
            if pairs:  # chosen and rejected rows a split cut apart
                warn_user(UserWarning(pairs))
                self.pairs, self._coupled = False, True
            self._check_statistics(result, items, micro_batches)
            if self.model is not None and loss_fn is not None and micro_batches > 1:
                teacher = teacher_problem(loss_fn, self.model)  # outside the model, train mode
                if teacher:
                    warn_user(UserWarning(teacher))
                    self.model = None
            if problem and self.in_batch:  # a rows x rows matrix's `.sum()`: told as in-batch
                warn_user(CopiedLoopWarning(problem))
                self.copied = False
        if self.left and isinstance(result, torch.Tensor):
            self.left = 0 if warn_if_token_mean(micro_batch, result, items) else self.left - 1
            if self.left or self.per_row is not None:  # not warned: a masked mean per row?
                self._compare_per_row(masked_means_per_row(result, items))

    def _check_statistics(self, result: object, items: int, micro_batches: int) -> None:
        """Warn once each of advantages centered and labels mixed within a micro-batch."""
        if not self.centered and self.mixed < 0 and not self.weights:
            return
        found = batch_statistic_problem(result, items, micro_batches)
        kind, problem = found or ("", "")
        if kind == "centered" and self.centered:
            warn_user(UserWarning(problem))
            self.centered, self._coupled = False, True
        if kind.startswith("weights") and self.weights:  # fit this micro-batch's counts
            if self.weights is not True and self.weights != kind:  # and changed: drawn here
                warn_user(UserWarning(problem))
                self.weights, self._coupled = False, True
            else:
                self.weights = kind
        if self.mixed >= 0:
            self.mixed = -1 if kind == "not mixed" else self.mixed + (kind == "mixed")
            if self.mixed == 2 and kind == "mixed":
                warn_user(UserWarning(problem))
                self.mixed, self._coupled = -1, True

    def open_window(self, params: Sequence[torch.Tensor] | None = None) -> None:
        """A new window (over `params`): its masked means per row may differ from the last's."""
        self.per_row = None
        self.leaves.open_window(params)
        self.outside.open_window()

    def _compare_per_row(self, per_row: tuple[int, ...] | None) -> None:
        """Warn once if a masked mean's values per row differ from the window's first one's."""
        if per_row is None:
            return
        before = self.per_row
        if before is None or len(before) != len(per_row):
            self.per_row = per_row
        elif before != per_row:
            changed = next((b, n) for b, n in zip(before, per_row, strict=True) if b != n)
            warn_user(TokenMeanWarning(per_row_change_problem((changed[0],), (changed[1],))))
            self.left, self.per_row = 0, None

    @property
    def rows_coupled(self) -> bool:
        """Whether a warning told that the loss depends on how the batch is split into rows."""
        return self._coupled

    @property
    def pending(self) -> bool:
        """Whether a later micro-batch is still to be looked at."""
        return bool(self.left or self.copied_left or self.outside.active or self.leaves.active)
