"""Overhead in CPU instructions, not seconds: `Accumulator.step` vs the hand loop, under callgrind.

Timing on a shared 2-core machine has a noise floor of a few percent (`overhead.py`'s A/A row), as
large as the overhead we want to bound. `valgrind --tool=callgrind` counts the instructions a
process executes instead, which is repeatable whatever else the machine runs. The count still
includes one-off work (Python start-up, `import torch`, building the model, warm-up steps), so
each contender runs twice, for `steps` and for `2 * steps` timed steps, and

    instructions per step = (count(2 * steps) - count(steps)) / steps

cancels everything but the steps. Same models, batches and loops as `benchmarks/overhead.py`
(the hand loop is its correct loop, which reads nothing back; "hand, checked" adds loss logging
and a finite-gradient check, what our boundary does). One thread.

Instructions are not time: a cache miss costs more than an add. But the library adds Python and
a few small tensor operations, not memory traffic, so the instruction ratio bounds its cost well.

Usage:
    .venv/bin/python benchmarks/instructions.py [--steps N] [--cases cnn,lm]   # ~10 minutes
    (internal) benchmarks/instructions.py --child CASE CONTENDER STEPS
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CONTENDERS = ("ours", "hand", "hand, checked")


def child(case_name: str, contender: str, steps: int) -> None:
    """Build the case, warm up, run `steps` steps (the process under callgrind)."""
    sys.path.insert(0, str(HERE))
    from gradaccum import Accumulator
    from overhead import make_cases, new_optimizer

    torch.set_num_threads(1)
    case = next(c for c in make_cases() if c.name == case_name)
    torch.manual_seed(2)
    model = case.make_model()
    opt = new_optimizer(model)
    acc = Accumulator(model, opt, micro_batch_size=case.micro)
    steps_by_name = {
        "ours": lambda: acc.step(case.batch, case.loss_fn),
        "hand": lambda: case.hand_step(model, opt, case.batch, case.micro),
        "hand, checked": lambda: case.hand_step(model, opt, case.batch, case.micro, checked=True),
    }
    step = steps_by_name[contender]
    for _ in range(3):
        step()
    for _ in range(steps):
        step()


def count(case_name: str, contender: str, steps: int) -> int:
    """Instructions of one child process under callgrind."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                case_name,
                contender,
                str(steps),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no count:\n{done.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cases", default="cnn,lm")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "CONTENDER", "STEPS"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    print(f"$ {' '.join(['python', *sys.argv])}")
    print(f"torch {torch.__version__}, 1 thread; per step = (count({2 * args.steps} steps) - "
          f"count({args.steps} steps)) / {args.steps}\n")  # fmt: skip
    print("| model | contender | instructions / step | vs hand |")
    print("|---|---|---:|---:|")
    for case_name in args.cases.split(","):
        per_step = {}
        for contender in CONTENDERS:
            short = count(case_name, contender, args.steps)
            long = count(case_name, contender, 2 * args.steps)
            per_step[contender] = (long - short) / args.steps
        for contender in CONTENDERS:
            ratio = per_step[contender] / per_step["hand"]
            print(f"| {case_name} | {contender} | {per_step[contender]:,.0f} | {ratio:.4f} |")
        extra = per_step["ours"] - per_step["hand"]
        print(f"| {case_name} | ours - hand | {extra:,.0f} | |")


if __name__ == "__main__":
    main()
