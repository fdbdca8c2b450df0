"""Failure injection over a matrix: exactly the full-batch step, or a clear error, nothing changed.

Each case builds a small model (a parameter outside it, a frozen one, optionally BatchNorm),
takes one clean window, then runs a window that raises at one point: the loss, a custom autograd
backward, a tensor hook, a forward hook, a post-accumulate-grad hook, an optimizer step pre-hook,
the scheduler; with a `RuntimeError`, Ctrl-C (`KeyboardInterrupt`) or a fake out-of-memory error,
at the first, a middle or the last micro-batch, through `step()` or streamed `micro_step()` with a
partial window settled by `flush()`. It then checks bitwise that parameters, gradients (None stays
None), optimizer, scheduler, BatchNorm buffers, GradScaler, hooks, modes, the RNG and
`acc.state_dict()` are as before the window, that retrying the same window equals a twin that
never failed, bitwise, and (float64) a plain full-batch PyTorch step at rtol 1e-10.

A failure after parameters moved (`optimizer.step()` halfway) must raise `PartialStepError` and
refuse later windows; one after the commit (the scheduler) must keep the one step taken.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradaccum._commit
import gradaccum.batchnorm
from gradaccum import Accumulator, LossSum
from gradaccum.loss import Term
from gradaccum.result import PartialStepError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ITEMS, MICRO = 11, 3  # micro-batches of 3, 3, 3, 2 rows
EXCEPTIONS = {"error": RuntimeError, "ctrl-c": KeyboardInterrupt, "oom": torch.OutOfMemoryError}


class Fault:
    """Where and what to raise, once; `micro` counts the window's `loss_fn` calls."""

    def __init__(self) -> None:
        self.point: str | None = None
        self.at: int | None = None
        self.error: type[BaseException] | None = None
        self.micro = -1

    def fire(self, point: str, micro: bool = True) -> None:
        if self.point != point or self.error is None or (micro and self.micro != self.at):
            return
        error, self.error = self.error, None
        raise error() if error is KeyboardInterrupt else error(f"injected in {point}")


FAULT = Fault()


