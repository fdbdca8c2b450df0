"""Tiny models, data generators and loss functions shared by the tests.

Everything here is plain PyTorch (no gradaccum import except `LossSum`, the return type the
library reads), small enough that a test with hundreds of forward/backward passes stays fast.

Data generators take a `torch.Generator` so that every test draws its own reproducible data
without touching the global RNG.
"""

from __future__ import annotations

import torch
from torch import nn

from gradaccum import LossSum

IGNORE_INDEX = -100
VOCAB = 17
NUM_CLASSES = 7
SEQ_LEN = 9


class TokenModel(nn.Module):
    """Embedding + Linear + Tanh + Linear: per-token logits, no mixing between items."""

    def __init__(
        self, vocab: int = VOCAB, dim: int = 6, hidden: int = 10, classes: int = NUM_CLASSES
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, hidden)
        self.act = nn.Tanh()
        self.out = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.hidden(self.embed(tokens))))


class MLP(nn.Module):
    """Linear + Tanh + Linear for scalar (per-sample mean) losses."""

    def __init__(self, features: int = 5, hidden: int = 12, outputs: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BatchNormMLP(nn.Module):
    """An MLP with BatchNorm1d: not additive over micro-batches in train mode."""

    def __init__(self, features: int = 5, hidden: int = 12, outputs: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.bn(self.fc1(x))))


def make_model(kind: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """Build a freshly initialized tiny model (`"token"`, `"mlp"` or `"bn"`) in `dtype`."""
    builders = {"token": TokenModel, "mlp": MLP, "bn": BatchNormMLP}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = builders[kind]()
    return model.to(dtype)


def token_batch(
    generator: torch.Generator,
    size: int,
    seq_len: int = SEQ_LEN,
    min_len: int = 1,
) -> dict[str, torch.Tensor]:
    """A padded batch of token sequences with a different length per sequence.

    Returns:
        `{"tokens": (size, seq_len) long, "labels": (size, seq_len) long}`; positions past a
        sequence's length hold token 0 and label `IGNORE_INDEX`.
    """
    lengths = torch.randint(min_len, seq_len + 1, (size,), generator=generator)
    tokens = torch.randint(1, VOCAB, (size, seq_len), generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (size, seq_len), generator=generator)
    padding = torch.arange(seq_len)[None, :] >= lengths[:, None]
    tokens[padding] = 0
    labels[padding] = IGNORE_INDEX
    return {"tokens": tokens, "labels": labels}


def regression_batch(
    generator: torch.Generator,
    size: int,
    dtype: torch.dtype = torch.float64,
    features: int = 5,
    outputs: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, y)` with `x` of shape (size, features) and `y` of shape (size, outputs)."""
    x = torch.randn(size, features, generator=generator, dtype=dtype)
    y = torch.randn(size, outputs, generator=generator, dtype=dtype)
    return x, y


def token_sum_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """Token cross-entropy as `LossSum(sum over real tokens, number of real tokens)`."""
    logits = model(batch["tokens"])
    labels = batch["labels"]
    value = nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return LossSum(value, (labels != IGNORE_INDEX).sum())


def token_mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token cross-entropy averaged over the batch's real tokens (what users usually write)."""
    logits = model(batch["tokens"])
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    )


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Plain scalar mean-squared error over the batch (a mean over samples and outputs)."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def concat_batches(batches: list):
    """Concatenate batches of the same structure (dict or tuple of tensors) along dim 0."""
    first = batches[0]
    if isinstance(first, dict):
        return {key: torch.cat([b[key] for b in batches]) for key in first}
    return tuple(torch.cat(parts) for parts in zip(*batches, strict=True))


def slice_batch(batch, start: int, stop: int):
    """Items `start:stop` of a dict or tuple batch, without the library's splitter."""
    if isinstance(batch, dict):
        return {key: value[start:stop] for key, value in batch.items()}
    return tuple(value[start:stop] for value in batch)
