"""The gradient-divisor contract: the only place where gradaccum decides what divides a gradient.

The whole contract:

1. Each micro-batch's backward differentiates `loss_sum * loss_scale / denominator`
   (`scaled_loss`), where
   `loss_sum` is the SUM of its per-item losses, `loss_scale` is the fp16 GradScaler's scale
   (1 otherwise) and `denominator` is `backward_denominator(...)`; both are fixed for the window.
2. A backend that averages over ranks (DDP, FSDP2) divides the summed gradient by `averaged_over`.
3. At the window boundary every gradient is divided once, by `grad_divisor(...)`.
4. The result is the gradient of the window's objective: `Σ loss_sum / Σ count` over all
   micro-batches of all ranks (`normalize="mean"`), or `Σ loss_sum` (`normalize="sum"`).

With `g = Σ ∇loss_sum`, the gradients hold `g * loss_scale / (denominator * averaged_over)`, so the
divisor is `count * loss_scale / (denominator * averaged_over)` for a mean (`count` → 1 for a sum).
Nothing else in the package multiplies or divides a gradient.

`backward_denominator` is chosen so that the division is as exact as a hand-written loop:

- a plain mean over a batch known up front on one process folds the division into each backward
  (`denominator = B`: `mean_i * n_i / B`, exactly the hand loop); the divisor is then `B / B`,
  exactly 1, and the boundary divides by nothing. Not for a bfloat16 or float16 loss
  (`folds_counts`): its seed `n_i / B` would be rounded to 8 or 11 bits;
- otherwise it is the power of two nearest the expected count: summed losses would give fp16
  activation gradients about `count` times too large, and scaling by a power of two is exact, so
  the boundary's division is the one rounding.

Example:
    >>> from gradaccum.options import Normalize
    >>> d = backward_denominator(Normalize.MEAN, expected_items=49, window_items=49)
    >>> d, grad_divisor(49, Normalize.MEAN, d)
    (49.0, 1.0)
    >>> d = backward_denominator(Normalize.MEAN, expected_items=12, window_items=None)
    >>> d, grad_divisor(12, Normalize.MEAN, d)
    (16.0, 0.75)
    >>> grad_divisor(12, Normalize.SUM, 1.0, loss_scale=1024.0, averaged_over=4)
    256.0
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch

from gradaccum.norms import split_kinds
from gradaccum.options import Normalize

__all__ = [
    "Expectation",
    "Seeds",
    "backward_denominator",
    "divide_",
    "folds_counts",
    "grad_divisor",
    "scaled_loss",
    "seeded_loss",
]


def backward_denominator(
    normalize: Normalize, *, expected_items: int, window_items: int | None
) -> float:
    """What each micro-batch's summed loss is divided by in its backward (contract point 1).

    Args:
        normalize: The window's objective.
        expected_items: About how many items the window will count (only its magnitude matters).
        window_items: The window's exact count when every item is known to count once (a plain
            mean over a batch given whole, on one process); None otherwise.

    Returns:
        `window_items` when the division can be folded into the backward passes, else the power
        of two nearest `expected_items`; 1.0 for `normalize="sum"`.
    """
    if normalize is Normalize.SUM:
        return 1.0
    if window_items is not None:
        return float(window_items)
    return math.ldexp(1.0, round(math.log2(max(1, expected_items))))


@dataclass(frozen=True)
class Expectation:
    """What a window knows of its size before its first backward: its denominator follows.

    Attributes:
        micro_batches: Micro-batches the window plans (`step()`) or closes at (`micro_step()`).
        items: The window's items, when it is given whole (`step()`).
        counted: What the loss says it will count over the window, ahead (`items_counted`):
            one int, or one per `LossSum.terms` term.
        until: The count, over all ranks, at which a window of counted items closes.
        until_term: The `LossSum.terms` term whose count `until` is (`Tokens.term`).
    """

    micro_batches: int
    items: int | None = None
    counted: int | dict[str, float] | None = None
    until: int | None = None
    until_term: str | None = None

    @property
    def planned(self) -> int:
        """The window's micro-batches when known up front; 0 for a window closed by a count."""
        return 0 if self.until else self.micro_batches

    def denominator(
        self,
        normalize: Normalize,
        world: int,
        weight: int,
        items: int,
        count: int,
        loss_dtype: torch.dtype = torch.float32,
    ) -> float:
        """`backward_denominator` from the window's first micro-batch (`items`, `count`).

        A count known up front is folded in unless the loss is in a low precision
        (`folds_counts`).
        """
        if self.until:
            expected = self.until // world
        else:
            expected = (items if world > 1 or not count else count) * self.micro_batches
        counted = self.counted if isinstance(self.counted, int) else None
        known = self.items if weight > 1 else counted  # a plain mean's items, or counted ahead
        folded = known if known and world == 1 and folds_counts(loss_dtype) else None
        return backward_denominator(normalize, expected_items=expected, window_items=folded)


