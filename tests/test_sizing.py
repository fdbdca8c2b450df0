"""`gradaccum.sizing`: the memory plan against measurements of real training.

- The plan's components are the tensors' own byte counts (parameters, gradients, AdamW state).
- Its predicted peak at a size matches the peak of tensor memory measured around a real
  `Accumulator.step` at that size (the tracker counts every storage allocated, temporaries too).
- Planning leaves the model, its gradients, the buffers its forward updates (BatchNorm
  statistics, an EMA, spectral norm's vectors), the optimizer and every RNG (torch's, NumPy's,
  Python's) bitwise as they were; an "auto" window is the fixed-size window it chose.
- A probe that runs out of memory is retried smaller, and caps the plan.
- In a subprocess, training at the chosen size stays under the budget in resident memory, and
  the size is at least 90% of the largest one that fits, found by a sweep.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradaccum.memory
from gradaccum import Accumulator, MemoryBudgetError, MemoryPlan, plan_micro_batch
from gradaccum.batching import map_tensors
from gradaccum.memory import measure_activation_bytes, track_tensor_bytes
from tests.state import assert_bitwise, clone_state

ROOT = Path(__file__).resolve().parents[1]


def _model(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, 256)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(256))
    layers += [nn.Tanh(), nn.Dropout(0.1), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)]
    return nn.Sequential(*layers)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _batch(items: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(items, 32, generator=generator)
    return x, torch.randint(0, 10, (items,), generator=generator)


def _plan(model: nn.Module, budget: str = "4MiB", **kwargs) -> MemoryPlan:
    optimizer = torch.optim.AdamW(model.parameters())
    return plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget=budget, **kwargs)


def test_fixed_components_are_the_tensors_byte_counts() -> None:
    model = _model()
    plan = _plan(model)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert plan.parameters_bytes == weights
    assert plan.gradients_bytes == weights
    # AdamW after its first step: two moments per parameter, one 4-byte step count per tensor.
    assert plan.optimizer_bytes == 2 * weights + 4 * len(list(model.parameters()))
    assert plan.buffers_bytes == 0
    sgd = plan_micro_batch(
        model, _batch(), _loss, torch.optim.SGD(model.parameters(), lr=0.1), memory_budget="4MiB"
    )
    assert sgd.optimizer_bytes == 0
    assert sgd.micro_batch_size > plan.micro_batch_size  # the memory AdamW needs goes to items
    bf16 = _plan(model.bfloat16(), precision="bf16", accum_dtype=torch.float32)
    assert bf16.buffers_bytes == weights  # fp32 buffers for bf16 parameters (2 bytes each)


@pytest.mark.parametrize("size", [50, 200, 700])
def test_predicted_peak_matches_the_measured_peak_of_a_real_step(size: int) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    plan = plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="64MiB")
    acc = Accumulator(model, optimizer, micro_batch_size=size)
    batch = _batch(3 * size)  # micro-batches 2 and 3 add into existing gradients: steady state
    acc.step(batch, _loss)  # the optimizer state now exists, as in the steady state
    with track_tensor_bytes() as tracker:
        acc.step(batch, _loss)
    # What the step allocated on top of the parameters and optimizer state that already lived.
    measured = tracker.peak
    predicted = plan.predict(size) - plan.parameters_bytes - plan.optimizer_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    # NEGATIVE CONTROL: counting gradients plus the tensors saved for backward (what
    # measure_activation_bytes sees) misses the backward's and the optimizer's temporaries.
    saved = measure_activation_bytes(model, (batch[0][:size], batch[1][:size]), _loss)
    assert plan.gradients_bytes + saved < 0.95 * measured


def test_choice_is_the_largest_size_that_fits() -> None:
    plan = _plan(_model())
    m = plan.micro_batch_size
    assert 1 <= m < plan.batch_size
    assert plan.predict(m) <= plan.usable_bytes < plan.predict(m + 1)
    assert any(abs(size - m) <= 0.02 * m for size, _ in plan.probes)  # the answer was measured
    larger = _plan(_model(), "8MiB")
    assert larger.micro_batch_size > m
    everything = _plan(_model(), "1GiB")
    assert everything.micro_batch_size == everything.batch_size == 1024


def test_planning_leaves_everything_untouched() -> None:
    model = _model(batchnorm=True)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = _batch()
    x, y = _batch(64)
    _loss(model, (x, y)).backward()
    optimizer.step()  # existing state and gradients must survive planning
    before = clone_state(
        {
            "model": model.state_dict(),
            "grads": [p.grad for p in model.parameters()],
            "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
    )
    grads = [p.grad for p in model.parameters()]
    plan_micro_batch(model, batch, _loss, optimizer, memory_budget="4MiB")
    after = clone_state(
        {
            "model": model.state_dict(),
            "grads": [p.grad for p in model.parameters()],
            "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
    )
    assert_bitwise(after, before)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))


class _EmaShift(nn.Module):
    """Subtracts a running mean of its inputs that its own forward updates (a VQ-VAE codebook's
    EMA, an RL observation normalizer): a buffer no BatchNorm holds."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("average", torch.zeros(32))
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.average.mul_(0.9).add_(0.1 * x.mean(0))
        return self.linear(x - self.average)


