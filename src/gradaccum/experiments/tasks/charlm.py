"""`charlm`: a tiny character-level transformer language model on lines of a bundled text.

The text ships with the package (`data/charlm.txt`, about 600 short lines of plain English).
Each line is one sequence: the input is a begin-of-line token followed by the line's
characters, the target is the characters followed by an end-of-line token. Lines are right-padded
to the longest line; padded inputs hold the pad token and padded labels hold `IGNORE_INDEX`
(-100), so lines of different lengths contribute different numbers of tokens. The
`attention_mask` is 1 on a line's positions (begin-of-line and characters) and 0 on its padding,
so `gradaccum.packing.pack_by_tokens` reads each line's length (`gradaccum train --max-tokens`).
The model does not read the mask: its attention is causal, so real positions never see padding.

That is why this task exposes mean-of-means normalization: the loss is a `LossSum` (sum of the
token cross-entropies, count = tokens that are not padding), so a window divides by its total
token count. Averaging per-micro-batch token means instead (`naive_loss_fn`) weights tokens of
short-line micro-batches more than those of long-line ones. The metric is validation perplexity.

Example:
    >>> task = CharLMTask()
    >>> batch = task.make_data(seed=0).train
    >>> sorted(batch), batch["tokens"].shape == batch["labels"].shape
    (['attention_mask', 'labels', 'tokens'], True)
"""

from __future__ import annotations

import functools
import math
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradaccum.experiments.base import TaskData
from gradaccum.loss import LossSum

__all__ = ["IGNORE_INDEX", "CharLMTask", "CharTransformer", "decode", "encode", "load_lines"]

IGNORE_INDEX = -100
PAD, BOS, EOL = 0, 1, 2  # token ids of padding, begin-of-line and end-of-line
_SPECIALS = 3
_VAL_FRACTION = 0.15
_NORMS = ("batch", "none")


@functools.lru_cache(maxsize=1)
def load_lines() -> tuple[str, ...]:
    """The non-empty lines of the bundled text, read with `importlib.resources`."""
    text = resources.files(__package__).joinpath("data/charlm.txt").read_text(encoding="utf-8")
    return tuple(line for line in text.splitlines() if line.strip())


@functools.lru_cache(maxsize=1)
def _alphabet() -> tuple[str, ...]:
    return tuple(sorted(set("".join(load_lines()))))


def vocab_size() -> int:
    """Number of token ids: pad, begin-of-line, end-of-line and every character of the text."""
    return _SPECIALS + len(_alphabet())


def encode(line: str) -> list[int]:
    """Token ids of the characters of `line` (no special tokens).

    Example:
        >>> decode(encode("a cat"))
        'a cat'
    """
    index = {char: i + _SPECIALS for i, char in enumerate(_alphabet())}
    try:
        return [index[char] for char in line]
    except KeyError as error:
        raise ValueError(f"character {error.args[0]!r} is not in the charlm vocabulary") from None


def decode(ids: list[int]) -> str:
    """The text of character token ids; special tokens are dropped."""
    alphabet = _alphabet()
    return "".join(alphabet[i - _SPECIALS] for i in ids if i >= _SPECIALS)


def _pad_lines(lines: list[str], length: int) -> dict[str, torch.Tensor]:
    tokens = torch.full((len(lines), length), PAD, dtype=torch.int64)
    labels = torch.full((len(lines), length), IGNORE_INDEX, dtype=torch.int64)
    mask = torch.zeros((len(lines), length), dtype=torch.int64)
    for row, line in enumerate(lines):
        ids = encode(line)
        tokens[row, : len(ids) + 1] = torch.tensor([BOS, *ids])
        labels[row, : len(ids) + 1] = torch.tensor([*ids, EOL])
        mask[row, : len(ids) + 1] = 1
    return {"tokens": tokens, "labels": labels, "attention_mask": mask}


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, both residual."""

    def __init__(self, d_model: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(n, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, length, width))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """A small causal transformer over characters, with learned positions and no dropout.

    With right padding and causal attention, real tokens never attend to padding, and no layer
    mixes items of a batch, so accumulation over micro-batches is exact.

    Args:
        vocab: Number of token ids.
        max_len: Longest sequence the position table covers.
        d_model: Width of the residual stream.
        heads: Attention heads.
        layers: Transformer blocks.
    """

    def __init__(
        self, vocab: int, max_len: int, d_model: int = 64, heads: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads, 4 * d_model) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits `(N, T, vocab)` for token ids `(N, T)`."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _trimmed(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels cut to the longest line of the batch (the rest is padding)."""
    labels = batch["labels"]
    length = max(int((labels != IGNORE_INDEX).sum(dim=1).max()), 1)
    return batch["tokens"][:, :length], labels[:, :length]


