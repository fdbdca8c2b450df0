"""`shapes`: generated semantic segmentation of circles, squares and triangles on noise.

Every image is 32x32 with one channel. It holds one to three shapes (later ones paint over
earlier ones) on a background with a random level, a random linear gradient and Gaussian noise.
A shape's brightness does not tell its class: only its outline does. Labels are per pixel:
0 background, 1 circle, 2 square, 3 triangle.

The model is a two-level U-Net whose convolutions are followed by BatchNorm (`norm="batch"`,
the default) or GroupNorm (`norm="group"`). BatchNorm in train mode normalizes with each
micro-batch's statistics, so accumulating micro-batches is NOT the same as one full batch; this
is the task of the classic "batch 8 vs batch 8 x 2 accumulation" experiment. GroupNorm works per
image, so with it accumulation is exact.

The loss is a `LossSum`: the sum of per-pixel cross-entropies and the number of pixels. The
metric is the mean intersection-over-union over the four classes (background included),
computed from one confusion matrix over the whole validation set.

Example:
    >>> task = ShapesTask()
    >>> images, labels = task.make_data(seed=0).train
    >>> tuple(images.shape[1:]), tuple(labels.shape[1:]), int(labels.max())
    ((1, 32, 32), (32, 32), 3)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.experiments.base import TaskData
from gradaccum.loss import LossSum

__all__ = ["CLASSES", "ShapesTask", "UNet", "generate_shapes", "mean_iou"]

CLASSES = ("background", "circle", "square", "triangle")
_SIZE = 32
_TRAIN_IMAGES = 400
_VAL_IMAGES = 100
_MAX_SHAPES = 3
_NOISE_STD = 0.25
_RADIUS = (4.0, 8.0)
_SQUARE = 0.8
_GROUPS = 8
_NORMS = ("batch", "group")


def generate_shapes(
    count: int, generator: torch.Generator, size: int = _SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `count` noisy images of shapes and their per-pixel class labels.

    Args:
        count: Number of images.
        generator: Source of all randomness (the global RNG is not used).
        size: Image height and width in pixels.

    Returns:
        Float32 images `(count, 1, size, size)` and int64 labels `(count, size, size)`.
    """

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(count, 1, 1, generator=generator)

    coords = torch.arange(size, dtype=torch.float32)
    rows, cols = coords.view(1, size, 1), coords.view(1, 1, size)
    # Background: a random level plus a linear gradient in a random direction.
    angle = uniform(0.0, 2 * torch.pi)
    ramp = (torch.cos(angle) * cols + torch.sin(angle) * rows) / size - 0.5
    background = uniform(-0.3, 0.3) + uniform(0.0, 0.6) * ramp
    images = background.expand(count, size, size).clone()
    labels = torch.zeros(count, size, size, dtype=torch.int64)

    n_shapes = torch.randint(1, _MAX_SHAPES + 1, (count, 1, 1), generator=generator)
    for slot in range(_MAX_SHAPES):
        kind = torch.randint(1, len(CLASSES), (count, 1, 1), generator=generator)
        radius = uniform(*_RADIUS)
        center_y = radius + uniform(0.0, 1.0) * (size - 1 - 2 * radius)
        center_x = radius + uniform(0.0, 1.0) * (size - 1 - 2 * radius)
        flip = torch.where(uniform(0.0, 1.0) < 0.5, -1.0, 1.0)  # triangles point up or down
        dy, dx = rows - center_y, cols - center_x
        circle = dx.square() + dy.square() <= radius.square()
        square = (dx.abs() <= _SQUARE * radius) & (dy.abs() <= _SQUARE * radius)
        tip = flip * dy
        triangle = (tip.abs() <= radius) & (dx.abs() <= (tip + radius) / 2)
        mask = torch.where(kind == 1, circle, torch.where(kind == 2, square, triangle))
        mask &= slot < n_shapes
        images = torch.where(mask, background + uniform(0.5, 1.0), images)
        labels = torch.where(mask, kind, labels)

    images += _NOISE_STD * torch.randn(count, size, size, generator=generator)
    return images.unsqueeze(1).contiguous(), labels.contiguous()


def _norm_layer(norm: str, channels: int) -> nn.Module:
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(_GROUPS, channels), channels)


class _ConvBlock(nn.Sequential):
    """Two (3x3 convolution, normalization, ReLU) layers."""

    def __init__(self, in_channels: int, out_channels: int, norm: str) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            _norm_layer(norm, out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            _norm_layer(norm, out_channels),
            nn.ReLU(),
        )


