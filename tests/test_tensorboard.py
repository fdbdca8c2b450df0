"""gradaccum.experiments.tensorboard: metrics rows and validation metrics as TensorBoard scalars."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gradaccum.experiments.tensorboard import TensorBoardLog


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in `folder`'s event files, as (step, value) pairs in step order."""
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_rows_and_validation_are_written_as_scalars_at_their_steps(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "tensorboard"
    # Values exactly representable in float32, the precision of a TensorBoard scalar.
    rows = [
        {"step": 1, "samples": 16, "loss": 2.5, "lr": 0.0009765625, "grad_norm": None,
         "time": 0.25, "micro_batches": 2, "noise_scale": None},
        {"step": 2, "samples": 32, "loss": math.nan, "lr": 0.001953125, "grad_norm": 1.5,
         "time": 0.5, "micro_batches": 2},  # no noise_scale
        {"step": 3, "samples": 48, "loss": 1.75, "lr": 0.001953125, "grad_norm": math.inf,
         "time": 0.75, "micro_batches": 3, "stopped": True, "config": "8x2"},
    ]  # fmt: skip
    with TensorBoardLog(folder) as log:
        for row in rows:
            log.log_step(row)
        log.log_validation(2, "perplexity", 7.5)
        log.log_validation(3, "perplexity", 6.25)

    assert _scalars(folder) == {
        "train/samples": [(1, 16.0), (2, 32.0), (3, 48.0)],
        "train/loss": [(1, 2.5), (3, 1.75)],
        "train/lr": [(1, 0.0009765625), (2, 0.001953125), (3, 0.001953125)],
        "train/grad_norm": [(2, 1.5)],
        "train/time": [(1, 0.25), (2, 0.5), (3, 0.75)],
        "train/micro_batches": [(1, 2.0), (2, 2.0), (3, 3.0)],
        "validation/perplexity": [(2, 7.5), (3, 6.25)],
    }


def test_a_resumed_run_appends_a_file_and_keeps_both_values_of_a_repeated_step(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "tensorboard"
    with TensorBoardLog(folder) as log:  # interrupted after step 4, checkpoint at step 2
        for step in range(1, 5):
            log.log_step({"step": step, "loss": float(step)})
    with TensorBoardLog(folder) as log:  # resumed from the checkpoint
        for step in range(3, 6):
            log.log_step({"step": step, "loss": 10.0 * step})

    assert len(list(folder.iterdir())) == 2
    (loss,) = _scalars(folder).values()
    # As documented: both values of steps 3 and 4 are in the files (TensorBoard shows the newest).
    assert sorted(loss) == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 4.0), (4, 40.0), (5, 50.0)]


def test_missing_step_is_a_key_error(tmp_path: Path) -> None:
    with TensorBoardLog(tmp_path) as log, pytest.raises(KeyError, match="step"):
        log.log_step({"loss": 1.0})


def test_without_tensorboard_the_error_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'gradaccum\[tensorboard\]'"):
        TensorBoardLog(tmp_path / "tensorboard")
    assert not (tmp_path / "tensorboard").exists()


_WRITE_AND_REPORT = """
import sys
from pathlib import Path
{setup}
with TensorBoardLog(Path(sys.argv[1])) as log:
    log.log_step({{"step": 1, "loss": 2.5}})
print("tensorflow" in sys.modules)
"""


@pytest.mark.parametrize(
    ("setup", "imports_tensorflow"),
    [
        ("from gradaccum.experiments.tensorboard import TensorBoardLog", False),
        # Negative control: torch's writer imported plainly pulls in all of TensorFlow.
        (
            "from torch.utils.tensorboard import SummaryWriter\n"
            "from gradaccum.experiments.tensorboard import TensorBoardLog",
            True,
        ),
    ],
    ids=["ours", "plain-torch-import"],
)
def test_the_log_does_not_import_tensorflow_when_it_is_installed(
    tmp_path: Path, setup: str, imports_tensorflow: bool
) -> None:
    """With TensorFlow installed too (the keras extra), `train --tensorboard` once imported it
    through tensorboard.compat: about 15 s and TensorFlow's C++ log lines on stderr
    ("oneDNN custom operations are on ..."), for event files tensorboard's stub writes alike."""
    pytest.importorskip("tensorflow")
    folder = tmp_path / "tensorboard"
    script = _WRITE_AND_REPORT.format(setup=setup)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(imports_tensorflow)
    assert _scalars(folder) == {"train/loss": [(1, 2.5)]}
    if not imports_tensorflow:
        assert proc.stderr == ""
