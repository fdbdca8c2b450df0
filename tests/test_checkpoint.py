"""Checkpoints: exact resume after SIGKILL, crash-safe writes, safe and strict loading.

The kill-and-resume tests run `tests/resume_worker.py` in subprocesses: one process trains with a
checkpoint after every micro-step (or step) and SIGKILLs itself right after position `k`; a fresh
process resumes from the checkpoint and finishes. Its final model and optimizer state must equal,
bit for bit, the same run done uninterrupted (computed in this process by the same code without
any checkpoint, so saving a checkpoint is also shown not to disturb training). The subprocesses of
one test run concurrently to keep the file fast.
"""

from __future__ import annotations

import enum
import io
import os
import pathlib
import pickle
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradaccum import (
    Accumulator,
    CheckpointError,
    LossSum,
    _checkpoint_fit,
    load_checkpoint,
    save_checkpoint,
)
from gradaccum.checkpoint import load_model_weights
from tests.resume_worker import build, train
from tests.state import assert_bitwise, clone_state

WORKER = Path(__file__).with_name("resume_worker.py")
KILLED = -signal.SIGKILL


def _run_workers(jobs: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Run several worker command lines at once; return their results in order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *job],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for job in jobs
    ]
    results = []
    try:
        for proc, job in zip(procs, jobs, strict=True):
            out, err = proc.communicate(timeout=240)
            results.append(subprocess.CompletedProcess(job, proc.returncode, out, err))
    finally:
        for proc in procs:  # only after a timeout or error: no worker outlives the test
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _final(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "final.pt", map_location="cpu", weights_only=True)


def _kill_and_resume(
    tmp_path: Path, variant: str, n: int, kills: list[int]
) -> dict[int, dict[str, Any]]:
    """For each position in `kills`: run until SIGKILL there, then resume in a fresh process."""
    folders = {k: tmp_path / f"{variant}-{n}-{k}" for k in kills}
    for folder in folders.values():
        folder.mkdir()
    common = ["--variant", variant, "--n", str(n)]
    died = _run_workers([[*common, "--out", str(folders[k]), "--die-after", str(k)] for k in kills])
    for k, result in zip(kills, died, strict=True):
        assert result.returncode == KILLED, (k, result.stderr)
        assert not (folders[k] / "final.pt").exists()
    resumed = _run_workers([[*common, "--out", str(folders[k]), "--resume"] for k in kills])
    for k, result in zip(kills, resumed, strict=True):
        assert result.returncode == 0, (k, result.stderr)
    return {k: _final(folders[k]) for k in kills}


# (variant, N, positions killed at). Streaming positions N + k are micro position k of the second
# window (so the optimizer already has state); "whole" kills after optimizer steps 0 and 1.
CASES = [
    ("base", 2, [2, 3]),
    ("base", 5, [5, 6, 7, 8, 9]),
    ("whole", 1, [1]),
    ("bf16", 3, [4]),
    # Position 4 falls in the window that fp16 skips as non-finite; 5 is its boundary.
    ("fp16", 3, [4, 5]),
]


@pytest.mark.slow  # subprocesses: about 85 s of the engine tests; `make test-fast` skips them
@pytest.mark.parametrize(("variant", "n", "kills"), CASES, ids=[f"{c[0]}-N{c[1]}" for c in CASES])
def test_sigkill_then_resume_is_bitwise_equal_to_uninterrupted_run(
    tmp_path: Path, variant: str, n: int, kills: list[int]
) -> None:
    reference = train(variant, n)
    for k, final in _kill_and_resume(tmp_path, variant, n, kills).items():
        try:
            assert_bitwise(final, reference)
        except AssertionError as error:
            raise AssertionError(f"{variant} N={n}: resume after position {k} differs") from error
    if variant == "fp16":
        assert reference["counters"][0] == 1  # the skipped window really happened
        assert reference["scale"] == 2.0**15  # and backed the scale off once


def test_resume_without_accumulator_state_differs(tmp_path: Path) -> None:
    """Negative control: dropping the partial window on resume changes the result clearly."""
    reference = train("base", 5)
    train("base", 5, tmp_path, stop_after=7)
    final = train("base", 5, tmp_path, resume=True, drop_accumulator=True)
    # The same resume keeping the accumulator state matches (shown here in-process too).
    train("base", 5, tmp_path, stop_after=7)
    assert_bitwise(train("base", 5, tmp_path, resume=True), reference)
    gap = max(
        float((final["model"][name] - value).abs().max())
        for name, value in reference["model"].items()
    )
    assert gap > 1e-3