class UNet(nn.Module):
    """A two-level U-Net: 32x32 -> 16x16 -> 8x8 and back, with skip connections.

    Args:
        norm: `"batch"` for BatchNorm2d or `"group"` for GroupNorm (8 groups).
        width: Channels at full resolution; each level down doubles them.
        in_channels: Channels of the input images.
        classes: Number of output classes.
    """

    def __init__(
        self, norm: str = "batch", width: int = 16, in_channels: int = 1, classes: int = 4
    ) -> None:
        super().__init__()
        self.enc1 = _ConvBlock(in_channels, width, norm)
        self.enc2 = _ConvBlock(width, 2 * width, norm)
        self.middle = _ConvBlock(2 * width, 4 * width, norm)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _ConvBlock(4 * width, 2 * width, norm)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _ConvBlock(2 * width, width, norm)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Per-pixel class logits `(N, classes, H, W)` for images `(N, C, H, W)`."""
        skip1 = self.enc1(images)
        skip2 = self.enc2(F.max_pool2d(skip1, 2))
        x = self.middle(F.max_pool2d(skip2, 2))
        x = self.dec2(torch.cat([self.up2(x), skip2], dim=1))
        x = self.dec1(torch.cat([self.up1(x), skip1], dim=1))
        return self.head(x)


class ShapesTask:
    """The `shapes` task: 4-class segmentation, mIoU metric.

    Batches are tuples `(images, labels)`: float32 images `(N, 1, 32, 32)` and int64 labels
    `(N, 32, 32)` with values in 0..3.
    """

    name = "shapes"
    metric = "mIoU"
    higher_is_better = True
    reference_batch_size = 16
    default_batch_size = 16
    default_lr = 3e-3
    default_epochs = 10
    token_sequences = False

    def make_data(self, seed: int) -> TaskData:
        """Generate 400 training and 100 validation images from `seed`.

        Args:
            seed: Seeds the generator; the same seed gives identical tensors.

        Returns:
            `TaskData` whose `train` and `val` are `(images, labels)` tuples.
        """
        generator = torch.Generator().manual_seed(seed)
        images, labels = generate_shapes(_TRAIN_IMAGES + _VAL_IMAGES, generator)
        return TaskData(
            train=(images[:_TRAIN_IMAGES], labels[:_TRAIN_IMAGES]),
            val=(images[_TRAIN_IMAGES:], labels[_TRAIN_IMAGES:]),
        )

    def make_model(self, seed: int, norm: str = "batch") -> nn.Module:
        """Build the U-Net with weights drawn from `seed`; the caller's RNG state is untouched.

        Args:
            seed: Seeds the weight initialization.
            norm: `"batch"` (BatchNorm2d, not additive over micro-batches in train mode) or
                `"group"` (GroupNorm, per image, so accumulation is exact).

        Returns:
            A freshly initialized `UNet` in train mode.

        Raises:
            ValueError: If `norm` is not one of the choices.
        """
        if norm not in _NORMS:
            raise ValueError(
                f"norm={norm!r} is not available for the 'shapes' task; choose one of "
                f"{', '.join(_NORMS)}."
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return UNet(norm=norm)

    def loss_fn(self, model: nn.Module, batch: Any) -> LossSum:
        """Summed per-pixel cross-entropy of the micro-batch, counted in pixels."""
        images, labels = batch
        value = F.cross_entropy(model(images), labels, reduction="sum")
        return LossSum(value, labels.numel())

    def evaluate(self, model: nn.Module, val: Any, batch_size: int) -> dict[str, float]:
        """Validation mIoU and mean per-pixel cross-entropy, in eval mode without gradients.

        IoU is computed per class from one confusion matrix over the whole validation set;
        classes absent from both the labels and the predictions are left out of the mean.

        Args:
            model: The model to evaluate; its train/eval mode is restored afterwards.
            val: The `(images, labels)` validation tuple.
            batch_size: Images per forward pass.

        Returns:
            `{"metric": mIoU in [0, 1], "loss": mean per-pixel cross-entropy}`.
        """
        images, labels = val
        param = next(model.parameters())
        n_classes = len(CLASSES)
        confusion = torch.zeros(n_classes * n_classes, dtype=torch.int64)
        was_training = model.training
        model.eval()
        loss_sum = 0.0
        try:
            with torch.no_grad():
                for start in range(0, len(labels), batch_size):
                    x = images[start : start + batch_size].to(param.device, param.dtype)
                    y = labels[start : start + batch_size].to(param.device)
                    logits = model(x)
                    loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                    pairs = (y * n_classes + logits.argmax(dim=1)).flatten().cpu()
                    confusion += torch.bincount(pairs, minlength=n_classes * n_classes)
        finally:
            model.train(was_training)
        return {
            "metric": mean_iou(confusion.view(n_classes, n_classes)),
            "loss": loss_sum / labels.numel(),
        }


def mean_iou(confusion: torch.Tensor) -> float:
    """Mean IoU from a confusion matrix `confusion[true, predicted]`.

    Example:
        >>> mean_iou(torch.tensor([[3, 1], [0, 4]]))  # IoU 3/4 and 4/5
        0.775
    """
    confusion = confusion.to(torch.float64)
    hits = confusion.diagonal()
    union = confusion.sum(dim=0) + confusion.sum(dim=1) - hits
    present = union > 0
    return float((hits[present] / union[present]).mean()) if bool(present.any()) else 0.0