class _OwnNoise(nn.Module):
    """Adds noise drawn from a generator of its own (a diffusion model's), not the global one."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn(x.shape, generator=self.generator, dtype=x.dtype)


def _forward_state_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        _OwnNoise(),
        _EmaShift(),
        nn.utils.spectral_norm(nn.Linear(32, 32)),  # weight_u, weight_v: each forward
        nn.utils.parametrizations.spectral_norm(nn.Linear(32, 10)),  # _u, _v likewise
    )


def _noisy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Augments with NumPy's and Python's global generators, as older pipelines do."""
    x, y = batch
    noise = torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))
    return F.cross_entropy(model(x + noise * random.random()), y)


def _host_rng() -> tuple[object, list[object]]:
    """Python's generator state; NumPy's as plain values (its key array as a list)."""
    kind, keys, *rest = np.random.get_state()
    return random.getstate(), [kind, keys.tolist(), *rest]


def test_planning_puts_back_what_the_forward_changed_and_every_generator() -> None:
    """Buffers the forward updates, a max-norm embedding's rows, NumPy's and Python's
    generators and one the model holds are left as found (before, only BatchNorm's buffers and
    torch's global generator)."""
    model = _forward_state_model()
    before = clone_state(model.state_dict())
    np.random.seed(3)
    random.seed(3)
    host = _host_rng()
    plan_micro_batch(
        model, _batch(), _noisy_loss, torch.optim.SGD(model.parameters()), memory_budget="1GiB"
    )
    assert_bitwise(clone_state(model.state_dict()), before)
    assert _host_rng() == host
    assert torch.equal(
        model[0].generator.get_state(), _forward_state_model()[0].generator.get_state()
    )
    embedding = nn.Embedding(50, 32, max_norm=0.5)  # renormalizes the rows it looks up
    tied = nn.Sequential(embedding, nn.Flatten(), nn.Linear(64, 10))
    weight = embedding.weight.detach().clone()
    ids = torch.randint(0, 50, (64, 2), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.randint(0, 10, (64,)))
    plan_micro_batch(tied, batch, _loss, torch.optim.SGD(tied.parameters()), memory_budget="1GiB")
    assert torch.equal(embedding.weight, weight)
    # NEGATIVE CONTROL: one forward of the probe's, left in place, does change them.
    _noisy_loss(model, (_batch()[0][:8], _batch()[1][:8]))
    with pytest.raises(AssertionError):
        assert_bitwise(clone_state(model.state_dict()), before)


