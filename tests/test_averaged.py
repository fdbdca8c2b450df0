"""gradaccum._averaged: an EMA/SWA copy kept inside the model, `self.ema = AveragedModel(net)`.

The copy's parameters require grad and its BatchNorm layers are in train mode (AveragedModel
deep-copies the module as it is), but it never runs in a training step. It used to be warned of
as "trainable parameters nothing trains", named as a BatchNorm normalizing micro-batches (by the
Accumulator's warning and by `check_equivalence`), and its weights counted as gradients in the
memory plan (`plan_micro_batch`, `micro_batch_size="auto"`), and its buffers were put back by a
failed window as if a forward had updated them. Each test has a control: a plain copy of the
network held the same way is still treated as trained.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from gradaccum import Accumulator, check_equivalence, plan_micro_batch
from gradaccum._buffer_watch import ForwardStateWarning
from gradaccum.batchnorm import BatchNormAccumulationWarning

RTOL, ATOL = 1e-10, 1e-12


def _net(norm: type[nn.Module] = nn.GroupNorm) -> nn.Sequential:
    torch.manual_seed(0)
    layer = nn.GroupNorm(2, 6) if norm is nn.GroupNorm else nn.BatchNorm2d(6)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), layer, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(6, 5),
    ).double()  # fmt: skip


class _Holder(nn.Module):
    """A training module keeping its weight average as an attribute, as many recipes do."""

    def __init__(self, net: nn.Module, averaged: bool = True) -> None:
        super().__init__()
        self.net = net
        ema = get_ema_multi_avg_fn(0.9)
        self.ema = AveragedModel(net, multi_avg_fn=ema) if averaged else copy.deepcopy(net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,))


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _close(a: nn.Module, b: nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.allclose(p, q, rtol=RTOL, atol=ATOL) for p, q in pairs)


def _run(every_micro_step: bool = False) -> tuple[_Holder, list[warnings.WarningMessage]]:
    """12 items as 4 micro-batches of 3, windows of 2; the EMA updated when a window stepped."""
    holder = _Holder(_net())
    optimizer = torch.optim.SGD(holder.net.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accumulator(holder, optimizer, accumulation_steps=2)
        for i in range(0, 12, 3):
            result = acc.micro_step((x[i : i + 3], y[i : i + 3]), _ce)
            if result.stepped or every_micro_step:
                holder.ema.update_parameters(holder.net)
    return holder, caught


def test_an_ema_held_by_the_model_is_not_warned_of_and_averages_the_full_batch_steps() -> None:
    holder, caught = _run()
    assert [str(w.message) for w in caught] == []  # was: "8 trainable parameters ... no group"
    reference = _net()
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    for window in (slice(0, 6), slice(6, 12)):
        optimizer.zero_grad()
        _ce(reference, (x[window], y[window])).backward()
        optimizer.step()
        ref_ema.update_parameters(reference)
    assert _close(holder.net, reference)
    assert _close(holder.ema, ref_ema)
    assert all(p.grad is None for p in holder.ema.parameters())
    # Controls: updated after every micro_step() the average is off; and a plain copy of the
    # network held the same way (not an AveragedModel) is still warned of.
    naive, _ = _run(every_micro_step=True)
    assert _close(naive.net, reference)
    assert not _close(naive.ema, ref_ema)
    plain = _Holder(_net(), averaged=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Accumulator(plain, torch.optim.SGD(plain.net.parameters(), lr=0.5), micro_batch_size=3)
    assert any("ema.0.weight" in str(w.message) for w in caught)


def test_an_emas_batchnorm_is_not_named_as_normalizing_micro_batches() -> None:
    named = {}
    for averaged in (True, False):  # False: the control, a plain train-mode copy, is named
        holder = _Holder(_net(nn.BatchNorm2d), averaged=averaged)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = torch.optim.SGD(holder.parameters(), lr=0.1)
            acc = Accumulator(holder, optimizer, micro_batch_size=3)
            acc.step(_data(), _ce)
        (warning,) = [w for w in caught if w.category is BatchNormAccumulationWarning]
        report = check_equivalence(holder, _data(), _ce, 3)
        named[averaged] = (str(warning.message), [m.name for m in report.non_additive])
    assert "(net.1)" in named[True][0]
    assert named[True][1] == ["net.1"]
    assert "(net.1, ema.1)" in named[False][0]
    # check_equivalence lists only modules that ran: the copy never does (it listed ema.1).
    assert named[False][1] == ["net.1"]


def test_the_memory_plan_counts_no_gradient_for_an_ema_held_by_the_model() -> None:
    net = _net()
    optimizer = torch.optim.AdamW(net.parameters())
    alone = plan_micro_batch(net, _data(), _ce, optimizer, memory_budget="1GiB")
    plans = {}
    for averaged in (True, False):
        holder = _Holder(_net(), averaged=averaged)
        optimizer = torch.optim.AdamW(holder.net.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the control's copy is warned of
            plan = plan_micro_batch(holder, _data(), _ce, optimizer, memory_budget="1GiB")
        plans[averaged] = plan
    assert plans[True].gradients_bytes == alone.gradients_bytes
    assert plans[False].gradients_bytes == 2 * alone.gradients_bytes  # a plain copy: counted


def test_an_ema_updated_after_every_micro_step_is_warned_of_and_never_put_back() -> None:
    """The README's wrong way: the average takes accumulation_steps updates per step. It is
    named (it used to read as "the model's forward updated the buffers ema.n_averaged"), and a
    failed window leaves the user's updates alone: it used to put `n_averaged` back, but not
    the averaged weights, leaving the two disagreeing."""
    holder = _Holder(_net())
    acc = Accumulator(
        holder, torch.optim.SGD(holder.net.parameters(), lr=0.5), accumulation_steps=3
    )
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(0, 9, 3):
            acc.micro_step((x[i : i + 3], y[i : i + 3]), _ce)
            holder.ema.update_parameters(holder.net)
    (warning,) = caught
    assert warning.category is ForwardStateWarning
    assert warning.filename == __file__
    assert re.search(r"weight average ema .*result\.stepped", str(warning.message))
    assert "forward updated" not in str(warning.message)
    acc.micro_step((x[9:], y[9:]), _ce)
    holder.ema.update_parameters(holder.net)
    updated = [p.detach().clone() for p in holder.ema.parameters()]
    with pytest.raises(ZeroDivisionError):
        acc.micro_step((x[9:], y[9:]), lambda m, b: 1 / 0)  # the window is forgotten
    assert int(holder.ema.n_averaged) == 4  # the four updates made, as the weights say
    assert all(torch.equal(p, q) for p, q in zip(holder.ema.parameters(), updated, strict=True))


def test_a_mid_window_state_naming_an_emas_buffer_still_loads() -> None:
    """States saved before the EMA's buffers were left out of the window's copies named them."""
    holder = _Holder(_net())
    acc = Accumulator(
        holder, torch.optim.SGD(holder.net.parameters(), lr=0.5), accumulation_steps=3
    )
    x, y = _data()
    acc.micro_step((x[:3], y[:3]), _ce)
    state = acc.state_dict()
    state["engine"]["buffers"].append(["ema.n_averaged", holder.ema.n_averaged.clone()])
    acc.load_state_dict(state)
    # Control: a name that is no buffer of the model is still refused as damaged.
    state["engine"]["buffers"].append(["ema.no_such_buffer", torch.zeros(())])
    with pytest.raises(ValueError, match="damaged"):
        acc.load_state_dict(state)


@pytest.mark.parametrize("frozen", [False, True])
def test_updates_in_windows_of_two_are_warned_of_but_a_per_epoch_swa_is_not(frozen: bool) -> None:
    """Windows of 2: one update inside each window, warned from the second. The control, a
    per-epoch SWA under partial_window="carry" (7 micro-batches per epoch, windows of 3), is
    updated inside the window straddling each epoch's end only: not warned of. An average
    frozen with requires_grad_(False) is said the same once (not also as frozen parameters a
    window changed, which the per-epoch SWA was warned as)."""
    x, y = _data(21)
    loader = [(x[i : i + 3], y[i : i + 3]) for i in range(0, 21, 3)]
    for steps, per_epoch in ((2, False), (3, True)):
        holder = _Holder(_net())
        holder.ema.requires_grad_(not frozen)
        optimizer = torch.optim.SGD(holder.net.parameters(), lr=0.5)
        acc = Accumulator(holder, optimizer, accumulation_steps=steps, partial_window="carry")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):  # epochs
                for micro_batch in loader[: 7 if per_epoch else 4]:
                    acc.micro_step(micro_batch, _ce)
                    if not per_epoch:
                        holder.ema.update_parameters(holder.net)
                if per_epoch:
                    holder.ema.update_parameters(holder.net)
            acc.flush("step")
        assert len(caught) == (0 if per_epoch else 1)
        assert per_epoch or "weight average ema" in str(caught[0].message)


# --- A user's own EMA class (structure, not class names) --------------------------------------


class _OwnEma(nn.Module):
    """A hand-written EMA: a deep copy kept as `self.shadow`, in train mode, weights trainable."""

    def __init__(self, net: nn.Module, decay: float = 0.9) -> None:
        super().__init__()
        self.shadow, self.decay = copy.deepcopy(net), decay

    @torch.no_grad()
    def update(self, net: nn.Module) -> None:
        for mine, theirs in zip(self.shadow.parameters(), net.parameters(), strict=True):
            mine.lerp_(theirs, 1 - self.decay)


class _TimmStyleEma(nn.Module):
    """timm's ModelEmaV2 shape: the copy as `self.module`, put in eval mode."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.module = copy.deepcopy(net).eval()


