"""The settings file of a run folder: what `--resume` reads back to continue it.

`gradaccum train` writes `config.json` (one configuration); `gradaccum compare` writes
`compare.json` (the shared configuration and its list of configs). Both are a `RunSettings`.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> RunSettings(TrainConfig(task="digits", steps=3), threads=2).save(folder / "config.json")
    >>> RunSettings.load(folder / "config.json").threads
    2
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gradaccum.experiments._every import CheckpointEvery
from gradaccum.experiments._files import write_text_atomic
from gradaccum.experiments._resume import plain_config
from gradaccum.experiments.base import LrScaling, TrainConfig
from gradaccum.experiments.folders import FolderError

__all__ = ["RunSettings", "check_unchanged"]


@dataclass(frozen=True)
class RunSettings:
    """A run's configuration, checkpoint interval, threads, TensorBoard choice, compare configs.

    All are read back by `--resume`: a run started with `--tensorboard` goes on writing events.
    """

    config: TrainConfig
    checkpoint_every: CheckpointEvery | None = None
    threads: int = 1
    tensorboard: bool = False
    configs: tuple[str, ...] = ()

    def save(self, path: Path) -> None:
        """Write the settings to `path` as JSON, atomically."""
        settings = {
            "config": plain_config(self.config),
            "checkpoint_every": None
            if self.checkpoint_every is None
            else str(self.checkpoint_every),
            "threads": self.threads,
            "tensorboard": self.tensorboard,
            **({"configs": list(self.configs)} if self.configs else {}),
        }
        write_text_atomic(path, json.dumps(settings, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> RunSettings:
        """Read settings that `save` wrote.

        Raises:
            ValueError: If the file is damaged; the message names what is wrong.
        """
        try:
            settings = json.loads(path.read_text())
            plain = dict(settings["config"])
            plain["lr_scaling"] = LrScaling(plain["lr_scaling"])
            every = settings.get("checkpoint_every")
            threads = settings.get("threads", 1)
            if not isinstance(threads, int) or threads < 1:
                raise ValueError(f"threads={threads!r} is not a positive int")
            tensorboard = settings.get("tensorboard", False)  # absent from older files
            if not isinstance(tensorboard, bool):
                raise ValueError(f"tensorboard={tensorboard!r} is not true or false")
            return cls(
                TrainConfig(**plain),
                None if every is None else CheckpointEvery.parse(every),
                threads,
                tensorboard,
                tuple(str(label) for label in settings.get("configs", ())),
            )
        except (ValueError, KeyError, TypeError) as error:
            reason = " ".join(str(error).split())
            raise ValueError(f"{path.name} is damaged ({type(error).__name__}: {reason})") from None


def check_unchanged(folder: Path, config: TrainConfig, owner: Path) -> None:
    """Refuse a finished config `folder` of the compare in `owner` that no longer runs `config`.

    `gradaccum train --resume DIR/8x1 --steps N` extends a config of a compare in place; its row
    and its parameter gap would then compare runs of different lengths as if they were alike.

    Raises:
        FolderError: Naming the settings that differ and how to train the config again.
    """
    why = ""
    try:
        saved = plain_config(RunSettings.load(folder / "config.json").config)
    except OSError as error:
        saved, why = {}, f"its config.json cannot be read: {error.strerror or error}"
    except ValueError as error:  # "config.json is damaged (...)"
        saved, why = {}, str(error)
    expected = plain_config(config)
    differing = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
    if differing:
        reason = why if not saved else f"its config.json differs in: {', '.join(differing)}"
        raise FolderError(
            f"--resume {owner}: config {folder.name} no longer holds the compare's run ({reason}; "
            f"was it extended by `gradaccum train --resume`?); remove {folder} to train it again"
        )