def test_auto_sizing_steps_as_the_size_it_chose_from_the_start() -> None:
    """With a forward that updates buffers and draws from its own generator, and a loss drawing
    from NumPy, an "auto" window equals a fixed-size one of the size it chose: before, the
    planning probes' forwards had advanced the EMA, spectral norm's vectors and the generators
    first (0.08 on the EMA, 1e-3 on the weights after one step)."""
    x, y = _batch(64)
    models = _forward_state_model(), _forward_state_model()
    auto = Accumulator(
        models[0],
        torch.optim.SGD(models[0].parameters(), lr=0.1),
        micro_batch_size="auto",
        memory_budget="1GiB",
    )
    np.random.seed(0)
    random.seed(0)
    chosen = auto.step((x, y), _noisy_loss).micro_batch_size
    assert chosen == 64  # everything fits: one micro-batch, the plain full-batch step
    fixed = Accumulator(
        models[1], torch.optim.SGD(models[1].parameters(), lr=0.1), micro_batch_size=chosen
    )
    np.random.seed(0)
    random.seed(0)
    fixed.step((x, y), _noisy_loss)
    assert_bitwise(clone_state(models[0].state_dict()), clone_state(models[1].state_dict()))


class _OomAbove(nn.Module):
    def __init__(self, inner: nn.Module, threshold: int) -> None:
        super().__init__()
        self.inner, self.threshold = inner, threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.threshold:
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} items")
        return self.inner(x)


def test_a_probe_that_runs_out_of_memory_is_retried_smaller_and_caps_the_plan() -> None:
    model = _OomAbove(_model(), threshold=100)
    plan = _plan(model, "1GiB")
    assert plan.micro_batch_size <= 100
    assert all(size <= 100 for size, _ in plan.probes)
    with pytest.raises(MemoryBudgetError, match="even at micro_batch_size=1"):
        _plan(_OomAbove(_model(), threshold=0), "1GiB")


def test_budget_errors_name_the_fix() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="memory_budget is required on cpu"):
        plan_micro_batch(model, _batch(), _loss, optimizer)
    with pytest.raises(ValueError, match="not a size"):
        plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="plenty")
    with pytest.raises(MemoryBudgetError, match=r"parameters, gradients and optimizer state"):
        plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="100KiB")
    with pytest.raises(ValueError, match="margin"):
        plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="4MiB", margin=1.5)


def test_str_is_a_table_of_components_and_the_choice() -> None:
    plan = _plan(_model())
    text = str(plan)
    for row in (
        "parameters",
        "gradients",
        "optimizer state",
        "activations per item",
        "memory budget",
        f"chosen micro_batch_size = {plan.micro_batch_size}",
    ):
        assert row in text
    assert f"{plan.parameters_bytes:,}" in text
    assert "MiB" in text


@pytest.mark.slow  # a training subprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc")
def test_resident_memory_of_training_stays_under_the_budget() -> None:
    """Subprocess: RSS growth of real training at the plan's size vs the budget, and a sweep."""
    budget = 64 * 2**20
    # glibc would otherwise keep freed tensor memory (see tests/rss_worker.py, docs/memory.md).
    # The root first, for `-m tests.rss_worker`; a PYTHONPATH already set (a checkout's src/ run
    # without installing it) is kept, or the child would import another copy of gradaccum.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-m", "tests.rss_worker", "64MiB"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=110,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    chosen, runs = report["plan"], report["runs"]
    assert runs["largest"]["used"] == chosen
    assert runs["largest"]["peak"] <= budget, report
    sweep = {int(size): run["peak"] for size, run in runs.items() if size != "largest"}
    too_big = min((size for size, peak in sweep.items() if peak > budget), default=None)
    assert too_big is not None, f"the sweep must reach sizes that do not fit: {report}"
    fits = max(size for size in sweep if size < too_big)
    # The largest size that fits, between the two: peak RSS grows linearly with the size, so
    # interpolate. (`too_big - 1` was used before: when a sweep size lands within the RSS noise of
    # the budget, measured at 1.006-1.014 of it for 0.8 of the batch, one run in a while finds it
    # under, and `too_big` jumps a whole sweep step up past what the plan may be asked to reach.)
    boundary = fits + (too_big - fits) * (budget - sweep[fits]) / (sweep[too_big] - sweep[fits])
    assert chosen >= 0.9 * boundary, (boundary, report)
    # NEGATIVE CONTROL: the sweep's over-budget sizes really are over; the check can fail.
    assert sweep[max(sweep)] > budget


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, fused=True),
        lambda p: torch.optim.AdamW(p, foreach=True),
        lambda p: torch.optim.Adagrad(p),  # its state exists before the first step
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ],
    ids=["adamw-fused", "adamw-foreach", "adagrad", "sgd-momentum"],
)
def test_optimizer_state_and_workspace_match_a_real_step(make) -> None:
    model = _model()
    optimizer = make(model.parameters())
    plan = plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="4MiB")
    twin = _model()
    real = make(twin.parameters())
    _loss(twin, _batch(64)).backward()
    before = sum(t.numel() * t.element_size() for s in real.state.values()
                 for t in s.values() if isinstance(t, torch.Tensor))  # fmt: skip
    with track_tensor_bytes() as tracker:
        real.step()
    after = sum(t.numel() * t.element_size() for s in real.state.values()
                for t in s.values() if isinstance(t, torch.Tensor))  # fmt: skip
    assert plan.optimizer_bytes == after
    measured_workspace = tracker.peak - (after - before)
    # The fused kernel has (almost) no temporaries; its replay with foreach bounds it above.
    assert plan.step_workspace_bytes >= measured_workspace
    if not optimizer.defaults.get("fused"):
        assert abs(plan.step_workspace_bytes - measured_workspace) <= 64


