"""Fine-tune a tiny Hugging Face Llama with gradaccum, one line per optimizer step.

Run it from the repository root (no download: the model is built from a config and the text
ships with the package); it needs the `[hf]` extra (`pip install -e '.[hf]'`; `make` installs it):

    .venv/bin/python examples/hf_finetune.py
    .venv/bin/python examples/hf_finetune.py --steps 80 --batch-size 64 --seed 1
    .venv/bin/python examples/hf_finetune.py --memory-budget 256MiB   # the batch in one piece

The bundled text is cut into rows of random lengths and right-padded, so the micro-batches of a
step hold different numbers of real tokens. `gradaccum.hf.causal_lm` runs the model without its
labels, shifts them as the model does and returns the summed loss with the count of tokens it
scored; the Accumulator divides once by the step's total count. Every step is therefore the same
update as one full-batch step, however "auto" splits the batch to fit `memory_budget`.

On CPU there is no free-memory figure, so `micro_batch_size="auto"` needs an explicit
`memory_budget`; the plan is measured on the first batch. The default 8 MiB splits a batch of
32 rows into four micro-batches (about 0.7 MiB of activations per row); 256 MiB holds the whole
batch at once, and the losses stay the same up to floating-point rounding.

The script exits 0 when the mean loss of the last five steps is below that of the first five,
else 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from importlib import resources

import torch

try:
    import transformers
except ModuleNotFoundError as missing:  # a newcomer's `pip install -e '.[cli,dev]'` lacks it
    print(
        f"examples/hf_finetune.py needs {missing.name}, which is not installed; install it with: "
        "pip install 'gradaccum[hf]' (see the README, section Installing)",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

from gradaccum import Accumulator, StepResult, hf

MIN_ROW, MAX_ROW = 24, 64  # characters per row, drawn uniformly
PAD_ID = 0
IGNORE_INDEX = -100
LOG_EVERY = 5


def load_text() -> str:
    """The project's bundled text, read from the installed package."""
    data = resources.files("gradaccum.experiments.tasks") / "data" / "charlm.txt"
    return data.read_text(encoding="utf-8")


def build_vocabulary(text: str) -> dict[str, int]:
    """Map each distinct character to an id; id 0 is reserved for padding."""
    return {char: index for index, char in enumerate(sorted(set(text)), start=PAD_ID + 1)}


def cut_rows(text: str, vocab: dict[str, int], generator: torch.Generator) -> list[torch.Tensor]:
    """Cut the text into consecutive rows of random lengths, each a tensor of token ids."""
    ids = torch.tensor([vocab[char] for char in text])
    rows: list[torch.Tensor] = []
    start = 0
    while start + MIN_ROW <= len(ids):
        length = int(torch.randint(MIN_ROW, MAX_ROW + 1, (1,), generator=generator))
        rows.append(ids[start : start + length])
        start += length
    return rows


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad rows to `MAX_ROW`; labels and attention mask ignore the padding."""
    input_ids = torch.full((len(rows), MAX_ROW), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def batches(
    rows: list[torch.Tensor], batch_size: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield padded batches of `batch_size` rows forever, reshuffling after each pass."""
    while True:
        order = torch.randperm(len(rows), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield collate([rows[i] for i in order[start : start + batch_size]])


def build_model(vocab_size: int) -> transformers.LlamaForCausalLM:
    """A two-layer Llama small enough to train on one CPU thread in well under a minute."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD_ID,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config)


def print_header(
    params: int,
    vocab_size: int,
    rows: int,
    args: argparse.Namespace,
    acc: Accumulator,
    result: StepResult,
) -> None:
    """What is trained, and the micro-batch size "auto" chose on the first batch."""
    per_row = acc.plan.activation_bytes_per_item / 2**20 if acc.plan is not None else float("nan")
    print(
        f"Llama with {params:,} parameters, vocab {vocab_size}, {rows} rows of text; "
        f"{args.batch_size} rows per step"
    )
    plural = "es" if result.micro_batches > 1 else ""
    print(
        f"auto micro_batch_size for {args.memory_budget}: {result.micro_batch_size} rows, "
        f"{result.micro_batches} micro-batch{plural} per step ({per_row:.2f} MiB per row)"
    )


def log(step: int, result: StepResult) -> None:
    """One line of the training log."""
    print(
        f"{step:>4}  {result.loss:>7.4f}  {result.count:>6}  "
        f"{result.micro_batch_size:>16}  {result.lr:.1e}"
    )


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per step (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data and model (default: 0)")
    parser.add_argument(
        "--memory-budget",
        default="8MiB",
        help='memory the "auto" micro-batch size plans for (default: 8MiB)',
    )
    args = parser.parse_args()
    if args.steps < 2 * LOG_EVERY or args.batch_size < 1:
        # The first and last LOG_EVERY steps are compared: they must not overlap.
        parser.error(f"--steps must be at least {2 * LOG_EVERY} and --batch-size at least 1")
    return args


def main() -> int:
    """Fine-tune, print the log and report whether the loss fell."""
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    generator = torch.Generator().manual_seed(args.seed)

    text = load_text()
    vocab = build_vocabulary(text)
    rows = cut_rows(text, vocab, generator)
    if len(rows) < args.batch_size:
        print(f"--batch-size {args.batch_size} exceeds the {len(rows)} rows", file=sys.stderr)
        return 2
    model = build_model(vocab_size=len(vocab) + 1)
    model.train()

    acc = Accumulator(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        micro_batch_size="auto",
        max_grad_norm=1.0,
        memory_budget=args.memory_budget,  # required on CPU: no free-memory figure to read
    )

    data = batches(rows, args.batch_size, generator)
    params = sum(p.numel() for p in model.parameters())
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        result = acc.step(next(data), hf.causal_lm)
        losses.append(result.loss)
        if step == 1:
            print_header(params, len(vocab) + 1, len(rows), args, acc, result)
            print(f"{'step':>4}  {'loss':>7}  {'tokens':>6}  {'micro_batch_size':>16}  lr")
        if step == 1 or step % LOG_EVERY == 0:
            log(step, result)

    first, last = sum(losses[:LOG_EVERY]) / LOG_EVERY, sum(losses[-LOG_EVERY:]) / LOG_EVERY
    fell = last < first
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; mean of first/last {LOG_EVERY} steps "
        f"{first:.4f} -> {last:.4f}: {'fell' if fell else 'did NOT fall'} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
