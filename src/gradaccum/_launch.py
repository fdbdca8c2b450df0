"""Several processes started by a launcher (torchrun) that may never join a process group.

`torchrun --nproc_per_node 2 script.py` sets `WORLD_SIZE=2` in each process. A script (or the
`gradaccum` command line, which runs one process) that never calls `init_process_group` then
trains one model per process, each alone, and nothing said so: `sync.grad_sync_for` warns, and
the command line refuses such a launch.
"""

from __future__ import annotations

import os

__all__ = ["launched_processes", "refuse_several_processes"]


def launched_processes() -> int:
    """The launcher's `WORLD_SIZE` (1 without a launcher, or when it is not a number)."""
    world = os.environ.get("WORLD_SIZE", "1").strip()
    return int(world) if world.isdigit() and int(world) > 0 else 1


def refuse_several_processes(command: str, error: type[Exception]) -> None:
    """Raise `error` if `command` (of the command line) was launched as several processes.

    Raises:
        Exception: `error`, naming the fix, before anything runs or is written.
    """
    world = launched_processes()
    if world <= 1:
        return
    raise error(
        f"launched as {world} processes (WORLD_SIZE={world}, e.g. by torchrun), but '{command}' "
        "runs in one process and has no distributed mode: every process would run the whole "
        "command alone (no gradient shared) and write into the same folder. Run it as one "
        "process (python -m gradaccum ... without torchrun); for DDP or FSDP2, write a training "
        "script (README, 'Distributed (torchrun)'; examples/ddp_train.py)."
    )
