"""`gradaccum demo`: exactness and memory saving of accumulation, shown with real numbers.

Everything is generated in code from a fixed seed; nothing is downloaded. The task is token
classification on sequences of random lengths, padded, with the padding ignored by the loss, so
micro-batches count different numbers of tokens: the case where "divide by the number of
accumulation steps" is wrong.

Three runs start from the same float64 weights, see the same batches and use the same AdamW:

1. the reference: one plain full-batch step per batch, `cross_entropy(reduction="mean")`, written
   without gradaccum;
2. `gradaccum.Accumulator` with `micro_batch_size`, reporting `LossSum(sum, tokens counted)`;
3. a negative control: the common loop that backpropagates each micro-batch's own token mean
   divided by the number of micro-batches.

It prints the largest relative parameter gap of runs 2 and 3 against run 1, and the activation
memory one forward holds for the full batch and for one micro-batch, measured with
`gradaccum.memory.measure_activation_bytes`.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from gradaccum import Accumulator, LossSum, split_batch
from gradaccum.memory import measure_activation_bytes

__all__ = ["EXACT_RTOL", "add_parser", "run"]

# A float64 gap below this is rounding; an algorithmic difference is orders of magnitude larger.
EXACT_RTOL = 1e-10

_VOCAB = 48
_EMBED = 32
_HIDDEN = 128
_MIN_LEN, _MAX_LEN = 4, 48
_LABEL_NOISE = 0.1
_IGNORE = -100
_LR = 1e-2
_WEIGHT_DECAY = 0.01

Batch = tuple[torch.Tensor, torch.Tensor]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `demo` command.

    Args:
        subparsers: The top-level parser's sub-parser collection.

    Returns:
        The `demo` sub-parser.
    """
    parser = subparsers.add_parser(
        "demo",
        help="show, with measured numbers, that accumulation equals full-batch training",
        description=(
            "Train a small token classifier on generated ragged sequences three ways (full "
            "batch, gradaccum.Accumulator, naive mean-of-means loop) in float64 and compare "
            "their parameters; then measure the activation memory of a full-batch forward and "
            "of a micro-batch forward. Nothing is downloaded. Exit 1 if the exactness check fails."
        ),
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=20, help="optimizer steps (default: 20)"
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=32,
        help="sequences per optimizer step, B (default: 32)",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=_positive_int,
        default=8,
        help="sequences per micro-batch (default: 8)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data and weight seed (default: 0)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its report.

    Args:
        args: Parsed options: `steps`, `batch_size`, `micro_batch_size`, `seed`.

    Returns:
        0 if the accumulated run matches the full-batch run to float64 rounding, else 1.
    """
    started = time.perf_counter()
    steps, size, micro, seed = args.steps, args.batch_size, args.micro_batch_size, args.seed
    n_micro = math.ceil(size / micro)
    batches = make_batches(steps, size, seed)
    model = make_model(seed)

    _print_setup(args, n_micro, model, batches[0])

    reference = copy.deepcopy(model)
    accumulated = copy.deepcopy(model)
    naive = copy.deepcopy(model)
    ref_losses = train_full_batch(reference, batches)
    acc_losses = train_accumulated(accumulated, batches, micro)
    naive_losses = train_naive(naive, batches, micro)
    acc_gap = max_relative_difference(accumulated, reference)
    naive_gap = max_relative_difference(naive, reference)
    exact = acc_gap < EXACT_RTOL

    print()
    print(f"1. Parameters after {steps} steps vs a plain full-batch run")
    print("   (same initial weights, batches and optimizer; float64)")
    print()
    _table_row("run", f"loss, step 1 -> {steps}", "max rel. param diff")
    _table_row("full batch (reference, plain PyTorch)", _trend(ref_losses), "-")
    _table_row(
        f"gradaccum.Accumulator ({n_micro} x {min(micro, size)})",
        _trend(acc_losses),
        f"{acc_gap:.3e}",
    )
    _table_row(
        f"naive: sum of micro-batch means / {n_micro}", _trend(naive_losses), f"{naive_gap:.3e}"
    )
    print()
    _print_verdict(acc_gap, naive_gap, n_micro)

    full_bytes, micro_bytes = measure_memory(model, batches[0], micro)
    print()
    print("2. Activation memory one forward holds until its backward, measured")
    print()
    _table_row(f"full batch ({size} sequences)", _format_bytes(full_bytes), "")
    _table_row(
        f"largest micro-batch ({min(micro, size)} sequences)", _format_bytes(micro_bytes), ""
    )
    _table_row("ratio full / micro", f"{full_bytes / micro_bytes:.2f}x", "")
    print()
    print("   Counted with torch.autograd.graph.saved_tensors_hooks: the distinct storages")
    print("   autograd saves for backward. Weights, gradients, optimizer state and the input")
    print("   batch are not included; they do not grow with the micro-batch.")
    print()
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0 if exact else 1


def _print_setup(args: argparse.Namespace, n_micro: int, model: nn.Module, first: Batch) -> None:
    steps, size, micro, seed = args.steps, args.batch_size, args.micro_batch_size, args.seed
    n_params = sum(p.numel() for p in model.parameters())
    first_tokens = [int(_count(labels)) for _, labels in split_batch(first, micro)]
    print("gradaccum demo: exact gradient accumulation, measured")
    print()
    _row(
        "task", f"token classification, vocab {_VOCAB}, {_LABEL_NOISE:.0%} label noise, seed {seed}"
    )
    _row("data", f"{steps} generated batches x {size} sequences of {_MIN_LEN}-{_MAX_LEN} tokens")
    _row("", "padded per batch; the loss ignores padding (ignore_index)")
    _row("model", f"Embedding-Linear-Tanh-Linear, {n_params:,} parameters, float64")
    _row("optimizer", f"AdamW(lr={_LR}, weight_decay={_WEIGHT_DECAY}), {steps} steps")
    _row("batch", f"B = {size} = {n_micro} micro-batches of up to {micro} sequences")
    _row("", f"tokens counted per micro-batch, step 1: {', '.join(map(str, first_tokens))}")


def _print_verdict(acc_gap: float, naive_gap: float, n_micro: int) -> None:
    print("   max rel. param diff: largest over tensors of max|p - p_ref| / max|p_ref|")
    if acc_gap < EXACT_RTOL:
        print(
            f"   verdict: EXACT. gradaccum equals the full-batch run to float64 rounding "
            f"({acc_gap:.1e} < {EXACT_RTOL:g})."
        )
    else:
        print(
            f"   verdict: MISMATCH. gradaccum differs from the full-batch run by {acc_gap:.1e}, "
            f"more than float64 rounding ({EXACT_RTOL:g})."
        )
    if n_micro == 1:
        print(
            "   negative control: with one micro-batch per step the naive loop is the full batch."
        )
        return
    print(
        f"   negative control: the naive loop is off by {naive_gap:.1e}. It weights every "
        "micro-batch alike,"
    )
    print(
        "   but they count different numbers of tokens (its loss column is its own mean of means)."
    )


def make_batches(steps: int, size: int, seed: int) -> list[Batch]:
    """Generate `steps` padded batches of ragged token sequences and their labels.

    Each token's label is a fixed hidden permutation of the token, replaced by a random label with
    probability `_LABEL_NOISE`. Padding positions hold token 0 and label `_IGNORE`.

    Args:
        steps: Number of batches.
        size: Sequences per batch.
        seed: Seed of the generator.

    Returns:
        `(tokens, labels)` pairs, each of shape `(size, longest sequence in the batch)`.
    """
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.randperm(_VOCAB, generator=gen)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(_MIN_LEN, _MAX_LEN + 1, (size,), generator=gen)
        width = int(lengths.max())
        tokens = torch.randint(1, _VOCAB, (size, width), generator=gen)
        labels = mapping[tokens]
        noisy = torch.rand(size, width, generator=gen) < _LABEL_NOISE
        labels = torch.where(noisy, torch.randint(0, _VOCAB, (size, width), generator=gen), labels)
        padding = torch.arange(width)[None, :] >= lengths[:, None]
        batches.append((tokens.masked_fill(padding, 0), labels.masked_fill(padding, _IGNORE)))
    return batches


def make_model(seed: int) -> nn.Module:
    """The per-token classifier, in float64, with weights drawn from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Embedding(_VOCAB, _EMBED),
            nn.Linear(_EMBED, _HIDDEN),
            nn.Tanh(),
            nn.Linear(_HIDDEN, _VOCAB),
        )
    return model.double()


