"""Segmentation losses as people write them, against a plain full-batch step (float64).

An FCN-style segmenter (conv + BatchNorm + upsample) with a DeepLab-like auxiliary head
(aux weight 0.4), fine-tuned with `batchnorm="frozen"`. `cross_entropy(..., ignore_index=255)`
returned as a plain scalar is a mean over the counted pixels: weighted by images it is not the
full-batch mean when the micro-batches ignore different numbers of pixels, and a class-weighted
mean divides by the summed weights. The library reads the loss's graph and warns
(`TokenMeanWarning`) with the exact recipe; the recipes equal the full-batch step.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator, LossSum
from gradaccum.loss import TokenMeanWarning
from tests.reference import param_tensors, relative_gap

_VOID = 255
_WEIGHT = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
LossFn = Callable[[nn.Module, Any], Any]


class _Segmenter(nn.Module):
    """Conv + BatchNorm + pooling, a main and an auxiliary 1x1 head, bilinear upsampling."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head, self.aux = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = F.max_pool2d(F.relu(self.bn(self.stem(x))), 2)
        size = x.shape[-2:]
        return {
            "out": F.interpolate(self.head(features), size=size, mode="bilinear"),
            "aux": F.interpolate(self.aux(features), size=size, mode="bilinear"),
        }


def _setup() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    model = _Segmenter().double()
    model.bn.running_mean.uniform_(-0.5, 0.5)  # pretrained-looking statistics
    x = torch.randn(7, 3, 8, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (7, 8, 8), generator=generator)
    y[0, :6] = _VOID  # the micro-batches ignore different numbers of pixels
    y[1, :2] = _VOID
    y[5, :, :3] = _VOID
    return model, (x, y)


def _plain_aux(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = model(x)
    main = F.cross_entropy(out["out"], y, ignore_index=_VOID)
    return main + 0.4 * F.cross_entropy(out["aux"], y, ignore_index=_VOID)


def _sum_aux(model: nn.Module, batch: Any) -> LossSum:
    x, y = batch
    out = model(x)
    main = F.cross_entropy(out["out"], y, ignore_index=_VOID, reduction="sum")
    aux = F.cross_entropy(out["aux"], y, ignore_index=_VOID, reduction="sum")
    return LossSum(main + 0.4 * aux, (y != _VOID).sum())


def _plain_weighted(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x)["out"], y, weight=_WEIGHT, ignore_index=_VOID)


def _weighted_terms(model: nn.Module, batch: Any) -> LossSum:
    x, y = batch
    value = F.cross_entropy(model(x)["out"], y, weight=_WEIGHT, ignore_index=_VOID, reduction="sum")
    return LossSum.terms(ce=(value, _WEIGHT[y[y != _VOID]].sum()))


def _full_batch(
    model: nn.Module, batch: Any, mean: LossFn, steps: int = 2
) -> dict[str, torch.Tensor]:
    """Plain SGD steps on the whole batch, BatchNorm in eval mode (frozen)."""
    model = copy.deepcopy(model)
    model.train()
    model.bn.eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        mean(model, batch).backward()
        optimizer.step()
    return param_tensors(model)


def _accumulated(model: nn.Module, batch: Any, loss_fn: LossFn) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=3, batchnorm="frozen")
    for _ in range(2):
        assert acc.step(batch, loss_fn).stepped
    return param_tensors(model)


@pytest.mark.parametrize(
    ("exact", "plain"), [(_sum_aux, _plain_aux), (_weighted_terms, _plain_weighted)]
)
def test_segmentation_recipes_equal_the_full_batch_step_and_the_plain_mean_warns(
    exact: LossFn, plain: LossFn
) -> None:
    """Was silent: a plain `ignore_index=255` (or class-weighted) pixel mean was weighted by
    images with no warning, 255 not being -100; its autograd node says which mean it is."""
    model, batch = _setup()
    full = _full_batch(model, batch, plain)  # plain PyTorch: the full batch's own pixel mean
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenMeanWarning)
        assert relative_gap(_accumulated(model, batch, exact), full) < 1e-10
    with pytest.warns(TokenMeanWarning, match="LossSum") as record:
        naive = _accumulated(model, batch, plain)
    assert relative_gap(naive, full) > 1e-4  # negative control: the warning is deserved
    assert len([w for w in record if w.category is TokenMeanWarning]) == 1
    assert record[0].filename == __file__
    assert "batch[1]" in str(record[0].message)