class _Raising(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        FAULT.fire("backward")
        return grad


class Net(nn.Module):
    def __init__(self, batchnorm: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 6, dtype=dtype)
        self.bn = nn.BatchNorm1d(6, dtype=dtype) if batchnorm else nn.Identity()
        self.l2 = nn.Linear(6, 1, dtype=dtype)
        self.frozen = nn.Parameter(torch.ones(2, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Raising.apply(self.l1(x))
        if h.requires_grad:
            h.register_hook(lambda g: FAULT.fire("tensor_hook"))
        return self.l2(torch.tanh(self.bn(h)))


def _lambda(epoch: int) -> float:
    FAULT.fire("scheduler", micro=False)
    return 0.9**epoch


class CustomScheduler:
    """Not from torch, so not tried before the step: it raises after the commit."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.last_epoch = optimizer, 0

    def step(self) -> None:
        self.last_epoch += 1
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.9
        FAULT.fire("after_commit", micro=False)

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = state["last_epoch"]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": _sgd,
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}

CONFIGS: dict[str, dict[str, Any]] = {
    "step": {},
    "stream-partial": {"drive": "micro"},
    "adam-clip-lambda": {"opt": "adam", "clip": 0.5, "sched": "lambda"},
    "adamw-fused-onecycle": {"opt": "adamw-fused", "sched": "onecycle", "drive": "micro"},
    "adagrad-lossum": {"opt": "adagrad", "loss": "sum"},
    "terms-stream": {"loss": "terms", "drive": "micro", "opt": "adamw-foreach"},
    "telemetry-stream": {"telemetry": True, "drive": "micro", "sched": "lambda"},
    "bn-micro": {"bn": "micro"},
    "bn-pooled-stream": {"bn": "pooled", "drive": "micro"},
    "bn-frozen": {"bn": "frozen", "sched": "lambda"},
    "fp16-stream": {"precision": "fp16", "dtype": torch.float32, "drive": "micro", "clip": 1.0},
    "bf16-fp32-buffers": {"precision": "bf16", "dtype": torch.bfloat16, "accum": torch.float32},
    "auto": {"auto": True, "opt": "adam", "sched": "lambda"},
}
POINTS = ["loss", "backward", "tensor_hook", "forward_hook", "grad_hook", "step_pre_hook"]


class Run:
    """One setup: model, loss weight outside it, optimizer, scheduler and Accumulator."""

    def __init__(self, config: dict[str, Any]) -> None:
        torch.manual_seed(0)
        self.config, dtype = config, config.get("dtype", torch.float64)
        self.model = Net("bn" in config, dtype)
        self.weight = nn.Parameter(torch.tensor(0.3, dtype=dtype))  # a learnable loss weight
        params = [p for p in self.model.parameters() if p.requires_grad] + [self.weight]
        self.optimizer = OPTIMIZERS[config.get("opt", "sgd")](params)
        kind = config.get("sched")
        self.scheduler: Any = None
        if kind == "lambda":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lambda)
        elif kind == "onecycle":
            self.scheduler = torch.optim.lr_scheduler.OneCycleLR(self.optimizer, 0.1, 50)
        elif kind == "custom":
            self.scheduler = CustomScheduler(self.optimizer)
        options: dict[str, Any] = {
            "scheduler": self.scheduler,
            "max_grad_norm": config.get("clip"),
            "precision": config.get("precision", "fp32"),
            "accum_dtype": config.get("accum"),
            "telemetry": config.get("telemetry", False),
            "batchnorm": config.get("bn", "micro"),
        }
        if config.get("drive") == "micro":
            options["accumulation_steps"] = 5  # 4 micro-batches, then flush(): a partial window
        elif config.get("auto"):
            options.update(micro_batch_size="auto", memory_budget="1GiB")
        else:
            options["micro_batch_size"] = MICRO
        self.acc = Accumulator(self.model, self.optimizer, **options)

    def loss_fn(self, model: nn.Module, batch: Any) -> Any:
        x, y = batch
        FAULT.micro += 1
        FAULT.fire("loss")
        out = model(x)
        err = (out - y).pow(2).squeeze(-1) * torch.exp(self.weight) + 0.1 * self.weight
        kind = self.config.get("loss")
        if kind == "sum":
            return LossSum(err.sum(), x.shape[0])
        if kind == "terms":
            rows = x.shape[0]
            return LossSum.terms(a=(err.sum(), rows), b=Term(out.abs().sum(), rows, weight=0.1))
        return err.mean()

    def window(self, seed: int) -> Any:
        """One window over the batch of `seed`: `step()`, or micro-steps and `flush()`."""
        x, y = _batch(seed, self.weight.dtype)
        FAULT.micro = -1
        if self.config.get("drive") != "micro":
            return self.acc.step((x, y), self.loss_fn)
        for start in range(0, ITEMS, MICRO):
            self.acc.micro_step((x[start : start + MICRO], y[start : start + MICRO]), self.loss_fn)
        return self.acc.flush()

    def reference(self, seed: int) -> list[torch.Tensor]:
        """A plain full-batch step from the current state, on copies (no gradaccum)."""
        model, weight, optimizer, scheduler = copy.deepcopy(
            (self.model, self.weight, self.optimizer, self.scheduler)
        )
        x, y = _batch(seed, torch.float64)
        out = model(x)
        objective = ((out - y).pow(2).squeeze(-1) * torch.exp(weight)).mean() + 0.1 * weight
        if self.config.get("loss") == "terms":
            objective = objective + 0.1 * out.abs().mean()
        params = [p for p in model.parameters() if p.requires_grad] + [weight]
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        if self.config.get("clip"):
            torch.nn.utils.clip_grad_norm_(params, self.config["clip"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return [p.detach() for p in params]

    def snapshot(self) -> dict[str, Any]:
        """Everything a failed window must leave as it was, cloned."""
        modules = self.model.named_modules()
        return _cloned(
            {
                "model": self.model.state_dict(),
                "grads": [p.grad for p in [*self.model.parameters(), self.weight]],
                "weight": self.weight,
                "optimizer": self.optimizer.state_dict(),
                "lr": [g["lr"] for g in self.optimizer.param_groups],
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "scaler": None if self.acc.scaler is None else self.acc.scaler.state_dict(),
                "modules": [(n, len(m._forward_hooks), m.training) for n, m in modules],
                "rng": torch.get_rng_state(),
                "acc": self.acc.state_dict(),
            }
        )

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters() if p.requires_grad] + [self.weight]


def _batch(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ITEMS, 4, generator=g, dtype=dtype)
    return x, torch.randn(ITEMS, 1, generator=g, dtype=dtype)


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cloned(v) for v in value]
    return copy.deepcopy(value)


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two snapshots differ, to the bit (NaN equals NaN); [] if none."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        same = same and a.dtype == b.dtype and a.shape == b.shape
        return [] if same and torch.equal(a.nan_to_num(1.5), b.nan_to_num(1.5)) else [path]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _hooks(run: Run, point: str) -> list[Any]:
    model, optimizer = run.model, run.optimizer
    if point == "forward_hook":
        return [model.l2.register_forward_hook(lambda *_: FAULT.fire(point))]
    if point == "grad_hook":
        return [model.l1.weight.register_post_accumulate_grad_hook(lambda _: FAULT.fire(point))]
    if point == "step_pre_hook":
        return [optimizer.register_step_pre_hook(lambda *_: FAULT.fire(point, micro=False))]
    return []


def _arm(point: str, at: int | None, error: type[BaseException]) -> None:
    FAULT.point, FAULT.at, FAULT.error = point, at, error


def _cases() -> list[Any]:
    cases = []
    for name, config in CONFIGS.items():
        points = [*POINTS, "scheduler"] if config.get("sched") == "lambda" else POINTS
        for index, point in enumerate(points):
            at = (0, 1, 3)[(index + len(name)) % 3]  # first, a middle, the last micro-batch
            for error in EXCEPTIONS:
                cases.append(pytest.param(name, point, at, error, id=f"{name}-{point}-{error}"))
    return cases


@pytest.mark.parametrize(("name", "point", "at", "error"), _cases())
def test_a_failure_anywhere_changes_nothing_and_the_retry_is_the_full_batch_step(
    name: str, point: str, at: int, error: str
) -> None:
    config = CONFIGS[name]
    run, twin = Run(config), Run(config)
    run.window(1), twin.window(1)  # momentum, Adam moments, a schedule and statistics to protect
    hooks = _hooks(run, point)
    before = run.snapshot()
    exact = config.get("dtype", torch.float64) is torch.float64 and "bn" not in config
    reference = run.reference(2) if exact else None
    _arm(point, 0 if config.get("auto") else at, EXCEPTIONS[error])  # "auto": one micro-batch
    if config.get("auto") and error == "oom" and point != "step_pre_hook":
        run.window(2)  # rerun smaller from the window's start: the step is still exact
        assert FAULT.error is None, "the fault never fired"
    else:
        with pytest.raises(EXCEPTIONS[error]) as info:
            run.window(2)
        assert FAULT.error is None, "the fault never fired"
        assert _differences(before, run.snapshot()) == []
        if sys.version_info >= (3, 11):  # the boundary's failures were not noted (step pre-hook)
            assert any("was discarded" in note for note in info.value.__notes__)
        assert run.window(2).stepped  # the same call again, the fault gone
    for handle in hooks:
        handle.remove()
    assert twin.window(2).stepped
    if not config.get("auto"):  # "auto" times sizes: its splits are not bitwise repeatable
        assert _differences(run.snapshot(), twin.snapshot()) == []
    if reference is not None:
        for mine, theirs in zip(run.params(), reference, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_negative_control_the_checks_catch_a_window_that_stepped() -> None:
    run = Run(CONFIGS["adam-clip-lambda"])
    run.window(1)
    before, reference = run.snapshot(), run.reference(2)
    run.window(2)
    run.window(2)  # a window stepped twice: the snapshot and the reference both catch it
    assert _differences(before, run.snapshot())
    assert any(
        not torch.allclose(mine, theirs, rtol=1e-10, atol=1e-12)
        for mine, theirs in zip(run.params(), reference, strict=True)
    )


@pytest.mark.parametrize("error", EXCEPTIONS)
@pytest.mark.parametrize("drive", ["step", "micro"])
@pytest.mark.parametrize("optimizer", ["adamw-foreach", "adamw-fused", "sgd-fused", "adagrad"])
def test_a_step_failing_after_it_moved_parameters_is_reported_and_never_taken_twice(
    optimizer: str, drive: str, error: str
) -> None:
    """A step post-hook raising: every parameter moved. Fused kernels bump no `_version`."""
    run = Run({"opt": optimizer, "drive": drive})
    run.window(1)
    saved = _cloned([run.model.state_dict(), run.weight, run.optimizer.state_dict()])
    saved_acc = run.acc.state_dict()
    hook = run.optimizer.register_step_post_hook(lambda *_: FAULT.fire("post", micro=False))
    _arm("post", None, EXCEPTIONS[error])
    with pytest.raises(KeyboardInterrupt if error == "ctrl-c" else PartialStepError) as info:
        run.window(2)
    hook.remove()
    said = [str(info.value), *getattr(info.value, "__notes__", [])]  # Ctrl-C: in a note
    assert any("already updated" in line for line in said)
    assert not any("as they were before it" in line for line in said)  # they are not
    with pytest.raises(RuntimeError, match="failed halfway"):
        run.window(2)  # a retry would step the same parameters twice
    with pytest.raises(ValueError, match="failed halfway"):
        run.acc.state_dict()
    run.model.load_state_dict(saved[0])  # the last checkpoint, reloaded
    with torch.no_grad():
        run.weight.copy_(saved[1])
    run.optimizer.load_state_dict(saved[2])
    run.acc.load_state_dict(saved_acc)
    reference = run.reference(2)
    assert run.window(2).stepped
    for mine, theirs in zip(run.params(), reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_negative_control_by_versions_alone_a_fused_step_that_raised_is_taken_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gradaccum._commit, "_fingerprint", lambda optimizer, params: None)
    run = Run({"opt": "adamw-fused"})
    run.window(1)
    reference = run.reference(2)
    hook = run.optimizer.register_step_post_hook(lambda *_: FAULT.fire("post", micro=False))
    _arm("post", None, RuntimeError)
    with pytest.raises(RuntimeError) as info:
        run.window(2)
    hook.remove()
    assert not isinstance(info.value, PartialStepError)  # taken for a step that changed nothing
    run.window(2)  # so the retry runs, and steps the parameters a second time
    assert any(
        not torch.allclose(mine, theirs, rtol=1e-10, atol=1e-12)
        for mine, theirs in zip(run.params(), reference, strict=True)
    )


@pytest.mark.parametrize("error", EXCEPTIONS)
@pytest.mark.parametrize("name", ["step", "stream-partial", "auto", "bn-pooled-stream"])
def test_a_failure_after_the_commit_keeps_the_one_step_taken(name: str, error: str) -> None:
    """A scheduler not from torch (not tried) raising after the step; "auto" reran it on OOM."""
    config = {**CONFIGS[name], "sched": "custom"}
    run, twin = Run(config), Run(config)
    run.window(1), twin.window(1)
    reference = run.reference(2)
    steps = []
    run.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    _arm("after_commit", None, EXCEPTIONS[error])
    with pytest.raises(EXCEPTIONS[error]):
        run.window(2)
    assert FAULT.error is None
    assert len(steps) == 1  # never rerun, never stepped twice
    twin.window(2)
    if "bn" not in config:
        for mine, theirs in zip(run.params(), reference, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    if not config.get("auto"):
        assert _differences(run.snapshot(), twin.snapshot()) == []
    assert run.window(3).stepped  # the next window runs as usual
    assert len(steps) == 2


def test_after_a_half_done_step_auto_sizing_refuses_clearly_instead_of_shrinking() -> None:
    """The refusal quotes the step's out-of-memory error; it used to be taken for one."""
    run = Run(CONFIGS["auto"])
    run.window(1)
    calls = []

    def half_done(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        with torch.no_grad():
            optimizer.param_groups[0]["params"][0].add_(1.0)
        FAULT.fire("pre", micro=False)

    run.optimizer.register_step_pre_hook(half_done)
    _arm("pre", None, torch.OutOfMemoryError)
    with pytest.raises(PartialStepError, match="out of memory"):
        run.window(2)
    real_loss = run.loss_fn
    run.loss_fn = lambda model, batch: calls.append(1) or real_loss(model, batch)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="no window was run: the last step failed halfway"):
        run.window(2)
    assert calls == []  # refused at once: no window rerun smaller down to one item


@pytest.mark.parametrize("drive", ["step", "micro"])
@pytest.mark.parametrize("part", ["update_scale", "update_running", "sync_buffers"])
def test_a_failure_closing_a_stepped_window_leaves_it_closed(
    part: str, drive: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss scale's update, pooled BatchNorm statistics, DDP's buffer broadcast raising.

    They ran in one `finally` after the step: one raising skipped the rest, and the window
    stayed open with the step's gradients (`step()` then refused, `flush()` crashed in a zip).
    """
    config = {"drive": drive, "bn": "pooled"}
    run, twin = Run(config), Run(config)
    run.window(1), twin.window(1)
    engine = run.acc._engine
    owners = {"update_scale": engine.runtime, "update_running": gradaccum.batchnorm}
    owner = owners.get(part, engine.sync)  # update_running: pooled statistics, in end_window
    real = getattr(owner, part)

    def failing(*args: Any, **kwargs: Any) -> None:
        monkeypatch.setattr(owner, part, real)  # once
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, part, failing)
    steps = []
    run.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    with pytest.raises(KeyboardInterrupt):
        run.window(2)
    assert len(steps) == 1
    assert run.acc.state_dict()["engine"]["window"]["micro_batches"] == 0  # closed
    assert run.acc.state_dict()["engine"]["batchnorm"]["pending"] == {}
    assert run.window(3).stepped
    assert len(steps) == 2
    twin.window(2), twin.window(3)
    mine, theirs = run.snapshot(), twin.snapshot()
    assert _differences(mine["optimizer"], theirs["optimizer"]) == []
    assert _differences(run.params(), twin.params()) == []