def token_loss_sum(model: nn.Module, batch: Batch) -> LossSum:
    """Summed cross-entropy over the non-padding tokens, and how many there are."""
    tokens, labels = batch
    logits = model(tokens)
    total = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=_IGNORE, reduction="sum"
    )
    return LossSum(total, _count(labels))


def train_full_batch(model: nn.Module, batches: Iterable[Batch]) -> list[float]:
    """Plain PyTorch, no gradaccum: one mean-loss backward and one step per whole batch."""
    optimizer = _optimizer(model)
    losses = []
    for tokens, labels in batches:
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=_IGNORE)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train_accumulated(model: nn.Module, batches: Iterable[Batch], micro: int) -> list[float]:
    """`gradaccum.Accumulator.step` on each batch, split into micro-batches of `micro`."""
    acc = Accumulator(model, _optimizer(model), micro_batch_size=micro)
    losses = []
    for batch in batches:
        result = acc.step(batch, token_loss_sum)
        if not result.stepped:
            raise RuntimeError(f"the Accumulator did not step: {result}")
        losses.append(result.loss)
    return losses


def train_naive(model: nn.Module, batches: Iterable[Batch], micro: int) -> list[float]:
    """The common loop: each micro-batch's own mean loss, divided by the number of micro-batches.

    This weights every micro-batch alike, whatever its token count, so it differs from the
    full-batch token mean when micro-batches count different numbers of tokens.
    """
    optimizer = _optimizer(model)
    losses = []
    for tokens, labels in batches:
        starts = range(0, len(tokens), micro)
        window_loss = 0.0
        for start in starts:
            logits = model(tokens[start : start + micro])
            mean = F.cross_entropy(
                logits.flatten(0, 1), labels[start : start + micro].flatten(), ignore_index=_IGNORE
            )
            (mean / len(starts)).backward()
            window_loss += mean.item() / len(starts)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(window_loss)
    return losses