@pytest.mark.slow  # subprocesses
def test_crash_in_the_middle_of_a_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    (result,) = _run_workers(
        [["--variant", "base", "--n", "2", "--out", str(tmp_path), "--crash-in-save-at", "3"]]
    )
    assert result.returncode == KILLED, result.stderr
    # Under the real name: only the complete checkpoint of position 2. The half-written data is in
    # a hidden temporary file, left over because the process died before its cleanup could run.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[-1] == "ckpt.pt"
    leftovers = names[:-1]
    assert all(name.startswith(".ckpt.pt.tmp-") for name in leftovers), names
    assert leftovers, "the kill should have struck during the write"
    half = (tmp_path / leftovers[0]).stat().st_size
    assert 0 < half < (tmp_path / "ckpt.pt").stat().st_size
    model, optimizer, scheduler, acc = build("base", 2)
    extra = load_checkpoint(
        tmp_path / "ckpt.pt", model=model, optimizer=optimizer, accumulator=acc, scheduler=scheduler
    )
    assert extra == {"position": 2}
    # The half file itself is damaged, and is rejected as such.
    with pytest.raises(CheckpointError, match=leftovers[0]):
        load_checkpoint(tmp_path / leftovers[0], model=model, optimizer=optimizer)
    # Resuming from the surviving checkpoint still ends bitwise where an uninterrupted run does.
    (resumed,) = _run_workers(
        [["--variant", "base", "--n", "2", "--out", str(tmp_path), "--resume"]]
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise(_final(tmp_path), train("base", 2))


# ----- loading bad files ---------------------------------------------------------------------


class _Payload:
    """An object whose unpickling would create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _small() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_file_whose_pickle_runs_code_is_rejected_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pt"
    model, optimizer = _small()
    save_checkpoint(tmp_path / "good.pt", model=model, optimizer=optimizer)
    payload = torch.load(tmp_path / "good.pt", weights_only=True)
    payload["extra"] = {"position": _Payload(marker)}
    torch.save(payload, evil)
    before = clone_state(model.state_dict())
    with pytest.raises(CheckpointError, match=r"evil\.pt"):
        load_checkpoint(evil, model=model, optimizer=optimizer)
    assert not marker.exists()
    assert_bitwise(model.state_dict(), before)
    # Negative control: the file really does run code when unpickled without weights_only.
    torch.load(evil, weights_only=False)
    assert marker.exists()


def _damaged_files(folder: Path) -> dict[str, Path]:
    model, optimizer = _small()
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    good = folder / "good.pt"
    save_checkpoint(good, model=model, optimizer=optimizer, accumulator=acc, extra={"a": 1})
    data = good.read_bytes()
    files = {
        "truncated": data[: len(data) // 2],
        "truncated-tail": data[:-10],
        "zero-byte": b"",
        "random": torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(5))
        .to(torch.uint8)
        .numpy()
        .tobytes(),
        "text": b"not a checkpoint\n",
        # Legacy-pickle bytes that fail inside the unpickler (KeyError, struct.error).
        "short-text": b"hi\n",
        "pickle-header": b"\x80\x02X",
    }
    paths = {}
    for name, content in files.items():
        paths[name] = folder / f"{name}.pt"
        paths[name].write_bytes(content)
    paths["plain-torch-dict"] = folder / "plain-torch-dict.pt"
    torch.save({"weight": torch.ones(2)}, paths["plain-torch-dict"])
    paths["plain-tensor"] = folder / "plain-tensor.pt"
    torch.save(torch.ones(2), paths["plain-tensor"])
    payload = torch.load(good, weights_only=True)
    payload["version"] = 99
    paths["wrong-version"] = folder / "wrong-version.pt"
    torch.save(payload, paths["wrong-version"])
    paths["bit-flip"] = folder / "bit-flip.pt"
    paths["bit-flip"].write_bytes(_flip_a_tensor_bit(data))
    return paths


def _flip_a_tensor_bit(data: bytes) -> bytes:
    """`data` (a checkpoint) with one bit flipped in the first tensor's bytes: still a valid
    archive that `torch.load` reads, one number different."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        record = next(r for r in archive.infolist() if "/data/" in r.filename and r.file_size)
    header = data[record.header_offset : record.header_offset + 30]
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    start = record.header_offset + 30 + name_length + extra_length
    flipped = bytearray(data)
    flipped[start + 2] ^= 0x10  # a float's mantissa: a plausible number, silently wrong
    return bytes(flipped)


DAMAGE = [
    "truncated",
    "truncated-tail",
    "zero-byte",
    "random",
    "text",
    "short-text",
    "pickle-header",
    "plain-torch-dict",
    "plain-tensor",
    "wrong-version",
    "bit-flip",  # before, it loaded: torch.load does not compare the records' CRC-32
]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_file_raises_checkpoint_error_naming_it(tmp_path: Path, kind: str) -> None:
    path = _damaged_files(tmp_path)[kind]
    model, optimizer = _small()
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    before = clone_state([model.state_dict(), optimizer.state_dict(), acc.state_dict()])
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    assert str(path) in str(caught.value)
    assert_bitwise([model.state_dict(), optimizer.state_dict(), acc.state_dict()], before)


def test_good_file_loads(tmp_path: Path) -> None:
    """Negative control for the damage tests: the undamaged original loads fine."""
    path = _damaged_files(tmp_path)
    model, optimizer = _small()
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    assert path["truncated"].with_name("good.pt").is_file()
    extra = load_checkpoint(
        path["truncated"].with_name("good.pt"), model=model, optimizer=optimizer, accumulator=acc
    )
    assert extra == {"a": 1}


def test_missing_file_raises_file_not_found_naming_it(tmp_path: Path) -> None:
    model, optimizer = _small()
    missing = tmp_path / "nowhere.pt"
    with pytest.raises(FileNotFoundError, match=r"nowhere\.pt"):
        load_checkpoint(missing, model=model, optimizer=optimizer)


def test_missing_accumulator_state_is_named(tmp_path: Path) -> None:
    model, optimizer = _small()
    path = tmp_path / "no-acc.pt"
    save_checkpoint(path, model=model, optimizer=optimizer)
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    with pytest.raises(CheckpointError, match=r"no-acc\.pt.*accumulator"):
        load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)


def test_save_leaves_no_temporary_file_and_overwrites_atomically(tmp_path: Path) -> None:
    model, optimizer = _small()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=optimizer, extra={"v": 1})
    save_checkpoint(path, model=model, optimizer=optimizer, extra={"v": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert load_checkpoint(path, model=model, optimizer=optimizer) == {"v": 2}


def test_a_save_to_a_folder_is_refused_up_front_naming_a_file_path(tmp_path: Path) -> None:
    """Before, the whole payload was written to a temporary and the rename failed with an
    `IsADirectoryError` naming that hidden temporary."""
    model, optimizer = _small()
    folder = tmp_path / "ckpt.pt"
    folder.mkdir()
    for target in (folder, tmp_path):
        with pytest.raises(ValueError, match=re.escape(f"{target}: it is a folder; give a file")):
            save_checkpoint(target, model=model, optimizer=optimizer)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # nothing written
    assert not list(folder.iterdir())
    save_checkpoint(folder / "checkpoint.pt", model=model, optimizer=optimizer)  # control


def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def _rng_states() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _assert_same_rng_states(a: tuple[Any, Any, torch.Tensor], b: tuple[Any, Any, Any]) -> None:
    assert a[0] == b[0]
    assert a[1][0] == b[1][0]
    assert np.array_equal(a[1][1], b[1][1])
    assert a[1][2:] == b[1][2:]
    assert torch.equal(a[2], b[2])


def test_rng_states_are_restored(tmp_path: Path) -> None:
    model, optimizer = _small()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=optimizer)
    saved = _rng_states()
    first = _draws()
    second = _draws()
    assert first[0] != second[0]  # the draws move on (so the restore below can be seen)
    load_checkpoint(path, model=model, optimizer=optimizer, restore_rng=True)
    _assert_same_rng_states(_rng_states(), saved)
    again = _draws()
    assert again[:2] == first[:2]
    assert torch.equal(again[2], first[2])


def test_default_load_leaves_the_global_rng_states_alone(tmp_path: Path) -> None:
    model, optimizer = _small()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=optimizer)
    saved = _rng_states()
    _draws()
    current = _rng_states()
    assert current[0] != saved[0]  # the states moved on since the save
    assert not torch.equal(current[2], saved[2])
    assert load_checkpoint(path, model=model, optimizer=optimizer) is None
    _assert_same_rng_states(_rng_states(), current)
    # Negative control: the same load asked to restore them does change them, to the saved ones.
    load_checkpoint(path, model=model, optimizer=optimizer, restore_rng=True)
    _assert_same_rng_states(_rng_states(), saved)


def test_damaged_rng_states_are_refused_before_anything_changes(tmp_path: Path) -> None:
    model, optimizer = _small()
    path = tmp_path / "bad-rng.pt"
    torch.nn.init.ones_(model.weight)
    save_checkpoint(path, model=model, optimizer=optimizer)
    payload = torch.load(path, weights_only=True)
    payload["rng"]["python"] = (3, (1, 2, 3), None)  # not a Mersenne Twister state
    torch.save(payload, path)
    torch.nn.init.zeros_(model.weight)
    before = clone_state([model.state_dict(), optimizer.state_dict()])
    states = _rng_states()
    with pytest.raises(CheckpointError, match=r"bad-rng\.pt holds damaged RNG states.*restore_rng"):
        load_checkpoint(path, model=model, optimizer=optimizer, restore_rng=True)
    assert_bitwise([model.state_dict(), optimizer.state_dict()], before)
    _assert_same_rng_states(_rng_states(), states)
    # Negative control: without restoring RNG states the file loads (the model changes).
    load_checkpoint(path, model=model, optimizer=optimizer)
    assert torch.equal(model.weight, torch.ones_like(model.weight))


