"""`digits`: scikit-learn's bundled 8x8 handwritten digits with a small CNN.

The 1,797 images ship with scikit-learn (nothing is downloaded). They are scaled to [0, 1] and
split 80/20 into train and validation sets by a seeded permutation. The model has no
normalization layer, so accumulating micro-batches gives exactly the full-batch gradient. The
loss is the per-image mean cross-entropy, which the library weights by the micro-batch's number
of images; the metric is validation accuracy.

Example:
    >>> task = DigitsTask()
    >>> data = task.make_data(seed=0)
    >>> data.train[0].shape[1:], data.train[0].dtype
    (torch.Size([1, 8, 8]), torch.float32)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum._install import install_hint
from gradaccum.experiments.base import TaskData

__all__ = ["DigitsCNN", "DigitsTask"]

_NUM_CLASSES = 10
_VAL_FRACTION = 0.2
_NORMS = ("batch", "none")


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool and a two-layer classifier head (~40k weights).

    Args:
        channels: Channels of the first convolution; the second has twice as many.
        hidden: Width of the hidden fully connected layer.
    """

    def __init__(self, channels: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, _NUM_CLASSES),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits `(N, 10)` for images `(N, 1, 8, 8)`."""
        return self.classifier(self.features(images))


class DigitsTask:
    """The `digits` task: 8x8 digit classification, accuracy metric.

    Batches are tuples `(images, labels)`: float32 images `(N, 1, 8, 8)` in [0, 1] and int64
    labels `(N,)`.
    """

    name = "digits"
    metric = "accuracy"
    higher_is_better = True
    reference_batch_size = 32
    default_batch_size = 32
    default_lr = 3e-3
    default_epochs = 3
    token_sequences = False

    def make_data(self, seed: int) -> TaskData:
        """Load the bundled digits and split them 80/20 with a permutation drawn from `seed`.

        Args:
            seed: Seeds the train/validation split; the same seed gives identical tensors.

        Returns:
            `TaskData` whose `train` and `val` are `(images, labels)` tuples.

        Raises:
            ImportError: If scikit-learn is not installed.
        """
        try:
            from sklearn.datasets import load_digits
        except ImportError as error:
            raise ImportError(
                "the 'digits' task needs scikit-learn, which bundles the data set; "
                + install_hint("cli")
            ) from error
        bunch = load_digits()
        images = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
        labels = torch.as_tensor(bunch.target, dtype=torch.int64)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        n_val = round(len(labels) * _VAL_FRACTION)
        val_index, train_index = order[:n_val], order[n_val:]
        return TaskData(
            train=(images[train_index].contiguous(), labels[train_index].contiguous()),
            val=(images[val_index].contiguous(), labels[val_index].contiguous()),
        )

    def make_model(self, seed: int, norm: str = "batch") -> nn.Module:
        """Build the CNN with weights drawn from `seed`; the caller's RNG state is untouched.

        Args:
            seed: Seeds the weight initialization.
            norm: `"batch"` (the default) or `"none"`; both give the same model, which has no
                normalization layer. GroupNorm is only offered by the `shapes` task.

        Returns:
            A freshly initialized `DigitsCNN` in train mode.

        Raises:
            ValueError: If `norm` is not one of the choices.
        """
        if norm not in _NORMS:
            raise ValueError(
                f"norm={norm!r} is not available for the 'digits' task, whose CNN has no "
                "normalization layer; leave norm at its default, 'batch' (it changes nothing "
                "here), or use the 'shapes' task, which offers norm='group'."
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return DigitsCNN()

    def loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy over the micro-batch's images (weighted by its image count)."""
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def evaluate(self, model: nn.Module, val: Any, batch_size: int) -> dict[str, float]:
        """Validation accuracy and mean cross-entropy, in eval mode without gradients.

        Args:
            model: The model to evaluate; its train/eval mode is restored afterwards.
            val: The `(images, labels)` validation tuple.
            batch_size: Images per forward pass.

        Returns:
            `{"metric": accuracy in [0, 1], "loss": mean cross-entropy}`.
        """
        images, labels = val
        param = next(model.parameters())
        was_training = model.training
        model.eval()
        loss_sum, correct = 0.0, 0
        try:
            with torch.no_grad():
                for start in range(0, len(labels), batch_size):
                    x = images[start : start + batch_size].to(param.device, param.dtype)
                    y = labels[start : start + batch_size].to(param.device)
                    logits = model(x)
                    loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                    correct += int((logits.argmax(dim=1) == y).sum())
        finally:
            model.train(was_training)
        return {"metric": correct / len(labels), "loss": loss_sum / len(labels)}