def test_model_buffers_count_as_fixed_memory() -> None:
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 10)
            self.register_buffer("table", torch.zeros(2**18))  # 1 MiB held by the model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.table[:10]

    model = Table()
    plan = plan_micro_batch(model, _batch(), _loss, torch.optim.SGD(model.parameters(), lr=0.1),
                            memory_budget="4MiB")  # fmt: skip
    assert plan.parameters_bytes == 2**20 + (32 * 10 + 10) * 4


def test_cuda_budget_defaults_to_a_share_of_free_memory(monkeypatch) -> None:
    """No GPU here: a stand-in reports the device's free and total bytes."""
    from gradaccum.sizing import resolve_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 24 * 2**30))
    assert resolve_budget(None, torch.device("cuda", 0)) == int(0.9 * 10 * 2**30)
    assert resolve_budget("2GiB", torch.device("cuda", 0)) == 2 * 2**30  # given: used as is


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


def test_probes_slice_every_leaf_by_the_batch_rules() -> None:
    """A probe of n items gets n texts and n rows of a dataclass, as a micro-batch would."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    items = 16
    batch = {
        "pair": _Pair(torch.randn(items, 4), torch.randn(items, 1)),
        "texts": list("a" * items),
    }
    seen = []

    def loss_fn(m: nn.Module, b: dict) -> torch.Tensor:
        seen.append((len(b["texts"]), len(b["pair"].x)))
        assert len(b["texts"]) == len(b["pair"].x)
        return F.mse_loss(m(b["pair"].x), b["pair"].y)

    plan = plan_micro_batch(model, batch, loss_fn, optimizer, memory_budget="64MiB")
    assert plan.micro_batch_size == items
    assert seen
    assert all(texts == rows for texts, rows in seen)
    # Negative control: cutting every tensor to n items (the old probe) leaves the texts whole.
    cut = map_tensors(batch, lambda t: t[:4])
    assert (len(cut["texts"]), len(cut["pair"].x)) == (items, 4)


class _SequenceFirst(nn.Module):
    """A GRU over `(seq, batch, features)`: items are along dim 1, time along dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _sequence_first_loss(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    out = model(batch[0])
    return F.cross_entropy(out.reshape(-1, 3), batch[1].reshape(-1))


def test_plan_and_auto_read_items_along_batch_dim() -> None:
    """Sequence-first batches: the plan counts and slices items along `batch_dim`, not time."""
    torch.manual_seed(0)
    model = _SequenceFirst()
    x, y = torch.randn(5, 24, 4), torch.randint(0, 3, (5, 24))  # 5 steps, 24 items
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = plan_micro_batch(
        model, (x, y), _sequence_first_loss, optimizer, memory_budget="1GiB", batch_dim=1
    )
    assert plan.batch_size == 24
    assert plan.micro_batch_size == 24  # 1 GiB holds all of them
    acc = Accumulator(
        model, optimizer, micro_batch_size="largest", memory_budget="1GiB", batch_dim=1
    )
    result = acc.step((x, y), _sequence_first_loss)
    assert (result.micro_batch_size, result.micro_batches, result.count) == (24, 1, 24)
    # NEGATIVE CONTROL: read along dim 0, the 5 time steps pass for 5 items.
    wrong = plan_micro_batch(model, (x, y), _sequence_first_loss, optimizer, memory_budget="1GiB")
    assert wrong.batch_size == 5


def test_cuda_default_budget_adds_back_what_the_model_already_holds(monkeypatch) -> None:
    """Free memory excludes the parameters (and any gradients, optimizer state) already on the
    device, which the plan counts in its fixed part: the default budget adds them back."""
    from gradaccum._probe import resident_bytes
    from gradaccum.sizing import resolve_budget

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = (torch.randn(64, 512), torch.randn(64, 1))
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert resident_bytes(model, optimizer) == weights  # before training: the weights alone
    _loss(model, batch).backward()
    optimizer.step()  # now gradients and both Adam moments (and 4-byte steps) are resident
    steps = 4 * len(list(model.parameters()))
    assert resident_bytes(model, optimizer) == 4 * weights + steps
    resident = resident_bytes(model, optimizer)
    # The device: the model's state is allocated, 4 MiB are still free.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * 2**20, 24 * 2**30))
    budget = resolve_budget(None, torch.device("cuda", 0), resident=resident)
    assert budget == int(0.9 * 4 * 2**20) + resident
    plan = plan_micro_batch(model, batch, _loss, optimizer, memory_budget=budget)
    assert plan.micro_batch_size == 64  # the free memory holds the step and the activations
    # NEGATIVE CONTROL: the free share alone counts the resident state twice and gives up.
    with pytest.raises(MemoryBudgetError):
        plan_micro_batch(
            model, batch, _loss, optimizer, memory_budget=resolve_budget(None, torch.device("cuda"))
        )


def test_a_lazy_module_that_has_not_run_is_refused_naming_the_fix() -> None:
    """Before, torch's own error about numel() of an uninitialized parameter came out."""
    lazy = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 10))
    optimizer = torch.optim.SGD(lazy.parameters())
    with pytest.raises(ValueError, match=r"0\.weight is uninitialized .*run one forward pass"):
        plan_micro_batch(lazy, _batch(), _loss, optimizer, memory_budget="1GiB")
    assert torch.nn.parameter.is_lazy(lazy[0].weight)  # nothing ran
    # NEGATIVE CONTROL: after one forward (and an optimizer built on it), it plans.
    lazy(_batch()[0][:2])
    optimizer = torch.optim.SGD(lazy.parameters())
    plan = plan_micro_batch(lazy, _batch(), _loss, optimizer, memory_budget="1GiB")
    assert plan.micro_batch_size == 1024