def test_no_pixel_mean_warning_when_the_mean_is_one_over_rows() -> None:
    """Negative controls: 255 as a class under the default ignore_index, a `reduction='sum'`
    LossSum, uniform class weights and soft targets with class weights are all exact plain."""
    model, (x, y) = _setup()
    y = y.clamp(max=3)  # no void pixel: every image counts the same pixels

    def uniform(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0])["out"], b[1], weight=torch.full((4,), 2.0).double())

    def soft(m: nn.Module, b: Any) -> torch.Tensor:
        target = F.one_hot(b[1], 4).permute(0, 3, 1, 2).double()
        return F.cross_entropy(m(b[0])["out"], target, weight=_WEIGHT)

    def void_is_a_class(m: nn.Module, b: Any) -> torch.Tensor:
        logits = torch.cat([m(b[0])["out"]] * 64, dim=1)  # 256 classes: 255 is one
        return F.cross_entropy(logits, b[1].masked_fill(b[1] == 3, _VOID))

    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenMeanWarning)
        for loss_fn in (uniform, soft, void_is_a_class, _plain_aux):
            full = _full_batch(model, (x, y), loss_fn)
            assert relative_gap(_accumulated(model, (x, y), loss_fn), full) < 1e-10


def _dice_parts(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class sums over the counted pixels: intersection, prediction, target."""
    valid = (y != _VOID).unsqueeze(1)
    p = torch.softmax(model(x)["out"], 1) * valid
    t = F.one_hot(y.clamp(max=3), 4).permute(0, 3, 1, 2) * valid
    return (p * t).sum((0, 2, 3)), p.sum((0, 2, 3)), t.sum((0, 2, 3))


def _dice(model: nn.Module, batch: Any) -> torch.Tensor:
    inter, pred, target = _dice_parts(model, *batch)
    return (1 - 2 * inter / (pred + target)).mean()


def _dice_window(model: nn.Module, batch: Any, micro_batch_size: int) -> tuple[LossFn, float]:
    """docs/losses.md's recipe: the window's sums, then each micro-batch's first-order share."""
    from gradaccum import split_batch

    rows = len(batch[0])
    with torch.no_grad():  # pass 1: the window's sums, the forward pass 2 runs (eval BN)
        model.eval()
        parts = [_dice_parts(model, *micro) for micro in split_batch(batch, micro_batch_size)]
        model.train()
        inter, pred, target = (sum(part) for part in zip(*parts, strict=True))
        total = pred + target
        dice = (1 - 2 * inter / total).mean()
        offset = dice + (2 * inter * target / total**2).mean()  # makes the logged loss the Dice

    def share(m: nn.Module, micro: Any) -> LossSum:
        i, p, _ = _dice_parts(m, *micro)  # the target's sums have no gradient
        first_order = -(2 * (i * total - inter * p) / total**2).mean()
        return LossSum(first_order + offset * len(micro[0]) / rows, len(micro[0]))

    return share, float(dice)


def test_batch_dice_is_exact_with_the_two_pass_recipe_of_the_docs() -> None:
    """Dice over the batch is a ratio of window sums, not a LossSum: returned plainly per
    micro-batch it is off (the control, which `check_equivalence` reports); docs/losses.md's
    recipe (the window's sums from a no-grad pass, then each micro-batch's first-order share)
    equals the full-batch step, and its logged loss is the batch Dice."""
    from gradaccum import check_equivalence

    model, batch = _setup()
    full = _full_batch(model, batch, _dice)
    naive = _accumulated(model, batch, _dice)
    assert relative_gap(naive, full) > 1e-3
    frozen = copy.deepcopy(model).eval()
    assert not check_equivalence(frozen, batch, _dice, micro_batch_size=3).ok

    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=3, normalize="sum", batchnorm="frozen")
    for _ in range(2):
        share, dice = _dice_window(model, batch, 3)
        result = acc.step(batch, share)
        assert result.loss == pytest.approx(dice, rel=1e-12)
    assert relative_gap(param_tensors(model), full) < 1e-10


