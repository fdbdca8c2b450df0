"""Factories for `gradaccum check --model tests.cli.factories:NAME`.

Each factory returns `(model, batch, loss_fn)`, built from fixed seeds so every call gives the
same tensors. Only plain PyTorch and `LossSum` are used.

- `additive`: token classifier on ragged, padded sequences; `LossSum(token sum, token count)`.
  Exact under any split.
- `token_mean`: the same model and batch, but the loss is the micro-batch's token MEAN returned
  as a scalar, which the library weights by the number of sequences: mean of means, the common
  user bug. Not exact, although no module mixes items (negative control).
- `max_normalized`: an MLP whose MSE is divided by the largest target of the micro-batch. Not
  exact.
- `batchnorm`: an MLP with BatchNorm1d in train mode. Not exact, and BatchNorm is to blame.
- `dropout`: an MLP with two Dropout layers in train mode: masks differ. Not exact.
- `softmax_shift`: additive, but one parameter's gradient is exactly 0 in exact arithmetic.

The rest are malformed on purpose, for the bad-input tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import LossSum

IGNORE_INDEX = -100
VOCAB, CLASSES, SEQ_LEN, SEQUENCES = 11, 5, 8, 10
FEATURES, ITEMS = 4, 10

Batch = tuple[torch.Tensor, torch.Tensor]


def ragged_tokens() -> Batch:
    """`SEQUENCES` token sequences of lengths 1..SEQ_LEN, right-padded; pads are ignored."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, VOCAB, (SEQUENCES, SEQ_LEN), generator=generator)
    labels = torch.randint(0, CLASSES, (SEQUENCES, SEQ_LEN), generator=generator)
    # Short and long lines alternate, so every micro-batch counts a different number of tokens.
    lengths = torch.tensor([1, 8, 2, 7, 1, 8, 3, 8, 2, 6])
    padding = torch.arange(SEQ_LEN)[None, :] >= lengths[:, None]
    return tokens.masked_fill(padding, 0), labels.masked_fill(padding, IGNORE_INDEX)


def token_model() -> nn.Module:
    """Embedding, Linear, Tanh, Linear: per-token logits, no mixing between sequences."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return nn.Sequential(
            nn.Embedding(VOCAB, 6), nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, CLASSES)
        )


def token_sum_loss(model: nn.Module, batch: Batch) -> LossSum:
    """Sum of token cross-entropies over non-pad tokens, counted in tokens (additive)."""
    tokens, labels = batch
    logits = model(tokens).flatten(0, 1)
    value = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return LossSum(value, (labels != IGNORE_INDEX).sum())


def token_mean_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The micro-batch's token mean as a plain scalar: read as a per-sequence mean (the bug)."""
    tokens, labels = batch
    logits = model(tokens).flatten(0, 1)
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX)


def regression_data() -> Batch:
    """`ITEMS` inputs and targets; targets span a wide range so micro-batch maxima differ."""
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(ITEMS, FEATURES, generator=generator)
    targets = torch.randn(ITEMS, 1, generator=generator) * torch.linspace(0.2, 3.0, ITEMS)[:, None]
    return inputs, targets


def mlp(batchnorm: bool = False) -> nn.Module:
    """Linear, (BatchNorm1d,) Tanh, Linear."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        norm: nn.Module = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
        return nn.Sequential(nn.Linear(FEATURES, 8), norm, nn.Tanh(), nn.Linear(8, 1))


def mse_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean squared error over the micro-batch's items (additive as a per-item mean)."""
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def max_normalized_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """MSE divided by the micro-batch's largest |target|: depends on the split."""
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets) / targets.abs().max()


def additive():
    return token_model(), ragged_tokens(), token_sum_loss


def token_mean():
    return token_model(), ragged_tokens(), token_mean_loss


def max_normalized():
    return mlp(), regression_data(), max_normalized_loss


def batchnorm():
    model = mlp(batchnorm=True)
    model.train()
    return model, regression_data(), mse_loss


class ShiftedLogits(nn.Module):
    """A linear classifier plus one scalar added to every logit.

    Softmax ignores a shift shared by all logits, so the scalar's gradient is exactly 0 in exact
    arithmetic, and float64 leaves only rounding noise (~1e-18) in it.
    """

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(6)
            self.linear = nn.Linear(FEATURES, CLASSES)
        self.shift = nn.Parameter(torch.zeros(1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs) + self.shift


def classification_data() -> Batch:
    generator = torch.Generator().manual_seed(8)
    inputs = torch.randn(ITEMS, FEATURES, generator=generator)
    return inputs, torch.randint(0, CLASSES, (ITEMS,), generator=generator)


def classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def softmax_shift():
    """Additive (a per-item mean cross-entropy, no mixing), with one zero-gradient parameter."""
    return ShiftedLogits(), classification_data(), classification_loss


def dropout():
    # Two dropout layers: the whole batch draws layer 1's masks then layer 2's, micro-batches
    # interleave them, so the masks differ. (With a single layer, CPU draws happen to line up.)
    model = nn.Sequential(
        nn.Linear(FEATURES, 8),
        nn.Dropout(0.5),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Dropout(0.5),
        nn.Tanh(),
        nn.Linear(8, 1),
    )
    model.train()
    return model, regression_data(), mse_loss


# Malformed factories (bad input, exit code 2).
NOT_CALLABLE = 42


def returns_two():
    return token_model(), ragged_tokens()


def returns_no_module():
    return "model", ragged_tokens(), token_sum_loss


def raises():
    raise RuntimeError("cannot build the model")


def ragged_batch():
    return token_model(), (torch.zeros(4, 3, dtype=torch.long), torch.zeros(5)), token_sum_loss


def bad_loss():
    return token_model(), ragged_tokens(), lambda model, batch: "not a loss"


def numpy_batch():
    """A newcomer's batch of numpy arrays, which the model cannot take: the error names the fix."""
    model = nn.Linear(4, 2)
    return model, np.zeros((6, 4), dtype=np.float32), lambda m, batch: m(batch).pow(2).mean()


def one_argument_loss():
    """A `loss_fn(batch)`: the message names the `(model, batch)` signature."""
    model = nn.Linear(4, 2)
    return model, torch.zeros(6, 4), lambda batch: model(batch).sum()


def frozen():
    """Every parameter frozen: nothing to train, so nothing to plan for."""
    model = token_model().requires_grad_(False)
    return model, ragged_tokens(), token_sum_loss


def exits():
    """A factory that ends the process as a script would (`sys.exit(0)`): no check was made."""
    raise SystemExit(0)


def tagged():
    """A loader-style dict batch: tensors, per-item ids and names, per-item numpy weights."""
    inputs, targets = regression_data()
    weights = np.linspace(0.5, 1.5, ITEMS)
    batch = {
        "x": inputs,
        "y": targets,
        "w": weights,
        "ids": list(range(ITEMS)),
        "names": [f"row{i}" for i in range(ITEMS)],
    }
    return mlp(), batch, tagged_loss


def tagged_loss(model: nn.Module, batch: dict[str, Any]) -> LossSum:
    """Weighted squared error summed over the items, counted by the ids."""
    if not len(batch["ids"]) == len(batch["names"]) == len(batch["w"]) == len(batch["x"]):
        raise ValueError("the batch's per-item fields disagree")
    weights = torch.as_tensor(batch["w"], dtype=batch["x"].dtype)[:, None]
    return LossSum((weights * (model(batch["x"]) - batch["y"]).pow(2)).sum(), len(batch["ids"]))