# ----- loading into objects that do not fit: refused before anything changes ---------------------


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()


def _stepped(
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    scheduler: str = "step",
    seed: int = 0,
    steps: int = 2,
    groups: str | None = None,
) -> dict[str, Any]:
    """A small run of 3 micro-steps: with `steps=2`, one optimizer step and half a window.

    `groups` builds the optimizer with other param groups: "two" (one per layer), "three" (the
    last layer's weight and bias apart), "other split" (the first weight alone, then the rest),
    "swapped" (one per layer, the last layer first).
    """
    model = _model(seed)
    params = list(model.parameters())
    layout: Any = {
        None: params,
        "two": [{"params": params[:2]}, {"params": params[2:]}],
        "three": [{"params": params[:2]}, {"params": params[2:3]}, {"params": params[3:]}],
        "other split": [{"params": params[:1]}, {"params": params[1:]}],
        "swapped": [{"params": params[2:]}, {"params": params[:2]}],
    }[groups]
    optimizer = optimizer_class(layout, lr=0.1)
    sched = _scheduler(scheduler, optimizer)
    acc = Accumulator(model, optimizer, scheduler=sched, accumulation_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = torch.randn(4, 3, dtype=torch.float64, generator=generator)
        acc.micro_step((x, torch.randn(4, 2, dtype=torch.float64, generator=generator)), _mse)
    return {"model": model, "optimizer": optimizer, "scheduler": sched, "accumulator": acc}


def _scheduler(kind: str, optimizer: torch.optim.Optimizer) -> Any:
    """A scheduler by name; the composite ones list the schedulers they chain, in order."""
    lr = torch.optim.lr_scheduler
    if kind == "step":
        return lr.StepLR(optimizer, step_size=1, gamma=0.5)
    if kind == "lambda":
        return lr.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    names = kind.split()  # "sequential LinearLR CosineAnnealingLR", "chained ..."
    built = {
        "LinearLR": lambda: lr.LinearLR(optimizer, 0.1, total_iters=3),
        "ConstantLR": lambda: lr.ConstantLR(optimizer, 0.5, total_iters=3),
        "CosineAnnealingLR": lambda: lr.CosineAnnealingLR(optimizer, T_max=10),
        "ExponentialLR": lambda: lr.ExponentialLR(optimizer, 0.9),
    }
    inner = [built[name]() for name in names[1:]]
    if names[0] == "chained":
        return lr.ChainedScheduler(inner)
    return lr.SequentialLR(optimizer, inner, milestones=[3 * i for i in range(1, len(inner))])


def _snapshot(run: dict[str, Any]) -> Any:
    return clone_state(
        [
            run["model"].state_dict(),
            [p.grad for p in run["model"].parameters()],
            run["optimizer"].state_dict(),
            run["scheduler"].state_dict(),
            run["accumulator"].state_dict(),
        ]
    )


def _save(path: Path, run: dict[str, Any], **drop: bool) -> Path:
    save_checkpoint(path, **run)
    if drop:
        payload = torch.load(path, weights_only=True)
        for key in drop:
            del payload[key]
        torch.save(payload, path)
    return path


def test_optimizer_state_of_another_class_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path / "adamw.pt", _stepped(torch.optim.AdamW))
    target = _stepped(torch.optim.SGD, seed=1)
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=r"adamw\.pt .*AdamW optimizer.* SGD.*build an AdamW"):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)
    # The other way round, as the names are spoken (docs/reliability.md quotes it): "an SGD".
    sgd = _save(tmp_path / "sgd.pt", _stepped(torch.optim.SGD))
    with pytest.raises(CheckpointError, match=r"state of an SGD optimizer, but .* into an "):
        load_checkpoint(sgd, **_stepped(torch.optim.AdamW, seed=1))


def test_older_file_without_optimizer_class_is_refused_by_its_group_settings(
    tmp_path: Path,
) -> None:
    """A file that records no class: the param groups' settings tell AdamW from SGD."""
    path = _save(tmp_path / "old.pt", _stepped(torch.optim.AdamW), optimizer_class=True)
    target = _stepped(torch.optim.SGD, seed=1)
    before = _snapshot(target)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, **target)
    message = str(caught.value)
    assert "\n" not in message
    pattern = r"old\.pt holds the state of another optimizer type: .*'betas'.*'momentum'"
    assert re.search(pattern, message)
    assert message.endswith("build the optimizer type the run that saved it used.")
    assert_bitwise(_snapshot(target), before)
    # Negative control: loaded past the check, that state breaks the SGD's next step (taken
    # here by hand inside the Accumulator's open window, whose guard against that is set aside).
    target["optimizer"].load_state_dict(torch.load(path, weights_only=True)["optimizer"])
    target["optimizer"]._optimizer_step_pre_hooks.clear()
    with pytest.raises(KeyError):
        target["optimizer"].step()
    # And an older file of the right type loads and fits.
    same = _save(tmp_path / "sgd.pt", _stepped(torch.optim.SGD), optimizer_class=True)
    fresh = _stepped(torch.optim.SGD, seed=1)
    load_checkpoint(same, **fresh)
    assert_bitwise(_snapshot(fresh)[2:], _snapshot(_stepped(torch.optim.SGD))[2:])


def test_optimizer_of_the_same_name_but_another_type_is_refused(tmp_path: Path) -> None:
    class AdamW(torch.optim.SGD):  # the recorded class name matches, the state does not
        pass

    path = _save(tmp_path / "adamw.pt", _stepped(torch.optim.AdamW))
    target = _stepped(AdamW, seed=1)
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=r"adamw\.pt holds the state of another optimizer"):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)


def test_optimizer_groups_of_the_same_sizes_in_another_order_are_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "groups.pt", _stepped(groups="two"))
    target = _stepped(groups="swapped", seed=1)
    before = _snapshot(target)
    with pytest.raises(
        CheckpointError,
        match=r"groups\.pt holds an optimizer 'exp_avg(_sq)?' of shape \(4, 3\) for parameter 0 "
        r"\(in param-group order\), which has shape \(2, 4\); build the optimizer with the same "
        r"param groups",
    ):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("three", r"holds an optimizer state of 2 param groups, the optimizer has 3"),
        ("other split", r"holds 2 params in optimizer param group 0, the optimizer has 1"),
    ],
)
def test_optimizer_param_groups_that_differ_are_refused(
    tmp_path: Path, layout: str, message: str
) -> None:
    path = _save(tmp_path / "groups.pt", _stepped(groups="two"))
    target = _stepped(groups=layout, seed=1)
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=rf"groups\.pt {message}.*same param groups"):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)
    # Negative control: into the layout it was saved from, it loads.
    load_checkpoint(path, **_stepped(groups="two", seed=1))


