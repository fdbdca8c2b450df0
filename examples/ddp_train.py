"""Train a tiny next-token model on several CPU ranks with DDP and gradaccum's Accumulator.

Launch (one machine, two processes, gloo on CPU):

    torchrun --nproc_per_node 2 examples/ddp_train.py

Every rank holds its own shard of padded token sequences, so the ranks count different numbers of
tokens in each window. The model is wrapped in DistributedDataParallel and handed to the
Accumulator as it is: each window of micro-batches reduces gradients once, and the step is the
token mean over all ranks. Rank 0 prints the loss of every step; at the end, every rank's
parameters are gathered and compared.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum import Accumulator, LossSum

VOCAB = 24
SEQ_LEN = 12
IGNORE_INDEX = -100


class NextToken(nn.Module):
    """Embedding -> MLP -> logits over the vocabulary, one prediction per position."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


def make_dataset(sequences: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Padded sequences following `next = (5 * token + 3) % VOCAB`, of random lengths."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (sequences, 1), generator=generator)
    steps = [start]
    for _ in range(SEQ_LEN):
        steps.append((5 * steps[-1] + 3) % VOCAB)
    chain = torch.cat(steps, dim=1)
    tokens, labels = chain[:, :-1].clone(), chain[:, 1:].clone()
    lengths = torch.randint(2, SEQ_LEN + 1, (sequences,), generator=generator)
    padding = torch.arange(SEQ_LEN)[None, :] >= lengths[:, None]
    tokens[padding] = 0
    labels[padding] = IGNORE_INDEX
    return {"tokens": tokens, "labels": labels}


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """Token cross-entropy: the SUM over real tokens and their COUNT."""
    logits = model(batch["tokens"])
    labels = batch["labels"]
    total = nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return LossSum(total, count=(labels != IGNORE_INDEX).sum())


def parameters_identical(model: nn.Module) -> tuple[bool, float]:
    """Gather every rank's flattened parameters; return (all equal, largest difference)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    gap = max(float((other - gathered[0]).abs().max()) for other in gathered)
    return all(torch.equal(other, gathered[0]) for other in gathered), gap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per backward")
    parser.add_argument("--lr", type=float, default=0.03)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print("launch with torchrun: torchrun --nproc_per_node 2 examples/ddp_train.py")
        return 2

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # rank, world size and address come from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(NextToken())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    acc = Accumulator(model, optimizer, micro_batch_size=args.micro_batch_size)

    # One global dataset, sharded by rank; every rank takes the same number of sequences per
    # step, so every window holds the same number of micro-batches on every rank.
    data = make_dataset(args.steps * args.batch_size * world)
    shard = {key: value[rank::world] for key, value in data.items()}
    micro_batches = -(-args.batch_size // args.micro_batch_size)
    if rank == 0:
        print(
            f"{world} ranks (gloo, CPU); per rank: {args.batch_size} sequences per step in "
            f"{micro_batches} micro-batches of {args.micro_batch_size}"
        )
    for step in range(args.steps):
        window = slice(step * args.batch_size, (step + 1) * args.batch_size)
        result = acc.step({key: value[window] for key, value in shard.items()}, loss_fn)
        if rank == 0:
            print(
                f"step {step + 1:3d}  loss {result.loss:.4f}  tokens (all ranks) "
                f"{result.count:4d}  grad-norm {result.grad_norm:.3f}"
            )

    identical, gap = parameters_identical(model)
    if rank == 0:
        verdict = "yes" if identical else "NO"
        print(f"parameters identical across ranks: {verdict} (max abs difference {gap:.1e})")
    # Every rank done with its collectives before any tears the group down, and DDP's reducer
    # (which holds the group) gone first: gloo's threads torn down during interpreter exit were
    # seen to abort a rank (SIGABRT, "terminate called without an active exception") in CI.
    del acc, optimizer, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
