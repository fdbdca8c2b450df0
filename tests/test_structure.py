"""Modules set on a model after its Accumulator was built: a replaced head (`gradaccum._structure`).

Fine-tuning replaces a head after building (`model.fc = nn.Sequential(..., nn.BatchNorm1d, ...)`)
and gives the Accumulator an optimizer over it. Each reference is a plain PyTorch loop on a deep
copy with the same head set at the same point. The negative controls run the same windows with the
structure watch blind (`StructureWatch.look` returning None), as the engine read the model before.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from gradaccum import Accumulator
from gradaccum._buffer_watch import ForwardStateWarning
from gradaccum._structure import StructureWatch
from gradaccum.batchnorm import BatchNormAccumulationWarning

RTOL, ATOL = 1e-10, 1e-12


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


class _Counted(nn.Module):
    """A head whose forward updates a buffer (a running count of its rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return self.linear(x)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (8,), generator=g
    )


def _plain_step(optimizer: torch.optim.Optimizer, reference: nn.Module) -> None:
    """The reference: one plain full-batch step."""
    optimizer.zero_grad()
    _loss(reference, _batch()).backward()
    optimizer.step()


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _bn_head() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()


def _built(batchnorm: str = "micro", lr: float = 0.1) -> tuple[nn.Module, Accumulator]:
    """A model with an Accumulator that took one window, then its head replaced, optimizer given."""
    torch.manual_seed(0)
    model = _Net().double()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=lr), micro_batch_size=3, batchnorm=batchnorm
    )
    acc.step(_batch(), _loss)
    return model, acc


def _blind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StructureWatch, "look", lambda self: None)


def _pooled_gap() -> float:
    model, acc = _built("pooled", lr=0.0)
    model.fc = _bn_head()
    reference = copy.deepcopy(model)
    acc.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    acc.step(_batch(), _loss)
    reference(_batch()[0])  # one full-batch forward in train mode: the pooled statistics
    bn, ref = model.fc[1], reference.fc[1]
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(bn, key), getattr(ref, key), rtol=RTOL, atol=ATOL)
    return 0.0


def test_a_batchnorm_head_set_after_building_pools_its_statistics() -> None:
    assert _pooled_gap() == 0.0


def test_negative_control_a_blind_watch_updates_the_new_batchnorm_per_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _blind(monkeypatch)
    with pytest.raises(AssertionError):
        _pooled_gap()


def _fail_second_micro_batch() -> object:
    calls = [0]

    def failing(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom")
        return _loss(model, batch)

    return failing


@pytest.mark.parametrize("head", ["batchnorm", "buffer"])
def test_a_failed_window_puts_back_the_state_of_a_head_set_after_building(head: str) -> None:
    model, acc = _built()
    model.fc = _bn_head() if head == "batchnorm" else _Counted().double()
    acc.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormAccumulationWarning)
        with pytest.raises(RuntimeError, match="boom"):
            acc.step(_batch(), _fail_second_micro_batch())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_negative_control_a_blind_watch_leaves_the_new_heads_statistics_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _blind(monkeypatch)
    with pytest.raises(AssertionError, match="running_mean"):
        test_a_failed_window_puts_back_the_state_of_a_head_set_after_building("batchnorm")


def test_a_batchnorm_head_set_after_building_is_warned_of_and_a_buffer_head_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, acc = _built()
    model.fc = _bn_head()
    acc.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(BatchNormAccumulationWarning, match="fc.1"):
        acc.step(_batch(), _loss)
    model.fc = _Counted().double()
    acc.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(ForwardStateWarning, match="fc.seen"):
        acc.step(_batch(), _loss)
    _blind(monkeypatch)  # control: without the watch, neither is told
    model, acc = _built()
    model.fc = _bn_head()
    acc.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.step(_batch(), _loss)


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[object, ...]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def test_a_head_replaced_under_an_optimizer_of_the_old_head_is_refused_changing_nothing() -> None:
    torch.manual_seed(0)
    model = _Net().double()
    model.body.requires_grad_(False)  # a frozen backbone, the head alone trained
    optimizer = torch.optim.AdamW(model.fc.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    acc.step(_batch(), _loss)
    torch.manual_seed(5)
    model.fc = nn.Linear(8, 3).double()  # the optimizer is not rebuilt
    reference = copy.deepcopy(model)
    weights, state = _snapshot(model, optimizer)
    with pytest.raises(ValueError, match=r"holds none of the model's parameters.*acc\.optimizer ="):
        acc.step(_batch(), _loss)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert str(optimizer.state_dict()) == str(state)
    assert all(p.grad is None for p in model.parameters())
    # The fix it names: the step equals a plain full-batch step of the new head.
    acc.optimizer = torch.optim.AdamW(model.fc.parameters(), lr=1e-2)
    plain = torch.optim.AdamW(reference.fc.parameters(), lr=1e-2)
    for _ in range(2):
        acc.step(_batch(), _loss)
        _plain_step(plain, reference)
    _assert_same(model, reference)


def test_negative_control_a_blind_watch_blames_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    _blind(monkeypatch)
    torch.manual_seed(0)
    model = _Net().double()
    model.body.requires_grad_(False)
    acc = Accumulator(model, torch.optim.AdamW(model.fc.parameters(), lr=1e-2), micro_batch_size=3)
    model.fc = nn.Linear(8, 3).double()
    with pytest.raises(ValueError, match="the loss's graph does not reach them"):
        acc.step(_batch(), _loss)
    assert model.fc.weight.grad is not None  # and the new head kept the discarded gradients


def test_a_new_head_outside_the_optimizer_is_warned_of_and_the_rest_steps_exactly() -> None:
    model, acc = _built()
    reference = copy.deepcopy(model)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain.load_state_dict(acc.optimizer.state_dict())
    torch.manual_seed(5)
    model.fc = nn.Linear(8, 3).double()  # the optimizer over the old head is kept
    torch.manual_seed(5)
    reference.fc = nn.Linear(8, 3).double()
    with pytest.warns(UserWarning, match=r"fc\.weight, fc\.bias\) got gradients.*acc\.optimizer"):
        acc.step(_batch(), _loss)
    _plain_step(plain, reference)
    _assert_same(model, reference)
    assert model.fc.weight.grad is None  # cleared, as the warning says


def test_modules_built_elsewhere_change_nothing_and_warn_nothing() -> None:
    """A loss module built in `loss_fn`, another model built between windows: no re-reading."""
    torch.manual_seed(0)
    model = _Net().double()
    reference = copy.deepcopy(model)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=3)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)

    def building(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nn.Linear(2, 2)  # a module built (and registered parameters) inside the window
        return nn.CrossEntropyLoss()(m(batch[0]), batch[1])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            nn.Sequential(nn.BatchNorm1d(3))  # another model, never set on this one
            acc.step(_batch(), building)
            _plain_step(plain, reference)
    _assert_same(model, reference)
    assert acc._engine._params._structure.look() is None