def test_scheduler_state_of_another_class_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path / "steplr.pt", _stepped(scheduler="step"))
    target = _stepped(scheduler="lambda", seed=1)
    before = _snapshot(target)
    with pytest.raises(CheckpointError, match=r"steplr\.pt .*StepLR scheduler.*LambdaLR"):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ("sequential LinearLR CosineAnnealingLR", "sequential ConstantLR ExponentialLR"),
        ("sequential LinearLR CosineAnnealingLR", "sequential LinearLR ExponentialLR"),
        (
            "sequential LinearLR CosineAnnealingLR",
            "sequential LinearLR CosineAnnealingLR ExponentialLR",
        ),
        ("chained LinearLR ExponentialLR", "chained ConstantLR ExponentialLR"),
    ],
)
def test_a_composite_scheduler_of_other_schedulers_is_refused_before_anything_changes(
    tmp_path: Path, saved: str, loaded: str
) -> None:
    """SequentialLR and ChainedScheduler: the schedulers they chain must be the saved ones.

    torch loads each inner state into whatever scheduler sits at its place (`__dict__.update`),
    so another composition loads silently, with the saved milestones and foreign attributes.
    """
    path = _save(tmp_path / "composite.pt", _stepped(scheduler=saved))
    target = _stepped(scheduler=loaded, seed=1)
    before = _snapshot(target)
    outer = loaded.split()[0].capitalize()
    with pytest.raises(CheckpointError, match=rf"composite\.pt holds the state of .*{outer}"):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)
    # Negative control: torch itself loads that state without a word.
    target["scheduler"].load_state_dict(torch.load(path, weights_only=True)["scheduler"])
    # Into the composition it was saved from, it loads and resumes the same schedule; a file
    # that records only the outer class (older files) still loads into it too.
    again = _stepped(scheduler=saved, seed=1)
    load_checkpoint(path, **again)
    assert again["scheduler"].state_dict() == torch.load(path, weights_only=True)["scheduler"]
    payload = torch.load(path, weights_only=True)
    payload["scheduler_class"] = type(again["scheduler"]).__name__
    torch.save(payload, tmp_path / "older.pt")
    load_checkpoint(tmp_path / "older.pt", **_stepped(scheduler=saved, seed=1))


def test_scheduler_state_that_does_not_load_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    """An older file (no class recorded): the scheduler state is tried on a copy first."""
    path = _save(tmp_path / "old.pt", _stepped(scheduler="step"), scheduler_class=True)
    target = _stepped(scheduler="lambda", seed=1)
    before = _snapshot(target)
    with pytest.raises(
        CheckpointError, match=r"old\.pt holds a scheduler state that this LambdaLR"
    ):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)
    # Negative control: that state really does break a real load (it fails halfway through).
    with pytest.raises(KeyError):
        target["scheduler"].load_state_dict(torch.load(path, weights_only=True)["scheduler"])


def test_accumulator_that_does_not_fit_is_refused_after_the_checks_changing_nothing(
    tmp_path: Path,
) -> None:
    path = _save(tmp_path / "acc.pt", _stepped())
    target = _stepped(seed=1, steps=3)
    before = _snapshot(target)
    with pytest.raises(
        CheckpointError, match=r"acc\.pt does not fit the Accumulator.*accumulation_steps"
    ):
        load_checkpoint(path, **target)
    assert_bitwise(_snapshot(target), before)


def test_fitting_checkpoint_loads_everything(tmp_path: Path) -> None:
    """Negative control for the refusals above: matching objects take every saved state."""
    source = _stepped()
    path = _save(tmp_path / "ckpt.pt", source)
    target = _stepped(seed=1)
    assert not torch.equal(target["model"][0].weight, source["model"][0].weight)
    load_checkpoint(path, **target)
    expected = _snapshot(source)
    got = _snapshot(target)
    assert_bitwise(got[0], expected[0])
    assert_bitwise(got[2:], expected[2:])


def test_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path: Path) -> None:
    model, optimizer = _small()
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    acc.micro_step(torch.randn(3, 3, dtype=torch.float64), lambda m, x: m(x).pow(2).mean())
    before = clone_state({"acc": acc.state_dict(), "model": model.state_dict()})
    other = torch.nn.Linear(3, 4).double()
    other_acc = Accumulator(
        other, torch.optim.SGD(other.parameters(), lr=0.1), accumulation_steps=2
    )
    path = tmp_path / "other.pt"
    save_checkpoint(path, model=other, optimizer=other_acc.optimizer, accumulator=other_acc)
    with pytest.raises(CheckpointError, match=r"other\.pt.*shape"):
        load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    assert_bitwise(before, clone_state({"acc": acc.state_dict(), "model": model.state_dict()}))


def test_incomplete_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    model, optimizer = _small()
    path = tmp_path / "incomplete.pt"
    save_checkpoint(path, model=model, optimizer=optimizer)
    payload = torch.load(path, weights_only=True)
    del payload["rng"]
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match=r"incomplete\.pt.*lacks rng"):
        load_checkpoint(path, model=model, optimizer=optimizer)


def test_temporaries_of_killed_writers_are_cleaned_up(tmp_path: Path) -> None:
    model, optimizer = _small()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid, host = dead.stdout.strip(), socket.gethostname()
    stale = tmp_path / f".ckpt.pt.tmp-{host}-{pid}"
    stale.write_bytes(b"half a checkpoint")
    older = tmp_path / f".ckpt.pt.tmp-{pid}"  # named by an older version: no host
    older.write_bytes(b"half a checkpoint")
    alive = tmp_path / f".ckpt.pt.tmp-{os.getpid()}x"  # not a pid: left alone
    alive.write_bytes(b"someone else's")
    # Another host's writer (a shared filesystem) may be alive under a pid free here.
    elsewhere = tmp_path / f".ckpt.pt.tmp-{host}-other-{pid}"
    elsewhere.write_bytes(b"being written on another host")
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer)
    assert not stale.exists()
    assert not older.exists()
    assert alive.exists()
    assert elsewhere.exists()  # before, deleted: that writer's rename then failed
    assert (tmp_path / "ckpt.pt").exists()
    assert not list(tmp_path.glob(f".ckpt.pt.tmp-{host}-{os.getpid()}*"))  # its own: renamed


def test_temporaries_are_told_apart_by_writer_and_save(tmp_path: Path) -> None:
    """Each save has its own temporary; a dead writer's are removed, a live one's are kept."""
    model, optimizer = _small()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host = socket.gethostname()
    stale = tmp_path / f".ckpt.pt.tmp-{host}-{dead.stdout.strip()}.0123abcd"
    live = tmp_path / f".ckpt.pt.tmp-{host}-{os.getpid()}.89abcdef"  # another thread's, say
    for leftover in (stale, live):
        leftover.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer)
    assert not stale.exists()
    assert live.read_bytes() == b"half a checkpoint"  # not written over, not removed