def test_the_dice_block_of_docs_losses_md_runs_and_is_exact() -> None:
    """The block users copy (docs/losses.md, Dice over the batch) is the tested recipe."""
    import textwrap

    from gradaccum import split_batch
    from tests.test_docs_examples import python_block

    model, batch = _setup()
    full = _full_batch(model, batch, _dice, steps=1)
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=3, normalize="sum", batchnorm="frozen")
    block = textwrap.dedent(python_block("losses.md", "def share(model, micro)"))
    scope = {"torch": torch, "LossSum": LossSum, "split_batch": split_batch, "batch": batch}
    scope |= {"model": model, "acc": acc, "dice_parts": _dice_parts}
    exec(block.replace("split_batch(batch, 8)", "split_batch(batch, 3)"), scope)
    assert relative_gap(param_tensors(model), full) < 1e-10


def test_the_graph_check_finds_the_mean_however_the_loss_is_written() -> None:
    """Label smoothing, flattened pixels, a shifted copy of the labels (named by the batch
    entry that holds the ignored value), nll_loss; a sum or a mean without ignored targets
    is not a problem (negative controls)."""
    from gradaccum._nll_mean import nll_mean_problem

    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 3, 3, generator=generator, dtype=torch.float64)
    logits.requires_grad_(True)
    y = torch.randint(0, 4, (2, 3, 3), generator=generator)
    y[0, 0, 0] = _VOID
    flat = logits.permute(0, 2, 3, 1).reshape(-1, 4)
    found = {
        "smoothing": F.cross_entropy(logits, y, ignore_index=_VOID, label_smoothing=0.1),
        "flat": F.cross_entropy(flat, y.flatten(), ignore_index=_VOID),
        "shifted": F.cross_entropy(flat[1:], y.flatten()[:-1].clone(), ignore_index=_VOID),
        "nll": F.nll_loss(F.log_softmax(logits, 1), y, ignore_index=_VOID),
    }
    for name, loss in found.items():
        problem = nll_mean_problem(loss, {"x": logits, "labels": y})
        assert problem is not None, name
        assert "batch['labels'] holds 255" in problem, name
        assert "ignore_index=255" in problem, name
    clean = y.clamp(max=3)
    assert (
        nll_mean_problem(F.cross_entropy(logits, y, ignore_index=_VOID, reduction="sum"), y) is None
    )
    assert nll_mean_problem(F.cross_entropy(logits, clean, ignore_index=_VOID), clean) is None


def test_a_pixel_mean_per_image_averaged_over_images_is_exact_and_not_warned() -> None:
    """Negative control of the graph check: `ce(out[i], y[i], ignore_index=255)` per image,
    averaged over the images, is a per-row loss (exact plain), and warned falsely before."""
    model, batch = _setup()

    def per_image(m: nn.Module, b: Any) -> torch.Tensor:
        out, y = m(b[0])["out"], b[1]
        means = [
            F.cross_entropy(out[i : i + 1], y[i : i + 1], ignore_index=_VOID) for i in range(len(y))
        ]
        return torch.stack(means).mean()

    full = _full_batch(model, batch, per_image)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenMeanWarning)
        assert relative_gap(_accumulated(model, batch, per_image), full) < 1e-10