class CharLMTask:
    """The `charlm` task: next-character prediction on padded lines, perplexity metric.

    Batches are dicts `{"tokens": (N, L), "labels": (N, L), "attention_mask": (N, L)}` of
    int64, right-padded to the longest line of the text; padded labels are `IGNORE_INDEX` and the
    mask is 1 on each line's positions, 0 on its padding.
    """

    name = "charlm"
    metric = "perplexity"
    higher_is_better = False
    reference_batch_size = 32
    default_batch_size = 32
    default_lr = 3e-3
    default_epochs = 8
    token_sequences = True

    def make_data(self, seed: int) -> TaskData:
        """Shuffle the lines with `seed` and split them 85/15 into train and validation.

        Args:
            seed: Seeds the shuffle; the same seed gives identical tensors.

        Returns:
            `TaskData` whose `train` and `val` are padded `{"tokens", "labels",
            "attention_mask"}` dicts.
        """
        lines = load_lines()
        order = torch.randperm(len(lines), generator=torch.Generator().manual_seed(seed))
        shuffled = [lines[i] for i in order.tolist()]
        n_val = round(len(lines) * _VAL_FRACTION)
        length = max(len(line) for line in lines) + 1
        return TaskData(
            train=_pad_lines(shuffled[n_val:], length), val=_pad_lines(shuffled[:n_val], length)
        )

    def make_model(self, seed: int, norm: str = "batch") -> nn.Module:
        """Build the transformer with weights drawn from `seed`; the caller's RNG is untouched.

        Args:
            seed: Seeds the weight initialization.
            norm: `"batch"` (the default) or `"none"`; both give the same model, which only
                uses LayerNorm (per token, so accumulation stays exact). GroupNorm is only
                offered by the `shapes` task.

        Returns:
            A freshly initialized `CharTransformer` in train mode.

        Raises:
            ValueError: If `norm` is not one of the choices.
        """
        if norm not in _NORMS:
            raise ValueError(
                f"norm={norm!r} is not available for the 'charlm' task, which only uses "
                "LayerNorm; leave norm at its default, 'batch' (it changes nothing here), or use "
                "the 'shapes' task, which offers norm='group'."
            )
        max_len = max(len(line) for line in load_lines()) + 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return CharTransformer(vocab_size(), max_len)

    def loss_fn(self, model: nn.Module, batch: Any) -> LossSum:
        """Sum of token cross-entropies over non-padding labels, counted in tokens."""
        tokens, labels = _trimmed(batch)
        logits = model(tokens)
        value = F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return LossSum(value, (labels != IGNORE_INDEX).sum())

    def naive_loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The common mistake, kept as a negative control: the micro-batch's token MEAN.

        Returned as a plain scalar, it is read as a per-line mean, so accumulation averages
        per-micro-batch token means (mean of means) instead of dividing by all tokens.
        """
        tokens, labels = _trimmed(batch)
        logits = model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    def evaluate(self, model: nn.Module, val: Any, batch_size: int) -> dict[str, float]:
        """Validation perplexity and mean token cross-entropy, in eval mode without gradients.

        Args:
            model: The model to evaluate; its train/eval mode is restored afterwards.
            val: The padded `{"tokens", "labels", "attention_mask"}` validation dict.
            batch_size: Lines per forward pass.

        Returns:
            `{"metric": exp(mean token cross-entropy), "loss": mean token cross-entropy}`.
        """
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        loss_sum, count = 0.0, 0
        try:
            with torch.no_grad():
                for start in range(0, len(val["labels"]), batch_size):
                    part = {k: v[start : start + batch_size].to(device) for k, v in val.items()}
                    result = self.loss_fn(model, part)
                    loss_sum += float(result.value)
                    count += int(result.count)
        finally:
            model.train(was_training)
        loss = loss_sum / max(count, 1)
        return {"metric": math.exp(loss), "loss": loss}