class _TrustSGD(torch.optim.Optimizer):
    """A hand-written momentum SGD whose step reads settings kept as attributes."""

    def __init__(self, params, lr: float = 0.1, trust: float = 0.5) -> None:
        super().__init__(params, {"lr": lr})
        self.trust = trust  # not in `defaults`: a plain deep copy of an Optimizer drops it
        self.calls: list[int] = []

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.calls.append(1)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "m" not in state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad)
                p.add_(state["m"], alpha=-group["lr"] * self.trust)


def test_a_custom_optimizer_keeping_settings_as_attributes_plans_and_steps_exactly() -> None:
    """Before, planning's replay lost `self.trust` (Optimizer.__getstate__ keeps three entries):
    `plan_micro_batch` and `micro_batch_size="auto"` raised AttributeError before any step."""
    model = _model()
    optimizer = _TrustSGD(model.parameters())
    plan = plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="4MiB")
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert plan.optimizer_bytes == weights  # one momentum buffer per parameter
    assert optimizer.calls == []  # the replay left the real one alone
    assert optimizer.state == {}
    # The "auto" step is the plain full-batch step (float64, no dropout: exact).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    twin = copy.deepcopy(net)
    batch = (_batch(96)[0].double(), _batch(96)[1])
    acc = Accumulator(
        net, _TrustSGD(net.parameters()), micro_batch_size="auto", memory_budget="1GiB"
    )
    plain = _TrustSGD(twin.parameters())
    for _ in range(3):
        assert acc.step(batch, _loss).stepped
        plain.zero_grad(set_to_none=True)
        _loss(twin, batch).backward()
        plain.step()
    for mine, theirs in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    # NEGATIVE CONTROL: a plain deep copy, as the replay was, has lost the attribute.
    with pytest.raises(AttributeError, match="trust"):
        copy.deepcopy(optimizer).trust  # noqa: B018


