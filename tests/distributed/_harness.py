"""Run a function on N real processes joined in a gloo process group, with a hard timeout.

`spawn_ranks(fn, tmp_path, ...)` starts `world_size` processes with `torch.multiprocessing`
(start method "spawn"), each of which joins a gloo group through a TCP store that the parent
listens with on a port of 127.0.0.1 the system chose (held from before the spawn, so no other
process can take it while the ranks import torch, as a port merely found free could be), calls
`fn(rank, world_size, *args)` and writes what happened (the return value, or the exception with its
traceback) to a file in `tmp_path`. The parent waits at most `timeout` seconds, kills whatever is
still running after that, and returns one `RankOutcome` per rank. Nothing here can hang a test:
every collective is bounded by `pg_timeout`, and the whole run by `timeout`.

`fn` and its arguments must be picklable: a module-level function of an importable module.
One spawn costs a few seconds (each process imports torch), so a test should group its checks
into one call.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class RankOutcome:
    """What one rank did.

    Attributes:
        rank: The rank.
        result: `fn`'s return value (None if it raised or never finished).
        error_type: Qualified name of the exception `fn` raised, if any.
        error: `str()` of that exception.
        traceback: Its formatted traceback.
        exitcode: The process's exit code (None if it had to be killed).
    """

    rank: int
    result: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        """The rank returned normally and its process exited cleanly."""
        return self.error_type is None and self.exitcode == 0


class RanksTimedOutError(AssertionError):
    """Some rank was still running when the run's timeout expired (it was killed)."""


def fsdp_api() -> Any:
    """torch's FSDP2 module (`fully_shard`, `FSDPModule`, `MixedPrecisionPolicy`, ...).

    Public as `torch.distributed.fsdp` from torch 2.6; torch 2.4 and 2.5, the oldest gradaccum
    supports, keep it in `torch.distributed._composable.fsdp`.
    """
    public = importlib.import_module("torch.distributed.fsdp")
    if hasattr(public, "fully_shard"):
        return public
    return importlib.import_module("torch.distributed._composable.fsdp")


# gradaccum supports FSDP2 from torch 2.6: before, it is a CUDA-only prototype (refused).
needs_fsdp2 = pytest.mark.skipif(
    not dist.is_available()
    or not hasattr(importlib.import_module("torch.distributed.fsdp"), "FSDPModule"),
    reason=f"FSDP2 support needs torch 2.6 or later (this is torch {torch.__version__})",
)


def has_fsdp_method(name: str) -> bool:
    """Whether this torch's `FSDPModule` has method `name` (several are newer than torch 2.4)."""
    return hasattr(fsdp_api().FSDPModule, name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (another process may take it
    before it is bound again: `spawn_ranks` holds its store's port instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    pg_timeout: float,
    args: tuple[Any, ...],
) -> None:
    """Entry point of one spawned rank: join the group, run `fn`, record the outcome."""
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    outcome: dict[str, Any] = {}
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        # A client of the parent's store: the port has been listened on since before the spawn.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        outcome["result"] = fn(rank, world_size, *args)
    except BaseException as exc:  # recorded for the parent, which decides what it means
        outcome["error_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
        outcome["error"] = str(exc)
        outcome["traceback"] = traceback.format_exc()
    finally:
        path = Path(out_dir) / f"rank{rank}.pkl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as handle:
            pickle.dump(outcome, handle)
        tmp.replace(path)
        if dist.is_initialized() and "error_type" not in outcome:
            dist.destroy_process_group()
    # A rank whose peers failed may be left with pending gloo work; skip interpreter teardown.
    os._exit(0)


def spawn_ranks(
    fn: Callable[..., Any],
    tmp_path: Path,
    *args: Any,
    world_size: int = 2,
    timeout: float = 60.0,
    pg_timeout: float = 20.0,
) -> list[RankOutcome]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return every rank's outcome.

    Args:
        fn: A picklable (module-level) function.
        tmp_path: A fresh directory for the outcome files.
        *args: Picklable arguments passed after `(rank, world_size)`.
        world_size: Number of processes.
        timeout: Seconds the whole run may take; processes still alive then are killed.
        pg_timeout: The process group's timeout, which bounds every collective.

    Returns:
        One `RankOutcome` per rank, in rank order.

    Raises:
        RanksTimedOutError: If a rank was still running after `timeout` seconds.
    """
    out_dir = Path(tmp_path) / "ranks"
    out_dir.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    # The parent hosts the rendezvous store on a port the system picks and keeps it bound for the
    # whole run: a port found free, then bound by rank 0 seconds later (after importing torch),
    # could be taken in between by another process of a busy machine.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=pg_timeout),
        wait_for_workers=False,
    )
    port = store.port
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, str(out_dir), pg_timeout, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join(5.0)
    del store  # every rank is gone: the port is released
    outcomes = [
        _read_outcome(rank, out_dir, processes[rank].exitcode) for rank in range(world_size)
    ]
    if hung:
        raise RanksTimedOutError(
            f"ranks {hung} were still running after {timeout:.0f} s and were killed.\n"
            + describe(outcomes)
        )
    return outcomes


def run_ranks(fn: Callable[..., Any], tmp_path: Path, *args: Any, **kwargs: Any) -> list[Any]:
    """`spawn_ranks`, then require every rank to succeed; return the results in rank order.

    Raises:
        AssertionError: If any rank raised or died, with every rank's traceback.
    """
    outcomes = spawn_ranks(fn, tmp_path, *args, **kwargs)
    if not all(outcome.ok for outcome in outcomes):
        raise AssertionError("a rank failed:\n" + describe(outcomes))
    return [outcome.result for outcome in outcomes]


def describe(outcomes: list[RankOutcome]) -> str:
    """A readable account of every rank: exit code and error or 'ok'."""
    lines = []
    for outcome in outcomes:
        head = f"rank {outcome.rank} (exit code {outcome.exitcode}): "
        if outcome.error_type is not None:
            lines.append(head + f"{outcome.error_type}: {outcome.error}\n{outcome.traceback}")
        elif outcome.exitcode != 0:
            lines.append(head + "died without reporting (crash or kill)")
        else:
            lines.append(head + "ok")
    return "\n".join(lines)


def _read_outcome(rank: int, out_dir: Path, exitcode: int | None) -> RankOutcome:
    path = out_dir / f"rank{rank}.pkl"
    if not path.exists():
        return RankOutcome(rank, exitcode=exitcode)
    with open(path, "rb") as handle:
        data = pickle.load(handle)
    return RankOutcome(rank, exitcode=exitcode, **data)