class _Tower(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.encoder = net


@pytest.mark.parametrize("kind", ["own", "timm", "whole_model"])
def test_a_users_own_ema_class_inside_the_model_is_not_warned_of_and_steps_exactly(
    kind: str,
) -> None:
    holder = nn.Module()
    holder.net = _net()
    if kind == "whole_model":  # `self.ema = Ema(self)` at the end of the model's __init__
        holder.ema = _OwnEma(holder)
    else:
        holder.ema = _OwnEma(holder.net) if kind == "own" else _TimmStyleEma(holder.net)
    reference = copy.deepcopy(holder.net)
    optimizer = torch.optim.SGD(holder.net.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accumulator(holder, optimizer, micro_batch_size=3)
        acc.step((x, y), lambda m, b: _ce(m.net, b))
    # Before: "12 trainable parameters of the model (ema.shadow.0.weight, ...) are in no param
    # group of the optimizer".
    assert [str(w.message) for w in caught] == []
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    _ce(reference, (x, y)).backward()
    ref_optimizer.step()
    assert _close(holder.net, reference)
    assert all(p.grad is None for p in holder.ema.parameters())


def test_structural_twins_the_optimizer_misses_are_still_warned_of() -> None:
    """Controls: two towers of one architecture, and a copy held bare, are not weight averages."""
    towers = nn.Module()
    towers.query, towers.doc = _Tower(_net()), _Tower(_net())  # the doc tower forgotten
    bare = nn.Module()
    bare.net = _net()
    bare.ema = copy.deepcopy(bare.net)  # bare: indistinguishable from a forgotten twin
    other = nn.Module()
    # A wrapper whose copy has no trained original: a forgotten head, not an average.
    other.net, other.head = _net(), _OwnEma(nn.Sequential(nn.Linear(5, 2), nn.Linear(2, 2)))
    for model, owner, missed in (
        (towers, towers.query, "doc.encoder.0.weight"),
        (bare, bare.net, "ema.0.weight"),
        (other, other.net, "head.shadow.0.weight"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Accumulator(model, torch.optim.SGD(owner.parameters(), lr=0.1), micro_batch_size=3)
        assert any(missed in str(w.message) for w in caught), missed


def test_check_equivalence_lists_only_modules_that_ran_not_an_ema_copys_batchnorm() -> None:
    """A user's own EMA class kept inside the model (`self.shadow = copy.deepcopy(net)`, left
    in train mode by `model.train()`) never runs in the window, yet check_equivalence listed its
    BatchNorm and dropout among `.non_additive` (a false alarm on an exact check, and a wrong
    cause when another gap shows). Only modules that ran count now; a mean teacher whose loss
    runs the EMA copy (in train mode) still has it listed."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3)
    )
    holder = nn.Module()
    holder.net, holder.ema = net, _OwnEma(net)
    holder.double().train()
    net.eval()  # the trained network's BatchNorm frozen (fine-tuning): exact
    x = torch.randn(12, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    report = check_equivalence(holder, (x, y), lambda m, b: _ce(m.net, b), 4)
    assert report.ok
    assert [m.name for m in report.non_additive] == []

    def mean_teacher(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            target = m.ema.shadow(b[0]).softmax(-1)
        out = m.net(b[0])
        return _ce(m.net, b) + ((out.softmax(-1) - target) ** 2).sum(-1).mean()

    report = check_equivalence(holder, (x, y), mean_teacher, 4)
    assert {"ema.shadow.1", "ema.shadow.3"} <= {m.name for m in report.non_additive}