def max_relative_difference(model: nn.Module, reference: nn.Module) -> float:
    """Largest over parameter tensors of `max|a - b| / max|b|` (b: the reference)."""
    worst = 0.0
    for (name, a), (_, b) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        scale = float(b.detach().abs().max())
        gap = float((a.detach() - b.detach()).abs().max())
        if scale == 0.0 and gap > 0.0:
            raise ValueError(f"reference parameter {name} is all zeros; no relative gap exists")
        worst = max(worst, gap / scale if scale else 0.0)
    return worst


def measure_memory(model: nn.Module, batch: Batch, micro: int) -> tuple[int, int]:
    """Activation bytes of a full-batch forward and of the largest micro-batch forward."""
    full = measure_activation_bytes(model, batch, token_loss_sum)
    largest = max(
        measure_activation_bytes(model, micro_batch, token_loss_sum)
        for micro_batch in split_batch(batch, micro)
    )
    return full, largest


_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def _format_bytes(count: int) -> str:
    for name, size in _UNITS:
        if count >= size:
            return f"{count / size:.1f} {name} ({count:,} bytes)"
    return f"{count:,} bytes"


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=_WEIGHT_DECAY)


def _count(labels: torch.Tensor) -> torch.Tensor:
    return (labels != _IGNORE).sum()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _trend(losses: list[float]) -> str:
    return f"{losses[0]:.6f} -> {losses[-1]:.6f}"


def _row(label: str, value: str) -> None:
    print(f"  {label:<10} {value}".rstrip())


def _table_row(first: str, second: str, third: str) -> None:
    print(f"  {first:<40} {second:<28} {third}".rstrip())