def _varied_sizes() -> tuple[nn.Module, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """7 images of varied sizes and their masks, each ignoring its own share of pixels."""
    model, _ = _setup()
    generator = torch.Generator().manual_seed(11)
    images = [
        torch.randn(3, 6 + 2 * i, 8 + i % 3 * 2, generator=generator, dtype=torch.float64)
        for i in range(7)
    ]
    masks = []
    for i, image in enumerate(images):
        mask = torch.randint(0, 4, image.shape[1:], generator=generator)
        mask[: i % 4] = _VOID
        masks.append(mask)
    return model, (images, masks)


def _per_image_means(model: nn.Module, batch: Any) -> torch.Tensor:
    means = [
        F.cross_entropy(model(image[None])["out"], mask[None], ignore_index=_VOID)
        for image, mask in zip(*batch, strict=True)
    ]
    return torch.stack(means).mean()


def _per_image_loop(model: nn.Module, batch: Any) -> torch.Tensor:
    """The same mean, summed by Python and divided by the micro-batch's images."""
    images, masks = batch
    losses = (
        F.cross_entropy(model(image[None])["out"], mask[None], ignore_index=_VOID)
        for image, mask in zip(images, masks, strict=True)
    )
    return sum(losses) / len(images)  # type: ignore[return-value]


def _per_image_records(model: nn.Module, batch: Any) -> torch.Tensor:
    return _per_image_means(model, ([r["image"] for r in batch], [r["mask"] for r in batch]))


def _pixel_mean_of_the_list(model: nn.Module, batch: Any) -> torch.Tensor:
    logits = [model(image[None])["out"].permute(0, 2, 3, 1).reshape(-1, 4) for image in batch[0]]
    targets = torch.cat([mask.reshape(-1) for mask in batch[1]])
    return F.cross_entropy(torch.cat(logits), targets, ignore_index=_VOID)


def _accumulated_by(
    model: nn.Module, batch: Any, loss_fn: LossFn, micro_batch_size: int
) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=micro_batch_size, batchnorm="frozen")
    for _ in range(2):
        assert acc.step(batch, loss_fn).stepped
    return param_tensors(model)


@pytest.mark.parametrize("micro_batch_size", [1, 3])
@pytest.mark.parametrize("loss_fn", [_per_image_means, _per_image_loop, _per_image_records])
def test_per_image_means_over_a_list_of_masks_of_varied_sizes_are_exact_and_not_warned(
    loss_fn: LossFn, micro_batch_size: int
) -> None:
    """Images of varied sizes come as a list with a list of masks (or as examples): each
    image's `ignore_index=255` pixel mean, averaged over the images, is a per-row loss and
    exact plain. It warned `TokenMeanWarning` (the mask was not found as one row of a batch
    tensor), and a Python `sum(...) / len(images)` warned `CopiedLoopWarning` as a division by
    the window's micro-batches when the images equal them (3 + 3 + 1): both false alarms."""
    model, batch = _varied_sizes()
    if loss_fn is _per_image_records:
        batch = [{"image": i, "mask": m} for i, m in zip(*batch, strict=True)]  # type: ignore[assignment]
    full = _full_batch(model, batch, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _accumulated_by(model, batch, loss_fn, micro_batch_size)
    assert relative_gap(got, full) < 1e-10


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_a_pixel_mean_over_a_list_of_masks_still_warns_and_is_off(micro_batch_size: int) -> None:
    """Control: the masks concatenated into one pixel mean (also of a one-image micro-batch,
    a copy of its only mask) divides by each micro-batch's counted pixels: warned, and off."""
    model, batch = _varied_sizes()
    full = _full_batch(model, batch, _pixel_mean_of_the_list)
    with pytest.warns(TokenMeanWarning, match="ignore_index=255"):
        got = _accumulated_by(model, batch, _pixel_mean_of_the_list, micro_batch_size)
    assert relative_gap(got, full) > 1e-4