def grad_divisor(
    global_count: int,
    normalize: Normalize,
    denominator: float,
    *,
    loss_scale: float = 1.0,
    averaged_over: int = 1,
) -> float:
    """What the accumulated gradients are divided by at the boundary (contract point 3).

    Args:
        global_count: Items counted in the window, over every micro-batch and rank.
        normalize: The window's objective.
        denominator: The window's `backward_denominator`.
        loss_scale: The fp16 loss scale every backward of the window used (1 without one).
        averaged_over: What the backend already divided the summed gradient by.

    Returns:
        The divisor: exactly 1.0 when the division was folded into the backward passes.

    Raises:
        ValueError: For a mean over no item, which has no gradient (the boundary skips such
            windows before it divides).
    """
    if normalize is Normalize.SUM:
        global_count = 1
    elif global_count <= 0:
        raise ValueError(f"global_count={global_count}: a mean over no item has no gradient.")
    # Numerator and denominator are exact (an int times a power of two, and a power of two or
    # the folded count times the world size), so the divisor carries at most one rounding.
    return global_count * loss_scale / (denominator * averaged_over)


def divide_(grads: list[torch.Tensor], divisor: float) -> None:
    """Divide every gradient by `divisor` in place (contract point 3): one rounding each.

    On CPU a foreach op loops over the tensors, and a Python number is wrapped and converted to
    each tensor's dtype once per tensor (an allocation and a copy each). For plain float32 or
    float64 CPU tensors of one dtype the divisor is made a 0-dim tensor of that dtype once
    instead: the same bits, since the kernel rounds the number to that dtype either way.
    """
    if divisor == 1.0 or not grads:
        return
    kinds = split_kinds(grads)
    if len(kinds) > 1:  # FSDP2 shards and plain gradients: a foreach op takes one kind
        for kind in kinds:
            divide_(kind, divisor)
        return
    dtype = grads[0].dtype
    plain = set(map(type, grads)) == {torch.Tensor}  # not DTensor: no plain divisor for those
    if plain and dtype in _SIGNIFICAND_BITS and set(map(_CPU_DTYPE, grads)) == {(True, dtype)}:
        torch._foreach_div_(grads, torch.full((), divisor, dtype=dtype))
    else:
        torch._foreach_div_(grads, divisor)


def scaled_loss(
    value: torch.Tensor, weight: int, denominator: float, loss_scale: float = 1.0
) -> torch.Tensor:
    """What a micro-batch's backward differentiates: `value * weight * loss_scale / denominator`.

    `value * weight` is the micro-batch's summed loss (`weight` is its item count for a plain
    mean, 1 for a `LossSum`). When the factor `weight * loss_scale / denominator` is exact in the
    loss's dtype (a power-of-two denominator, as `backward_denominator` gives unless it folds a
    count), it is applied in one multiply, which rounds once. Otherwise the factors are applied
    one by one, as a hand loop writes `loss * n / B`: folded into one number, `n / B` would
    first be rounded to the loss's dtype (float32 for a loss computed in float32), an error the
    full-batch step does not make.

    Example:
        >>> import torch
        >>> scaled_loss(torch.tensor(2.0), weight=5, denominator=20.0)
        tensor(0.5000)
    """
    if weight == denominator and loss_scale == 1.0:
        return value  # one micro-batch over the whole window: the plain backward
    factor = _single_factor(weight, loss_scale, denominator, value.dtype)
    if factor is not None:
        return value * factor
    scaled = value * weight if weight != 1 else value
    if loss_scale != 1.0:
        scaled = scaled * loss_scale
    return scaled / denominator if denominator != 1.0 else scaled