def test_a_save_landing_inside_another_save_of_the_same_file_keeps_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler (or a background thread) saving the file the loop is saving.

    Both saves used one temporary (named by host and pid): the inner one truncated and renamed
    the outer's file, the outer's rename then raised `FileNotFoundError`, and its buffered bytes
    went into the checkpoint under the target's name.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 200).double()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 300, dtype=torch.float64)).sum().backward()
    optimizer.step()
    target, real_save, inner = tmp_path / "ckpt.pt", torch.save, []

    def save_interrupted(payload: Any, handle: Any) -> None:
        real_save(payload, handle)  # the loop's bytes are written, not yet flushed...
        if not inner:  # ...when a handler saves the same file, once
            inner.append(True)
            save_checkpoint(target, model=model, optimizer=optimizer, extra={"by": "handler"})

    monkeypatch.setattr(torch, "save", save_interrupted)
    save_checkpoint(target, model=model, optimizer=optimizer, extra={"by": "loop"})
    monkeypatch.undo()
    fresh = torch.nn.Linear(300, 200).double()
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    assert load_checkpoint(target, model=fresh, optimizer=fresh_optimizer) == {"by": "loop"}
    assert torch.equal(fresh.weight, model.weight)
    assert not list(tmp_path.glob(".ckpt.pt.tmp-*"))


# ----- optimizer and scheduler states: what a weights_only load reads back ----------------------


def _numpy_run(tmp_path: Path, save_after: int | None) -> tuple[torch.nn.Module, Any]:
    """6 micro-steps of a run whose lr, weight decay and T_max were computed with NumPy."""

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Accumulator]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        model = model.double()
        lr = np.float64(1e-3) * np.sqrt(np.float64(256) / 64)  # a scaling rule, in NumPy
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=np.float64(0.05))
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=np.int64(10))
        return (
            model,
            optimizer,
            Accumulator(model, optimizer, accumulation_steps=2, scheduler=schedule),
        )

    def loss_fn(model: torch.nn.Module, batch: Any) -> Any:
        x, y = batch
        return LossSum(((model(x) - y) ** 2).sum(), x.shape[0])

    generator = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(3, 4, generator=generator, dtype=torch.float64),
            torch.randn(3, 1, dtype=torch.float64, generator=generator),
        )
        for _ in range(6)
    ]
    model, optimizer, acc = build()
    for index, batch in enumerate(data):
        if index == save_after:
            save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer, accumulator=acc)
            model, optimizer, acc = build()
            load_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer, accumulator=acc)
        acc.micro_step(batch, loss_fn)
    return model, optimizer


def test_numpy_numbers_in_optimizer_and_scheduler_states_save_and_resume_exactly(
    tmp_path: Path,
) -> None:
    """An lr from NumPy was a NumPy scalar in the file: saved silently, refused at every load."""
    torch.manual_seed(0)
    probe = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=np.float64(0.1))
    torch.save(probe.state_dict(), tmp_path / "plain.pt")  # the cause: torch keeps NumPy's type
    with pytest.raises(pickle.UnpicklingError, match="numpy"):
        torch.load(tmp_path / "plain.pt", weights_only=True)
    model, optimizer = _numpy_run(tmp_path, save_after=None)
    for save_after in (1, 3):  # mid-window, and between windows
        resumed, resumed_optimizer = _numpy_run(tmp_path, save_after=save_after)
        assert_bitwise(clone_state(resumed.state_dict()), clone_state(model.state_dict()))
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
        assert_bitwise(resumed_optimizer.state_dict()["state"], optimizer.state_dict()["state"])


class _Phase(enum.Enum):
    WARMUP = 1


def test_a_state_a_weights_only_load_refuses_is_refused_at_save_keeping_the_previous_file(
    tmp_path: Path,
) -> None:
    """A scheduler keeping an object of its own: the save refuses it, naming where it is."""

    class PhasedLR(torch.optim.lr_scheduler.LRScheduler):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.phase = _Phase.WARMUP
            super().__init__(optimizer)

        def get_lr(self) -> list[float]:
            return [group["lr"] for group in self.optimizer.param_groups]

    model, optimizer = _small()
    target = tmp_path / "ckpt.pt"
    save_checkpoint(target, model=model, optimizer=optimizer, extra={"step": 1})
    previous = target.read_bytes()
    with pytest.raises(ValueError, match=r"scheduler\['phase'\] is a .*Phase.*previous checkpoint"):
        save_checkpoint(target, model=model, optimizer=optimizer, scheduler=PhasedLR(optimizer))
    assert target.read_bytes() == previous  # before: replaced by a file no load could read
    # A NumPy float32 lr: its schedule runs in float32, which no Python number resumes bitwise.
    optimizer.param_groups[0]["lr"] = np.float32(0.1)
    with pytest.raises(ValueError, match=r"optimizer\['param_groups'\]\[0\]\['lr'\] is a numpy"):
        save_checkpoint(target, model=model, optimizer=optimizer)
    assert target.read_bytes() == previous
    assert load_checkpoint(target, model=model, optimizer=optimizer) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


