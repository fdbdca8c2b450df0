"""Train a small classifier with gradaccum: a DataLoader, AdamW, a scheduler and checkpoints.

Run it (CPU, a few seconds):

    python examples/train_loop.py                            # 30 steps of a batch of 32
    python examples/train_loop.py --steps 10 --save ckpt.pt  # stop after 10 steps...
    python examples/train_loop.py --resume ckpt.pt           # ...and finish as if never stopped
    python examples/train_loop.py --precision bf16 --compile aot_eager

The DataLoader yields logical batches of `--batch-size` examples. `Accumulator.step()` splits each
one into micro-batches of `--micro-batch-size` (here 12 + 12 + 8: the last one is ragged) and
takes one optimizer step that equals the step on the whole batch. The loss function returns the
SUM of the loss and the COUNT of examples; the Accumulator divides once, by the batch's count.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradaccum import Accumulator, LossSum, load_checkpoint, save_checkpoint

FEATURES, CLASSES = 16, 4


def make_dataset(examples: int = 512, seed: int = 0) -> TensorDataset:
    """Points in 16 dimensions, labelled by which of 4 random directions they lean towards most."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(examples, FEATURES, generator=generator)
    directions = torch.randn(FEATURES, CLASSES, generator=generator)
    y = (x @ directions + 0.5 * torch.randn(examples, CLASSES, generator=generator)).argmax(dim=1)
    return TensorDataset(x, y)


class Classifier(nn.Module):
    """A two-layer MLP: 16 features -> 64 hidden -> 4 logits."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, hidden)
        self.out = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.hidden(x)))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    """Cross-entropy: the SUM over the micro-batch's examples and how many there are."""
    x, y = batch
    total = nn.functional.cross_entropy(model(x), y, reduction="sum")
    return LossSum(total, count=y.numel())


def batches(dataset: TensorDataset, batch_size: int, seed: int, skip: int) -> Iterator[list]:
    """Logical batches forever, reshuffled every epoch; the order depends on `seed` alone.

    Each epoch's shuffle has its own seed, so a resumed run can skip the `skip` batches it
    already trained on and see exactly the batches the uninterrupted run would have seen.
    """
    per_epoch = len(dataset) // batch_size  # drop_last: every step sees a full batch
    epoch, skip = divmod(skip, per_epoch)
    while True:
        order = torch.Generator().manual_seed(seed + epoch)
        loader = DataLoader(dataset, batch_size, shuffle=True, generator=order, drop_last=True)
        for index, batch in enumerate(loader):
            if index >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps in all")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=12, help="examples per backward")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--warmup", type=int, default=5, help="steps of linear warm-up")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="torch.compile the model's forward (default backend inductor; aot_eager is faster)",
    )
    parser.add_argument("--save", help="write a checkpoint here after the last step")
    parser.add_argument("--resume", help="continue from this checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="print the last step only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> nn.Module:
    """Train as the flags say; return the trained model."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # the initial weights
    model = Classifier()
    if args.compile:
        # Compiled in place: the state_dict keeps its keys, so checkpoints load either way. (Our
        # own forward is what gets compiled: an nn.Sequential of torch's layers would run eager.)
        # dynamic=True: one graph for every micro-batch size, the ragged last one included.
        model.compile(backend=args.compile, dynamic=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup)
    )
    acc = Accumulator(
        model,
        optimizer,
        micro_batch_size=args.micro_batch_size,
        scheduler=scheduler,  # stepped once per optimizer step, not per micro-batch
        max_grad_norm=args.max_grad_norm,  # clips the whole batch's gradient
        precision=args.precision,
    )

    start = 0
    if args.resume:
        extra = load_checkpoint(
            args.resume, model=model, optimizer=optimizer, accumulator=acc, scheduler=scheduler
        )
        start = extra["step"]
        print(f"resumed from {args.resume} after step {start}")

    data = batches(make_dataset(), args.batch_size, args.seed, skip=start)
    for step in range(start + 1, args.steps + 1):
        result = acc.step(next(data), loss_fn)  # one optimizer step, exact
        if not args.quiet or step == args.steps:
            print(
                f"step {step:3d}  loss {result.loss:.4f}  lr {result.lr:.2e}  "
                f"grad-norm {result.grad_norm:.3f}  micro-batches {result.micro_batches}"
            )

    if args.save:
        save_checkpoint(
            args.save,
            model=model,
            optimizer=optimizer,
            accumulator=acc,
            scheduler=scheduler,
            extra={"step": args.steps},
        )
        print(f"saved {args.save}")
    return model


if __name__ == "__main__":
    main()
