"""Tests for gradaccum.divisor: the one function that decides what divides a gradient."""

from __future__ import annotations

import pytest
import torch

from gradaccum.divisor import (
    Seeds,
    backward_denominator,
    divide_,
    grad_divisor,
    scaled_loss,
    seeded_loss,
)
from gradaccum.options import Normalize


def _summed_gradient(denominator: float, loss_scale: float = 1.0) -> torch.Tensor:
    """Accumulate three ragged micro-batches of a summed loss, as the engine's backward does."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True)
    x = torch.randn(11, 5, dtype=torch.float64, generator=generator)
    for start in (0, 4, 8):
        value = (x[start : start + 4] @ weight).tanh().pow(2).sum()
        (value * (loss_scale / denominator)).backward()
    assert weight.grad is not None
    return weight.grad


def _reference() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True)
    x = torch.randn(11, 5, dtype=torch.float64, generator=generator)
    (x @ weight).tanh().pow(2).mean().backward()
    assert weight.grad is not None
    return weight.grad


@pytest.mark.parametrize("expected_items", [1, 3, 11, 50, 1000])
@pytest.mark.parametrize("loss_scale", [1.0, 2.0**16])
def test_power_of_two_denominators_change_no_bit(expected_items: int, loss_scale: float) -> None:
    """The denominator depends on the planned window; the divided result must not."""
    results = []
    for expected in (expected_items, 7):
        denominator = backward_denominator(
            Normalize.MEAN, expected_items=expected, window_items=None
        )
        grad = _summed_gradient(denominator, loss_scale)
        grad /= grad_divisor(11, Normalize.MEAN, denominator, loss_scale=loss_scale)
        results.append(grad)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], _reference(), rtol=1e-12, atol=0)


def test_folded_mean_divides_by_exactly_one() -> None:
    for items in (1, 3, 49, 97, 1000):
        denominator = backward_denominator(Normalize.MEAN, expected_items=items, window_items=items)
        assert grad_divisor(items, Normalize.MEAN, denominator) == 1.0


def test_negative_control_a_naive_product_is_not_one() -> None:
    """Had the folded case been written as count * (1 / B), the boundary would divide again."""
    assert 49 * (1 / 49) != 1.0


def test_sum_ignores_the_count_and_undoes_the_backend_average() -> None:
    assert grad_divisor(12, Normalize.SUM, 1.0, averaged_over=4) == 0.25
    assert grad_divisor(0, Normalize.SUM, 1.0) == 1.0
    assert grad_divisor(12, Normalize.MEAN, 16.0, averaged_over=2) == 12 / 32


def test_a_mean_over_no_item_is_refused() -> None:
    with pytest.raises(ValueError, match="no item"):
        grad_divisor(0, Normalize.MEAN, 1.0)


def _fraction_of(value: torch.Tensor) -> float:
    """The value as a float64 number, exactly (every float32 is a float64)."""
    return float(value.double())


@pytest.mark.parametrize(
    ("weight", "denominator", "loss_scale"),
    [(16, 64.0, 1.0), (5, 8.0, 1.0), (3, 4.0, 2.0**16), (7, 100.0, 1.0), (13, 40.0, 1.0)],
)
def test_scaled_loss_rounds_at_most_as_often_as_the_hand_written_product(
    weight: int, denominator: float, loss_scale: float
) -> None:
    """One multiply by an exact factor rounds once; otherwise the factors go one by one.

    Either way the float32 result is within one rounding of the exact value, and never worse
    than `loss * n * scale / B` written by hand.
    """
    value = torch.tensor(1.2345678, dtype=torch.float32)
    exact = _fraction_of(value) * weight * loss_scale / denominator  # float64: exact enough
    ours = _fraction_of(scaled_loss(value, weight, denominator, loss_scale))
    hand = _fraction_of(value * weight * loss_scale / denominator)
    assert abs(ours - exact) <= abs(hand - exact)
    assert abs(ours - exact) <= 2 * 2.0**-24 * abs(exact)


def test_negative_control_a_coarsely_rounded_factor_breaks_the_bound() -> None:
    """The bound above can fail: a factor rounded to bfloat16 first lands outside it."""
    value = torch.tensor(1.2345678, dtype=torch.float32)
    exact = _fraction_of(value) * 7 / 100
    coarse = _fraction_of(value * float(torch.tensor(7 / 100, dtype=torch.bfloat16)))
    assert abs(coarse - exact) > 2 * 2.0**-24 * abs(exact)


def test_scaled_loss_keeps_the_graph_in_one_node_when_exact() -> None:
    """A power-of-two denominator costs one autograd node, as the hand loop's `loss * (n / B)`."""
    weight = torch.ones((), requires_grad=True)
    scaled = scaled_loss(weight * 3.0, 16, 64.0)
    assert scaled.grad_fn is not None
    assert scaled.grad_fn.next_functions[0][0].name() == "MulBackward0"  # then the user's mul
    assert (
        scaled.grad_fn.next_functions[0][0].next_functions[0][0].name().endswith("AccumulateGrad")
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_divide_is_bitwise_the_division_by_a_python_number(dtype: torch.dtype) -> None:
    """The one-tensor divisor of the CPU path rounds as a Python number does, whatever its bits."""
    generator = torch.Generator().manual_seed(3)
    sizes = ((7, -4), (300, 3))
    grads = [torch.randn(n, generator=generator).to(dtype) * 10.0**k for n, k in sizes]
    for divisor in (1.0, 0.75, 12 / 7, 1 + 2.0**-40, 3.0e5 / 1024):
        expected = [g / divisor for g in grads]
        ours = [g.clone() for g in grads]
        divide_(ours, divisor)
        assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("weight", "denominator", "loss_scale"),
    [(16, 64.0, 1.0), (1, 512.0, 1.0), (7, 8.0, 2.0**16), (3, 48.0, 1.0), (5, 5.0, 1.0)],
)
def test_seeded_loss_gives_the_scaled_loss_gradient_bit_for_bit(
    dtype: torch.dtype, weight: int, denominator: float, loss_scale: float
) -> None:
    """Seeding the backward with the one exact factor changes no bit of any gradient."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(9, 4, dtype=dtype, generator=generator)
    grads = []
    for seeded in (False, True):
        weight_param = torch.linspace(-1.0, 1.0, 4, dtype=dtype).requires_grad_()
        value = (x @ weight_param).sin().mean()
        if seeded:
            root, seed = seeded_loss(value, weight, denominator, loss_scale)
            exact = weight * loss_scale / denominator
            assert (seed is None) == (root is not value or weight == denominator)
            assert seed is None or float(seed) == exact
        else:
            root, seed = scaled_loss(value, weight, denominator, loss_scale), None
        root.backward(seed)
        grads.append(weight_param.grad)
    assert torch.equal(grads[0], grads[1])


def test_seeds_reuse_one_seed_per_ask_and_replace_a_seed_written_in_place() -> None:
    seeds, value = Seeds(), torch.tensor(3.0, requires_grad=True)
    root, first = seeds.seeded_loss(value, 16, 64.0)
    assert root is value
    assert first is not None
    assert float(first) == 0.25
    again = seeds.seeded_loss(value, 16, 64.0)[1]
    assert again is first  # the same ask: the cached seed, not a new tensor
    assert seeds.seeded_loss(value, 8, 64.0)[1] is not first  # another factor
    first.mul_(2.0)  # a custom backward scaled its incoming gradient in place
    replaced = seeds.seeded_loss(value, 16, 64.0)[1]
    assert replaced is not first
    assert float(replaced) == 0.25
    assert float(first) == 0.5  # negative control: the written seed no longer holds its factor
    assert seeds.seeded_loss(value.double(), 16, 64.0)[1].dtype == torch.float64  # by dtype


def test_seeds_cache_stays_bounded_over_many_asks() -> None:
    seeds, value = Seeds(), torch.tensor(1.0, requires_grad=True)
    for weight in range(1, 1000):
        _root, seed = seeds.seeded_loss(value, weight, 1024.0)
        assert seed is None or float(seed) == weight / 1024.0
    assert len(seeds._asked) <= 4 * Seeds._LIMIT
    assert len(seeds._seeds) <= Seeds._LIMIT