class _Warmup:
    """A schedule of your own: the Accumulator steps anything with `step()`."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.steps = optimizer, 0

    def step(self) -> None:
        self.steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, self.steps / 10)


class _SavableWarmup(_Warmup):
    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


def test_a_scheduler_without_state_dict_is_refused_at_save_naming_the_fix(tmp_path: Path) -> None:
    """Saved as the README shows (accumulator=acc): a bare AttributeError, and no way around it."""
    target = tmp_path / "ckpt.pt"

    def run(kind: type[_Warmup]) -> tuple[torch.nn.Module, torch.optim.Optimizer, Accumulator]:
        model, optimizer = _small()
        acc = Accumulator(model, optimizer, accumulation_steps=2, scheduler=kind(optimizer))
        for _ in range(6):
            acc.micro_step(torch.randn(4, 3, dtype=torch.float64), lambda m, x: m(x).pow(2).mean())
        return model, optimizer, acc

    model, optimizer, acc = run(_Warmup)
    save_checkpoint(target, model=model, optimizer=optimizer, extra={"step": 0})
    previous = target.read_bytes()
    with pytest.raises(ValueError, match=r"_Warmup has no state_dict\(\).*LambdaLR.*Nothing was"):
        save_checkpoint(target, model=model, optimizer=optimizer, accumulator=acc)
    assert target.read_bytes() == previous
    # Control: with state_dict() and load_state_dict(), the schedule's position resumes.
    model, optimizer, acc = run(_SavableWarmup)
    save_checkpoint(target, model=model, optimizer=optimizer, accumulator=acc)
    fresh_model, fresh_optimizer = _small()
    schedule = _SavableWarmup(fresh_optimizer)
    fresh = Accumulator(fresh_model, fresh_optimizer, accumulation_steps=2, scheduler=schedule)
    load_checkpoint(target, model=fresh_model, optimizer=fresh_optimizer, accumulator=fresh)
    assert schedule.steps == 3


# ----- extra: only what a weights_only load reads back ------------------------------------------


class _Point:
    def __init__(self) -> None:
        self.x = 1


BAD_EXTRAS = {
    "numpy array": ({"order": np.arange(3)}, r"extra\['order'\] is a numpy\.ndarray"),
    "numpy scalar": ({"loss": np.float32(1.5)}, r"extra\['loss'\] is a numpy\.float32"),
    "nested in a list": ({"runs": [1, {"a": range(2)}]}, r"extra\['runs'\]\[1\]\['a'\] is a range"),
    "object": ({"point": _Point()}, r"extra\['point'\] is a tests\.test_checkpoint\._Point"),
    "frozenset": ({"seen": frozenset({1})}, r"extra\['seen'\] is a frozenset"),
    "numpy key": ({np.int64(1): "a"}, r"a key of extra is a numpy\.int64"),
    "not a dict": (np.zeros(2), r"extra is a numpy\.ndarray"),
}


@pytest.mark.parametrize("case", list(BAD_EXTRAS))
def test_extra_that_loading_cannot_read_back_is_refused_at_save_writing_nothing(
    tmp_path: Path, case: str
) -> None:
    extra, where = BAD_EXTRAS[case]
    model, optimizer = _small()
    path = tmp_path / "ckpt.pt"
    with pytest.raises(ValueError, match=where) as caught:
        save_checkpoint(path, model=model, optimizer=optimizer, extra=extra)
    message = str(caught.value)
    assert "\n" not in message
    assert "convert it to a tensor (torch.as_tensor), a list" in message
    assert message.endswith("Nothing was written.")
    assert list(tmp_path.iterdir()) == []
    # An existing checkpoint stays as it was.
    save_checkpoint(path, model=model, optimizer=optimizer, extra={"epoch": 1})
    before = path.read_bytes()
    with pytest.raises(ValueError, match=where):
        save_checkpoint(path, model=model, optimizer=optimizer, extra=extra)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


# Read back by the weights_only loads of recent torch only (torch 2.4's refuses them), and an
# empty bytes, which pickle writes as a call to `bytes()` that no torch's such load accepts.
RECENT_EXTRAS = {
    "complex": 1 + 2j,
    "bytes": b"\x00",
    "bytearray": bytearray(b"ab"),
    "set": {1, 2},
    "empty bytes": b"",
    "empty bytearray": bytearray(),
    "empty set": set(),
}


@pytest.mark.parametrize("case", list(RECENT_EXTRAS))
def test_extra_saves_only_where_this_torch_loads_it_back(tmp_path: Path, case: str) -> None:
    """A set on torch 2.4, or b"" on any torch, saved fine, then no load could read the file."""
    value = RECENT_EXTRAS[case]
    model, optimizer = _small()
    path = tmp_path / "ckpt.pt"
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError:  # this torch cannot read it back: refused before writing
        where = rf"extra\['x'\] is an? {case}, .*torch {re.escape(torch.__version__)} cannot"
        with pytest.raises(ValueError, match=where):
            save_checkpoint(path, model=model, optimizer=optimizer, extra={"x": value})
        assert list(tmp_path.iterdir()) == []
        return
    save_checkpoint(path, model=model, optimizer=optimizer, extra={"x": value})
    got = load_checkpoint(path, model=model, optimizer=optimizer)
    assert got == {"x": value}
    assert type(got["x"]) is type(value)


def test_extra_an_older_torch_cannot_read_back_is_refused_naming_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on torch 2.4 (simulated): the message names the torch and the conversion."""
    monkeypatch.setattr(_checkpoint_fit, "_loads_back", lambda kind, empty: kind is not set)
    model, optimizer = _small()
    path = tmp_path / "ckpt.pt"
    with pytest.raises(ValueError, match=r"extra\['ids'\] is a set, .*convert it to a list first"):
        save_checkpoint(path, model=model, optimizer=optimizer, extra={"ids": {1}})
    with pytest.raises(ValueError, match=r"extra\['runs'\]\[0\] is an empty set") as caught:
        save_checkpoint(path, model=model, optimizer=optimizer, extra={"runs": [set()]})
    assert f"torch {torch.__version__} cannot read back" in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_every_kind_of_extra_that_saves_loads_back(tmp_path: Path) -> None:
    """Negative control: what save_checkpoint takes, load_checkpoint returns equal."""
    extra = {
        "epoch": 3,
        "ok": True,
        "none": None,
        "lr": 1e-3,
        "z": 1 + 2j,
        "name": "run",
        "raw": b"\x00\x01",
        "buffer": bytearray(b"ab"),
        "order": torch.arange(5),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "shape": torch.Size([2, 3]),
        "nested": [(1, "a"), {"b": [torch.ones(2, 2).t()]}],
        "ids": {1, 2},
        7: "int key",
        "ordered": OrderedDict(a=1),
        "as list": np.arange(3).tolist(),
        "as tensor": torch.as_tensor(np.arange(3)),
    }
    # Only what this torch reads back (torch 2.4: no complex, bytes, bytearray nor set).
    extra = {
        key: value
        for key, value in extra.items()
        if type(value) not in (complex, bytes, bytearray, set)
        or _checkpoint_fit._loads_back(type(value), empty=not value)
    }
    model, optimizer = _small()
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer, extra=extra)
    got = load_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer)
    assert got is not None
    assert got.keys() == extra.keys()
    for key, value in extra.items():
        if key == "nested":
            assert got[key][0] == value[0]
            assert torch.equal(got[key][1]["b"][0], value[1]["b"][0])
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value)
        else:
            assert got[key] == value
            assert type(got[key]) is type(value)


def test_file_holding_an_object_loading_refuses_gets_one_plain_line(tmp_path: Path) -> None:
    """A file written around save_checkpoint's check: the error names the type, no ANSI codes."""
    model, optimizer = _small()
    path = tmp_path / "numpy.pt"
    save_checkpoint(path, model=model, optimizer=optimizer)
    payload = torch.load(path, weights_only=True)
    payload["extra"] = {"order": np.arange(3)}
    torch.save(payload, path)
    before = clone_state([model.state_dict(), optimizer.state_dict()])
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model=model, optimizer=optimizer)
    message = str(caught.value)
    assert "\x1b" not in message
    assert "\n" not in message
    assert re.search(r"numpy\.pt: it holds a numpy\.[\w.]+ object, which weights_only", message)
    assert "in extra, or a NumPy number in an optimizer or scheduler state" in message
    assert_bitwise([model.state_dict(), optimizer.state_dict()], before)
    # Negative control: torch's own message carries ANSI escape codes and line breaks.
    with pytest.raises(Exception, match="\x1b") as raw:
        torch.load(path, weights_only=True)
    assert "\n" in str(raw.value)


def test_a_file_that_is_no_checkpoint_at_all_is_named_so(tmp_path: Path) -> None:
    """A run's config.json given for its checkpoint.pt: torch's reason was its weights_only advice
    ("Re-running torch.load with weights_only set to False..."), beside the point and unsafe."""
    config = tmp_path / "config.json"
    config.write_text('{\n  "config": {"task": "digits"}\n}\n')
    model, optimizer = _small()
    before = clone_state([model.state_dict(), optimizer.state_dict()])
    for load in (
        lambda: load_checkpoint(config, model=model, optimizer=optimizer),
        lambda: load_model_weights(config, model),
    ):
        with pytest.raises(
            CheckpointError, match=r"config\.json is not a checkpoint file: it"
        ) as e:
            load()
        assert "weights_only" not in str(e.value)
    assert_bitwise([model.state_dict(), optimizer.state_dict()], before)
    # Control: a real checkpoint cut short still reads as truncated (its zip header is intact).
    good = _save(tmp_path / "good.pt", _stepped())
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated, corrupted"):
        load_checkpoint(tmp_path / "cut.pt", model=model, optimizer=optimizer)


