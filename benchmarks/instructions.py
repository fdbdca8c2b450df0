"""Overhead in CPU instructions, not seconds: `Accumulator.step` vs the hand loop, under callgrind.

Timing on a shared 2-core machine has a noise floor of a few percent (`overhead.py`'s A/A row), as
large as the overhead we want to bound. `valgrind --tool=callgrind` counts the instructions a
process executes instead, which is repeatable whatever else the machine runs. Only the timed
steps are counted: the child runs them inside `itertools.takewhile` (as its predicate), and
callgrind collects only while CPython's `takewhile_next` runs (`--collect-atstart=no
--toggle-collect=takewhile_next`; neither torch's hot paths nor the library use `takewhile`), so
Python start-up, `import torch`, building the model, the warm-up steps and the exit count nothing.

    instructions per step = instructions inside the `steps` timed steps / steps

Same models, batches and loops as `benchmarks/overhead.py` (the hand loop is its correct loop,
which reads nothing back; "hand, checked" adds loss logging and a finite-gradient check, what our
boundary does). One thread.

Instructions are not time: a cache miss costs more than an add. But the library adds Python and
a few small tensor operations, not memory traffic, so the instruction ratio bounds its cost well.

Three things made counts of identical code differ between runs, and are pinned in each child:
- a full garbage collection (a scan of every object alive, torch's modules included) falling
  inside the counted steps or not, which moved a loop's count by up to 70%: after warm-up the
  child collects and freezes what is alive (`gc.freeze()`); the objects the steps make are still
  collected, so the library's own allocations are still paid for;
- Python's string hashes, salted per process, which decide which attribute names collide in the
  interpreter's type-attribute cache (a collision turns a cached lookup into a walk of the class
  dicts: 0.06 M vs 0.58 M instructions per step in `unicodekeys_lookup_unicode` between two runs
  of the same step): `PYTHONHASHSEED` is set (`--hash-seeds`, a row per seed);
- OpenBLAS's idle worker threads (NumPy's), which spin a varying amount: `OPENBLAS_NUM_THREADS=1`.

Usage:
    .venv/bin/python benchmarks/instructions.py [--steps N] [--cases cnn,lm,linears]   # ~15 minutes
        [--hash-seeds 0,1,2] [--contenders ours,hand,checked] [--cache-sim]
    (`linears`: a cheap 28-tensor model where the library's own work is a large share, ~4 minutes)
    (internal) benchmarks/instructions.py --child CASE CONTENDER STEPS
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
CONTENDERS = ("ours", "hand", "hand, checked")


def linears_case() -> Any:
    """A case whose compute costs little, so that the library's own work is a large share.

    14 `nn.Linear(8, 8)` (28 parameter tensors, as many as `overhead.py`'s LM), batch 32 in
    micro-batches of 8, a `LossSum` of summed cross-entropy and a counted `(y != -100).sum()`;
    the hand loop divides each micro-batch's sum by the batch's count (SGD: see `child`).
    """
    import torch.nn.functional as F

    from gradaccum import LossSum
    from overhead import Case

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 8, (32,), generator=gen)

    def loss_fn(model: torch.nn.Module, batch: Any) -> LossSum:
        inputs, labels = batch
        summed = F.cross_entropy(model(inputs), labels, reduction="sum")
        return LossSum(summed, (labels != -100).sum())

    def hand_step(
        model: torch.nn.Module, opt: Any, batch: Any, micro: int, checked: bool = False
    ) -> None:
        inputs, labels = batch
        tokens = (labels != -100).sum()
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros(())
        for start in range(0, inputs.shape[0], micro):
            xb, yb = inputs[start : start + micro], labels[start : start + micro]
            summed = F.cross_entropy(model(xb), yb, reduction="sum")
            (summed / tokens).backward()
            if checked:
                loss_sum += summed.detach()
        if checked:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            if not (math.isfinite(float(loss_sum)) and math.isfinite(float(norm))):
                return
        opt.step()

    def make_model() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(14)])

    return Case("linears", "14 x Linear(8, 8)", make_model, (x, y), 32, 8, loss_fn, hand_step)


def child(case_name: str, contender: str, steps: int) -> None:
    """Build the case, warm up, run `steps` steps (the process under callgrind)."""
    sys.path.insert(0, str(HERE))
    from gradaccum import Accumulator
    from overhead import make_cases, new_optimizer

    torch.set_num_threads(1)
    cases = [*make_cases(), linears_case()]
    case = next(c for c in cases if c.name == case_name)
    torch.manual_seed(2)
    model = case.make_model()
    # The cheap case steps SGD: AdamW's per-parameter Python would dwarf what is measured.
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if case.name == "linears" else None
    opt = opt or new_optimizer(model)
    acc = Accumulator(model, opt, micro_batch_size=case.micro)
    steps_by_name = {
        "ours": lambda: acc.step(case.batch, case.loss_fn),
        "hand": lambda: case.hand_step(model, opt, case.batch, case.micro),
        "hand, checked": lambda: case.hand_step(model, opt, case.batch, case.micro, checked=True),
    }
    step = steps_by_name[contender]
    for _ in range(3):
        step()
    # Everything alive now (torch's modules, the model) moves out of the collector's generations:
    # a full collection scans the whole heap, and whether one falls inside the counted steps
    # depends on the hash seed, which moved a loop's count by up to 70%. Young objects, those the
    # steps make, are still collected as usual.
    gc.collect()
    gc.freeze()
    # Only the steps are counted: callgrind collects while `takewhile_next` (a C function of
    # CPython's itertools that neither torch's hot paths nor the library call) runs, and the
    # steps run inside it, as its predicate. Start-up, imports, warm-up and exit cost nothing.
    for _ in itertools.takewhile(lambda _: step() or True, range(steps)):
        pass


def count(case_name: str, contender: str, steps: int, hash_seed: int, cache: bool = False) -> int:
    """Instructions of one child process under callgrind, its string hashes seeded `hash_seed`.

    With `cache`, callgrind also simulates the caches (`--cache-sim=yes`, the host's geometry)
    and the branch predictors (`--branch-sim=yes`), and the figure is its cycle estimate
    instead: instructions + 10 x (first-level misses + mispredicted branches) + 100 x
    last-level misses (KCachegrind's "CEst"), which charges memory traffic as well.
    """
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "callgrind.out"
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=takewhile_next",
                *(["--cache-sim=yes", "--branch-sim=yes"] if cache else []),
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
            env=env,
        )
    match = re.search(r"Collected : ([\d ]+)", done.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no count:\n{done.stderr[-2000:]}")
    events = [int(n) for n in match.group(1).split()]
    if not cache:
        return events[0]
    # Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw, then Bc Bcm Bi Bim
    missed_branches = events[10] + events[12]
    return events[0] + 10 * (sum(events[3:6]) + missed_branches) + 100 * sum(events[6:9])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cases", default="cnn,lm")
    parser.add_argument("--hash-seeds", default="0", help="PYTHONHASHSEED values, one row each")
    parser.add_argument("--contenders", default="ours,hand,checked", help="checked: hand, checked")
    parser.add_argument("--cache-sim", action="store_true", help="cycle estimate with cache misses")
    parser.add_argument("--child", nargs=3, metavar=("CASE", "CONTENDER", "STEPS"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    contenders = [{"checked": "hand, checked"}.get(c, c) for c in args.contenders.split(",")]
    if "hand" not in contenders or not set(contenders) <= set(CONTENDERS):
        parser.error("--contenders must include 'hand', from ours,hand,checked")
    print(f"$ {' '.join(['python', *sys.argv])}")
    print(f"torch {torch.__version__}, 1 thread; per step = instructions inside {args.steps} "
          f"steps (after 3 warm-up steps) / {args.steps}\n")  # fmt: skip
    unit = "estimated cycles / step" if args.cache_sim else "instructions / step"
    print(f"| model | PYTHONHASHSEED | contender | {unit} | vs hand |")
    print("|---|---:|---|---:|---:|")
    for case_name in args.cases.split(","):
        for seed in map(int, args.hash_seeds.split(",")):
            with ThreadPoolExecutor(len(contenders)) as pool:  # counts do not mind sharing CPUs
                runs = {
                    c: pool.submit(count, case_name, c, args.steps, seed, args.cache_sim)
                    for c in contenders
                }
            per_step = {c: run.result() / args.steps for c, run in runs.items()}
            for contender in contenders:
                ratio = per_step[contender] / per_step["hand"]
                cells = f"{case_name} | {seed} | {contender} | {per_step[contender]:,.0f}"
                print(f"| {cells} | {ratio:.4f} |", flush=True)
            if "ours" in per_step:
                extra = per_step["ours"] - per_step["hand"]
                print(f"| {case_name} | {seed} | ours - hand | {extra:,.0f} | |", flush=True)


if __name__ == "__main__":
    main()