class Seeds:
    """Backward seeds kept for reuse: a window's micro-batches mostly share one factor.

    A seed is a 0-dim tensor that autograd only reads. One that something wrote into in place
    (its version moved: a custom backward that scales its incoming gradient in place) is
    replaced, so a reused seed always holds its factor.

    Example:
        >>> import torch
        >>> seeds = Seeds()
        >>> seeds.get(0.25, torch.zeros(())) is seeds.get(0.25, torch.zeros(()))
        True
    """

    _LIMIT = 16  # fp16 loss scales change: keep the cache small, not every scale ever seen

    def __init__(self) -> None:
        self._seeds: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}
        # By what a micro-batch asks for: most windows ask the same each time, and working the
        # factor out again (a few exactness checks) costs more than the backward's seeding.
        self._asked: dict[tuple[int, float, float, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, factor: float, like: torch.Tensor) -> torch.Tensor:
        """A 0-dim tensor holding `factor`, with `like`'s dtype and device."""
        key = (factor, like.dtype, like.device)
        seed = self._seeds.get(key)
        if seed is None or seed._version:
            if len(self._seeds) >= self._LIMIT:
                self._seeds.clear()
                self._asked.clear()
            seed = torch.full((), factor, dtype=like.dtype, device=like.device)
            self._seeds[key] = seed
        return seed

    def seeded_loss(
        self, value: torch.Tensor, weight: int, denominator: float, loss_scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`seeded_loss` with a seed from this cache."""
        asked = (weight, denominator, loss_scale, value.dtype, value.device)
        seed = self._asked.get(asked)
        if seed is not None and not seed._version and type(value) is torch.Tensor:
            return value, seed
        root, seed = seeded_loss(value, weight, denominator, loss_scale, self)
        if seed is not None:
            if len(self._asked) >= 4 * self._LIMIT:  # asks that share factors: bounded too
                self._asked.clear()
            self._asked[asked] = seed
        return root, seed


def seeded_loss(
    value: torch.Tensor,
    weight: int,
    denominator: float,
    loss_scale: float = 1.0,
    seeds: Seeds | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`scaled_loss` as a backward root and its seed (None: the usual seed of one).

    When `scaled_loss` would apply one exact factor, the root is `value` itself, seeded with that
    factor in `value`'s dtype: every node then receives the same gradient, bit for bit, as in a
    backward of `value * factor` seeded with one (whose first node computes `1 * factor`), without
    the multiply, its autograd node and their temporaries.

    Example:
        >>> import torch
        >>> seeded_loss(torch.tensor(2.0), weight=16, denominator=64.0)
        (tensor(2.), tensor(0.2500))
    """
    factor = None
    if type(value) is torch.Tensor and (weight != denominator or loss_scale != 1.0):
        factor = _single_factor(weight, loss_scale, denominator, value.dtype)
    if factor is None:
        return scaled_loss(value, weight, denominator, loss_scale), None
    if seeds is not None:
        return value, seeds.get(factor, value)
    return value, torch.full((), factor, dtype=value.dtype, device=value.device)


_SIGNIFICAND_BITS = {torch.float64: 53, torch.float32: 24}
_CPU_DTYPE = operator.attrgetter("is_cpu", "dtype")
# Seeds may also be exact in a low-precision loss's dtype, within its normal range.
_SEED_BITS = {**_SIGNIFICAND_BITS, torch.bfloat16: 8, torch.float16: 11}
_SEED_RANGE = {torch.float16: (2.0**-14, 2.0**16)}


def folds_counts(loss_dtype: torch.dtype) -> bool:
    """Whether a loss of `loss_dtype` may have a known count folded into its backward.

    A folded seed `n / B` is rounded to the loss's dtype; in bfloat16 or float16 (8 or 11 bits)
    that is an error of up to 2e-3 the full-batch step (seed 1) does not make. A power-of-two
    denominator keeps the seed `n / 2**k` exact (up to 256 rows in bfloat16, 2048 in float16),
    and the boundary divides by the rest in the gradients' dtype.
    """
    return loss_dtype in _SIGNIFICAND_BITS


@functools.lru_cache(maxsize=64)
def _single_factor(
    weight: int, loss_scale: float, denominator: float, dtype: torch.dtype
) -> float | None:
    """`weight * loss_scale / denominator` if one multiply by it is exact in `dtype`, else None.

    Exact when the denominator is a power of two and the numerator's factors and product are
    exact in `dtype` (at most 48 significant bits, so exact in float64 too).
    """
    numerator = weight * loss_scale
    if (
        _is_power_of_two(denominator)
        and _exact_in(weight, dtype)
        and _exact_in(loss_scale, dtype)
        and _exact_in(numerator, dtype)
        and _exact_in(numerator / denominator, dtype)
    ):
        return numerator / denominator
    return None


def _is_power_of_two(number: float) -> bool:
    return number > 0.0 and math.frexp(number)[0] == 0.5


def _exact_in(number: float, dtype: torch.dtype) -> bool:
    """Whether `number` is exact in `dtype`, far from its range's ends (float16's are near)."""
    bits = _SEED_BITS.get(dtype)
    low, high = _SEED_RANGE.get(dtype, (2.0**-100, 2.0**100))
    if bits is None or not low <= abs(number) < high:
        return False
    significand = math.frexp(number)[0]
    return (significand * 2.0**bits).is_integer()