@pytest.mark.parametrize("kind", ["truncated", "random", "pickle-header"])
def test_damaged_file_errors_are_one_plain_line(tmp_path: Path, kind: str) -> None:
    path = _damaged_files(tmp_path)[kind]
    model, optimizer = _small()
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model=model, optimizer=optimizer)
    assert "\x1b" not in str(caught.value)
    assert "\n" not in str(caught.value)


# ----- weights only -----------------------------------------------------------------------------


def test_load_model_weights_loads_the_model_alone(tmp_path: Path) -> None:
    source = _stepped()
    path = _save(tmp_path / "ckpt.pt", source)
    target = _stepped(torch.optim.SGD, seed=1, steps=3)  # another optimizer and window: ignored
    others = _snapshot(target)[1:]
    states = _rng_states()
    load_model_weights(path, target["model"])
    assert_bitwise(target["model"].state_dict(), source["model"].state_dict())
    assert_bitwise(_snapshot(target)[1:], others)
    _assert_same_rng_states(_rng_states(), states)


def test_load_model_weights_refuses_another_model_changing_nothing(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt.pt", _stepped())
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    before = clone_state(model.state_dict())
    with pytest.raises(CheckpointError, match=r"ckpt\.pt holds 0\.weight of shape \(4, 3\)"):
        load_model_weights(path, model)
    assert_bitwise(model.state_dict(), before)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_model_weights(tmp_path / "absent.pt", model)


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model)  # wraps lazily: nothing compiles until a forward


_WRAPPERS = {
    "plain": lambda model: model,
    "compiled": _compiled,
    "data-parallel": torch.nn.DataParallel,  # the `module.` prefix of DDP, without a process group
    "compiled-data-parallel": lambda model: _compiled(torch.nn.DataParallel(model)),
}


@pytest.mark.parametrize("saved_as", list(_WRAPPERS))
@pytest.mark.parametrize("loaded_as", ["plain", "compiled", "data-parallel"])
def test_checkpoint_loads_into_the_model_wrapped_or_not(
    tmp_path: Path, saved_as: str, loaded_as: str
) -> None:
    """`torch.compile` and DDP wrap the same weights: a checkpoint moves between the wrappings."""
    source = _stepped()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, **{**source, "model": _WRAPPERS[saved_as](source["model"])})
    target = _stepped(seed=1)
    wrapped = _WRAPPERS[loaded_as](target["model"])
    assert load_checkpoint(path, **{**target, "model": wrapped}) is None
    assert_bitwise(_snapshot(target)[0], _snapshot(source)[0])
    assert_bitwise(_snapshot(target)[2:], _snapshot(source)[2:])
    load_model_weights(path, _WRAPPERS[loaded_as](_model(2)))  # the weights alone, likewise


def test_older_file_with_a_wrapper_prefix_loads_and_keeps_module_versions(tmp_path: Path) -> None:
    """Files saved whole from a wrapped model (prefixed keys) load into the plain model."""
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    source(torch.randn(5, 3))  # running statistics move
    optimizer = torch.optim.SGD(source.parameters(), lr=0.1)
    path = tmp_path / "old.pt"
    save_checkpoint(path, model=source, optimizer=optimizer)
    payload = torch.load(path, weights_only=True)
    payload["model"] = torch.nn.DataParallel(source).state_dict()  # `module.` on every key
    torch.save(payload, path)
    target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    load_checkpoint(path, model=target, optimizer=torch.optim.SGD(target.parameters(), lr=0.1))
    assert_bitwise(clone_state(target.state_dict()), clone_state(source.state_dict()))


def test_another_architecture_under_a_wrapper_is_still_refused(tmp_path: Path) -> None:
    """Negative control for the wrapper tests: a prefix never hides a different model."""
    source = _stepped()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, **{**source, "model": torch.nn.DataParallel(source["model"])})
    other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    other = other.double()
    before = clone_state(other.state_dict())
    optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(path, model=torch.nn.DataParallel(other), optimizer=optimizer)
    assert_bitwise(clone_state(other.state_dict()), before)


@pytest.mark.parametrize("where", ["cpu", torch.device("cpu"), {"cuda:0": "cpu"}])
def test_load_takes_a_map_location_and_resumes_the_same(tmp_path: Path, where: Any) -> None:
    """`map_location` as `torch.load` takes it; the states still land where their objects live."""
    source = _stepped()
    path = _save(tmp_path / "ckpt.pt", source)
    target = _stepped(seed=1)
    load_checkpoint(path, **target, restore_rng=True, map_location=where)
    assert_bitwise(_snapshot(target)[0], _snapshot(source)[0])
    assert_bitwise(_snapshot(target)[2:], _snapshot(source)[2:])
    other = _model(2)
    load_model_weights(path, other, map_location=where)
    assert_bitwise(clone_state(other.state_dict()), clone_state(source["model"].state_dict()))
    # Negative control: without the load the target's model is another one.
    with pytest.raises(AssertionError):
        assert_bitwise(clone_state(_model(1).state_dict()), _snapshot(source)[0])


def test_a_folder_given_for_the_file_names_the_checkpoint_inside_changing_nothing(
    tmp_path: Path,
) -> None:
    """`gradaccum train --init-from runs/d` (the run folder, not runs/d/checkpoint.pt) once said
    only "no checkpoint at runs/d"; the error names the file to give, and nothing changes."""
    folder = tmp_path / "run"
    folder.mkdir()
    _save(folder / "checkpoint.pt", _stepped())
    run = _stepped(seed=1)
    before = _snapshot(run)
    expected = re.escape(f"it is a folder; give a checkpoint file, e.g. {folder / 'checkpoint.pt'}")
    with pytest.raises(FileNotFoundError, match=expected):
        load_checkpoint(folder, **run)
    with pytest.raises(FileNotFoundError, match=expected):
        load_model_weights(folder, run["model"])
    assert_bitwise(_snapshot(run), before)
    with pytest.raises(
        FileNotFoundError, match="it is a folder; give a checkpoint file \\(folders"
    ):
        load_model_weights(tmp_path / "run" / "..", run["model"])  # holds no .pt file
    load_checkpoint(folder / "checkpoint.pt", **run)  # control: the file itself loads