def test_planning_with_a_scheduler_replays_a_copy_not_the_real_optimizer() -> None:
    """Every torch scheduler replaces `optimizer.step` by a wrapper stepping the real optimizer;
    the replay was given it among the optimizer's own attributes: the plan counted no optimizer
    state, and the gradients present took a real AdamW step (0.3 off), silently."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)  # built first, as usual
    _loss(model, _batch(64)).backward()  # gradients present when planning
    before = clone_state({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    plan = plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="4MiB")
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert plan.optimizer_bytes == 2 * weights + 4 * len(list(model.parameters()))  # was 0
    after = clone_state({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert_bitwise(after, before)  # was stepped
    # "auto" with a schedule equals the plain full-batch steps (float64, no dropout: exact).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    twin = copy.deepcopy(net)
    batch = (_batch(96)[0].double(), _batch(96)[1])
    adamw, plain = torch.optim.AdamW(net.parameters()), torch.optim.AdamW(twin.parameters())
    mine = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
    theirs = torch.optim.lr_scheduler.LambdaLR(plain, lambda step: 0.5**step)
    _loss(net, batch).backward()  # a gradient left over: the step discards it
    acc = Accumulator(net, adamw, micro_batch_size="auto", memory_budget="1GiB", scheduler=mine)
    for _ in range(3):
        assert acc.step(batch, _loss).stepped
        plain.zero_grad(set_to_none=True)
        _loss(twin, batch).backward()
        plain.step()
        theirs.step()
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("foreach", [False, True])
def test_an_optimizer_reading_a_value_in_its_step_is_planned_and_auto_is_exact(
    foreach: bool,
) -> None:
    """torch's Adafactor scales its step by `param.norm().item()`: the meta replay that sizes
    the optimizer's state raised "Tensor.item() cannot be called on meta tensors" from
    `plan_micro_batch` and from the first `"auto"` step. The replay reads 1 there: the plan
    counts Adafactor's factored state (a row and a column per matrix), and "auto" windows are
    the plain full-batch steps (float64 rtol 1e-10), optimizer state included."""
    model = _model()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2, foreach=foreach)
    plan = plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="4MiB")
    probe = copy.deepcopy(model)
    real = torch.optim.Adafactor(probe.parameters(), lr=1e-2, foreach=foreach)
    _loss(probe, _batch()).backward()
    real.step()
    state = sum(v.numel() * v.element_size() for s in real.state.values() for v in s.values())
    assert plan.optimizer_bytes == state
    assert state < sum(p.numel() * 4 for p in model.parameters())  # factored: not a full copy
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    twin = copy.deepcopy(net)
    batch = (_batch(96)[0].double(), _batch(96)[1])
    mine = torch.optim.Adafactor(net.parameters(), lr=1e-2, foreach=foreach)
    plain = torch.optim.Adafactor(twin.parameters(), lr=1e-2, foreach=foreach)
    acc = Accumulator(net, mine, micro_batch_size="auto", memory_budget="40KiB")
    for _ in range(3):
        result = acc.step(batch, _loss)
        assert result.stepped
        assert result.micro_batches > 1  # a budget the whole batch does not fit in
        plain.zero_grad(set_to_none=True)
        _loss(twin, batch).backward()
        plain.step()
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)
    for a, b in zip(mine.state.values(), plain.state.values(), strict=True):
        for key in b:
            torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=0)


def test_negative_control_a_replay_without_stand_in_values_cannot_size_adafactor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gradaccum.memory, "_READ_SCALAR", None)
    model = _model()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="meta tensors"):
        plan_micro_batch(model, _batch(), _loss, optimizer, memory_budget="4MiB")