def test_an_optimizer_or_scheduler_the_accumulator_does_not_step_is_refused(
    tmp_path: Path,
) -> None:
    """An optimizer rebuilt at a stage change without `acc.optimizer = ...` never trains (the
    Accumulator steps its own): saving it wrote a state that never moved, and loading into it
    left the training one as it was, silently. Both are refused naming the fix, changing
    nothing; set as `acc.optimizer` first, the same calls save and load."""
    run = _stepped()
    acc = run["accumulator"]
    acc.flush("step")  # between windows
    path = _save(tmp_path / "ckpt.pt", run)
    written = path.read_bytes()
    rebuilt = torch.optim.AdamW(run["model"].parameters(), lr=1e-3)
    rescheduled = torch.optim.lr_scheduler.StepLR(run["optimizer"], step_size=1, gamma=0.5)
    for name, stale in (("optimizer", rebuilt), ("scheduler", rescheduled)):
        given = {**run, name: stale}
        with pytest.raises(ValueError, match=rf"the {name} given .* acc\.{name} = {name}"):
            save_checkpoint(path, **given)
        assert path.read_bytes() == written  # nothing written
        before = _snapshot(run), clone_state(stale.state_dict())
        with pytest.raises(ValueError, match=r"is not the one the accumulator steps"):
            load_checkpoint(path, **given)
        assert_bitwise((_snapshot(run), clone_state(stale.state_dict())), before)
    # Control: set as the Accumulator's, they are its own and load.
    acc.optimizer, acc.scheduler = rebuilt, torch.optim.lr_scheduler.StepLR(rebuilt, 1)
    save_checkpoint(path, **{**run, "optimizer": rebuilt, "scheduler": acc.scheduler})
    load_checkpoint(path, **{**run, "optimizer": rebuilt, "scheduler": acc.scheduler})


# ----- the Accumulator's scheduler is saved and loaded when none is passed ----------------------


def _scheduled_run(path: Path, resume: bool, *, with_accumulator: bool = True) -> Any:
    """8 windows of an Accumulator built with a scheduler; with `resume`, each window in fresh
    objects loaded from a checkpoint written as the README shows (`accumulator=acc` only)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(80, 3, generator=generator, dtype=torch.float64)

    def build() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1 + k))
        return (
            model,
            optimizer,
            Accumulator(model, optimizer, micro_batch_size=5, scheduler=scheduler),
        )

    model, optimizer, acc = build()
    for window in range(8):
        acc.step(x[window * 10 : window * 10 + 10], lambda m, b: m(b).pow(2).mean())
        if resume:
            kept = acc if with_accumulator else None  # a window boundary: nothing open
            save_checkpoint(path, model=model, optimizer=optimizer, accumulator=kept)
            model, optimizer, acc = build()
            kept = acc if with_accumulator else None
            load_checkpoint(path, model=model, optimizer=optimizer, accumulator=kept)
    assert acc.scheduler is not None
    return clone_state([model.state_dict(), acc.scheduler.state_dict()])


def test_the_accumulators_scheduler_is_saved_and_loaded_when_none_is_passed(
    tmp_path: Path,
) -> None:
    """Before, `save_checkpoint(..., accumulator=acc)` left out the scheduler the Accumulator
    steps: every resume started the schedule over, silently (lr 0.05 instead of 0.011)."""
    path = tmp_path / "ckpt.pt"
    uninterrupted = _scheduled_run(path, resume=False)
    assert_bitwise(_scheduled_run(path, resume=True), uninterrupted)
    assert torch.load(path, weights_only=True)["scheduler_class"] == "LambdaLR"


def test_negative_control_a_schedule_not_loaded_starts_over(tmp_path: Path) -> None:
    """What the resume above missed: saved and loaded without the Accumulator (so without its
    scheduler, as `accumulator=acc` was before), the schedule starts over and the model ends
    elsewhere."""
    path = tmp_path / "ckpt.pt"
    uninterrupted = _scheduled_run(path, resume=False)
    restarted = _scheduled_run(path, resume=True, with_accumulator=False)
    assert torch.load(path, weights_only=True)["scheduler"] is None
    with pytest.raises(AssertionError):
        assert_bitwise(restarted, uninterrupted)


def test_a_run_resumed_with_another_scheduler_class_starts_it_afresh(tmp_path: Path) -> None:
    """Not passed, the Accumulator's scheduler of another class than the file's is left alone
    (a new schedule on purpose), as before; passed, it is refused naming the class."""
    path = tmp_path / "ckpt.pt"
    _scheduled_run(path, resume=True)  # the file holds a LambdaLR state
    model = torch.nn.Linear(3, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = Accumulator(model, optimizer, micro_batch_size=5, scheduler=scheduler)
    fresh = clone_state(scheduler.state_dict())
    load_checkpoint(path, model=model, optimizer=optimizer, accumulator=acc)
    assert_bitwise(scheduler.state_dict(), fresh)
    with pytest.raises(CheckpointError, match="LambdaLR"):
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)


# ----- loading weights under an open window ------------------------------------------------


def _open_window_run() -> tuple[torch.nn.Module, torch.optim.Optimizer, Accumulator, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = Accumulator(model, optimizer, accumulation_steps=3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(12, 1, generator=generator, dtype=torch.float64)
    return model, optimizer, acc, (x, y)


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _full_batch_step() -> torch.nn.Module:
    """The plain full-batch step from the saved (initial) weights."""
    reference, optimizer, _, batch = _open_window_run()
    _mse(reference, batch).backward()
    optimizer.step()
    return reference


def _rollback(
    tmp_path: Path, *, drop: bool, accumulator: bool
) -> tuple[torch.nn.Module, Any, Accumulator]:
    """Saved between windows, a window opened, then the loop rolls back to the file."""
    model, optimizer, acc, (x, y) = _open_window_run()
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer, accumulator=acc)
    acc.micro_step((x[:4], y[:4]), _mse)
    if drop:
        acc.flush("drop")
    load_checkpoint(
        tmp_path / "ckpt.pt",
        model=model,
        optimizer=optimizer,
        accumulator=acc if accumulator else None,
    )
    for start in (0, 4, 8):
        result = acc.micro_step((x[start : start + 4], y[start : start + 4]), _mse)
    return model, result, acc


def test_loading_weights_under_an_open_window_is_refused_changing_nothing(
    tmp_path: Path,
) -> None:
    model, optimizer, acc, (x, y) = _open_window_run()
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer, accumulator=acc)
    acc.micro_step((x[:4], y[:4]), _mse)
    before = clone_state((model.state_dict(), optimizer.state_dict(), acc.state_dict()))
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(ValueError, match=r"open window of 1 micro-batches.*accumulator=acc"):
        load_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=optimizer)
    assert_bitwise((model.state_dict(), optimizer.state_dict(), acc.state_dict()), before)
    assert len(grads) == 4
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    # The fixes it names: the accumulator given (the saved window replaces the open one), or the
    # open window dropped first: the next window is the full-batch step either way.
    reference = _full_batch_step()
    for drop, accumulator in ((False, True), (True, False)):
        resumed, result, _ = _rollback(tmp_path, drop=drop, accumulator=accumulator)
        assert result.stepped
        for mine, theirs in zip(resumed.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=0)


def test_negative_control_a_load_under_an_open_window_mixes_stale_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gradaccum.checkpoint.refuse_loading_under_open_window", lambda *a: None)
    # And the window's own check of weights written between micro-batches (`_written`).
    monkeypatch.setattr("gradaccum.window.written_error", lambda *a, **k: None)
    model, result, acc = _rollback(tmp_path, drop=False, accumulator=False)
    assert not result.stepped  # the stale micro-batch closed the window one call early
    acc.flush("drop")
    reference = _full_batch_step()
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    gaps = [(a - b).abs().max().item() for a, b in pairs]
    assert max(gaps) > 1e-3
