"""Buffers other than BatchNorm's that a forward updates: warned about once, put back on failure.

A VQ-VAE's EMA codebook, spectral norm's power-iteration vectors and step counters advance once
per micro-batch. Before, the Accumulator said nothing about them, and a window that raised,
was skipped as non-finite or dropped left them advanced although its note said nothing changed.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import gradaccum
from gradaccum import Accumulator
from gradaccum._buffer_watch import ForwardStateWarning


class _EmaCodebook(torch.nn.Module):
    """A VQ layer whose codebook is an EMA of the encodings, updated in every train forward.

    `how` picks the update style seen in the wild: in place, through `.data` (no version
    bump), or by reassigning the buffer attribute (a new tensor).
    """

    def __init__(self, how: str = "in_place") -> None:
        super().__init__()
        self.encode = torch.nn.Linear(4, 3)
        self.decode = torch.nn.Linear(3, 4)
        self.how = how
        self.register_buffer("codebook", torch.randn(5, 3))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mask", torch.ones(4))  # constant: never reported
        self.register_buffer("cache", torch.tensor([1.0, math.nan]))  # constant, NaN inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encode(x)
        index = torch.cdist(z, self.codebook).argmin(1)
        if self.training:
            with torch.no_grad():
                mean = torch.zeros_like(self.codebook).index_add_(0, index, z)
                if self.how == "in_place":
                    self.codebook.mul_(0.9).add_(mean, alpha=0.1)
                    self.calls += 1
                elif self.how == "data":
                    self.codebook.data.mul_(0.9).add_(mean, alpha=0.1)
                else:
                    self.codebook = self.codebook * 0.9 + 0.1 * mean
        quantized = z + (self.codebook[index] - z).detach()
        return self.decode(quantized) * self.mask


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), x)


def _setup(how: str = "in_place", **kwargs) -> tuple[torch.nn.Module, Accumulator]:
    torch.manual_seed(0)
    model = _EmaCodebook(how).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, Accumulator(model, optimizer, micro_batch_size=4, **kwargs)


def _batch() -> torch.Tensor:
    return torch.randn(12, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_buffers_updated_by_the_forward_are_warned_about_once() -> None:
    _, acc = _setup()
    with pytest.warns(ForwardStateWarning, match=r"codebook, calls in this window") as caught:
        acc.step(_batch(), _loss)
    assert "3 times" in str(caught[0].message)
    assert "mask" not in str(caught[0].message)
    assert "cache" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForwardStateWarning)
        acc.step(_batch(), _loss)  # once only
    # Negative controls: one micro-batch per window is the full batch; eval mode changes nothing.
    one, two = _EmaCodebook().double(), _EmaCodebook().double().eval()
    whole = Accumulator(one, torch.optim.SGD(one.parameters(), lr=0.1), micro_batch_size=12)
    still = Accumulator(two, torch.optim.SGD(two.parameters(), lr=0.1), micro_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForwardStateWarning)
        whole.step(_batch(), _loss)
        still.step(_batch(), _loss)


def test_spectral_norm_power_iteration_is_warned_about() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 4)), torch.nn.Tanh()
    )
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4)
    with pytest.warns(ForwardStateWarning, match=r"0\.parametrizations\.weight\.0\._u"):
        acc.step(torch.randn(12, 4), lambda m, x: m(x).pow(2).mean())


def _assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():  # bitwise, NaN where NaN was
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, equal_nan=True, msg=key)


def _fail_a_window(model: torch.nn.Module, acc: Accumulator) -> None:
    """Run a window whose third micro-batch raises; every buffer must be as it was before it."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensor, calls = model.codebook, []

    def failing(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            # Negative control: the earlier micro-batches did move the codebook.
            assert not torch.equal(m.codebook, before["codebook"])
            raise RuntimeError("data error")
        return _loss(m, x)

    with pytest.raises(RuntimeError, match="data error") as raised:
        acc.step(_batch(), failing)
    assert "buffers its forwards updated are as they were" in "".join(raised.value.__notes__)
    _assert_unchanged(model, before)
    assert model.codebook is tensor  # the registered tensor itself, not a copy


@pytest.mark.parametrize("how", ["in_place", "data", "reassigned"])
def test_a_failing_window_puts_the_forward_updated_buffers_back(how: str) -> None:
    _fail_a_window(*_setup(how))  # before any window closed: every buffer was copied
    model, acc = _setup(how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ForwardStateWarning)
        acc.step(_batch(), _loss)  # a window closed: only the buffers that change are copied
    _fail_a_window(model, acc)
    model, acc = copy.deepcopy((model, acc))  # a copy keeps what the watch learned
    _fail_a_window(model, acc)


def test_skipped_and_dropped_windows_put_the_buffers_back() -> None:
    model, acc = _setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ForwardStateWarning)
        acc.step(_batch(), _loss)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def nonfinite(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _loss(m, x) * math.nan

    assert acc.step(_batch(), nonfinite).skipped
    _assert_unchanged(model, before)
    stream = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    for chunk in _batch().split(4):
        stream.micro_step(chunk, _loss)
    stream.flush("drop")
    _assert_unchanged(model, before)


def test_a_committed_window_keeps_what_the_forwards_did() -> None:
    # The buffers advance as in a plain loop over the same micro-batches; nothing is undone.
    model, acc = _setup()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ForwardStateWarning)
        acc.step(_batch(), _loss)
    with torch.no_grad():
        for chunk in _batch().split(4):
            reference(chunk)
    assert torch.equal(model.codebook, reference.codebook)
    assert int(model.calls) == 3


class _Lm(torch.nn.Module):
    def __init__(self, *, max_norm: float | None, tied: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6, max_norm=max_norm)
        self.head = torch.nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def test_a_tied_max_norm_embedding_is_warned_about() -> None:
    # Each micro-batch's forward renormalizes rows of the tied weight in place: the head of a
    # later micro-batch reads other weights than the full batch's (check_equivalence measures it).
    ids = torch.randint(0, 11, (12, 5), generator=torch.Generator().manual_seed(0))
    model = _Lm(max_norm=1.0, tied=True)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4)
    with pytest.warns(ForwardStateWarning, match=r"emb\.weight read by head\.weight") as caught:
        acc.step(ids, _lm_loss)
    assert "embedding_renorm_" in str(caught[0].message)  # the fix
    # Negative controls: untied or without max_norm it is exact, and nothing is said.
    for untroubled in (_Lm(max_norm=1.0, tied=False), _Lm(max_norm=None, tied=True)):
        opt = torch.optim.SGD(untroubled.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ForwardStateWarning)
            Accumulator(untroubled, opt, micro_batch_size=4).step(ids, _lm_loss)


def test_a_buffer_made_in_inference_mode_is_watched_without_a_version_counter() -> None:
    # Inference tensors have no version counter: reading it raised at every window.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    with torch.inference_mode():
        model.register_buffer("offset", torch.arange(3.0))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    batch = (torch.randn(5, 3), torch.randn(5, 1))

    def loss(m: torch.nn.Module, b) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0] + m.offset), b[1])

    for _ in range(2):  # the first window copies it, the next reads versions only
        assert acc.step(batch, loss).stepped
    original = model.offset

    def replacing(m: torch.nn.Module, b) -> torch.Tensor:  # reassigned, then the window fails
        m.offset = m.offset + 1
        raise RuntimeError("data error")

    with pytest.raises(RuntimeError, match="data error"):
        acc.step(batch, replacing)
    assert model.offset is original
    assert torch.equal(model.offset, torch.arange(3.0))


class _MomentumTarget(torch.nn.Module):
    """MoCo / BYOL: a frozen key encoder (parameters, not buffers) moved toward the query one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.query = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)
        )
        self.key = copy.deepcopy(self.query).requires_grad_(False)
        self.double()

    def momentum_update(self, how: str) -> None:
        with torch.no_grad():
            for key, query in zip(self.key.parameters(), self.query.parameters(), strict=True):
                if how == "in_place":
                    key.mul_(0.9).add_(query, alpha=0.1)
                elif how == "data":  # BYOL implementations: no version bump
                    key.data.mul_(0.9).add_(query.data, alpha=0.1)
                else:  # MoCo's reference code: a new tensor
                    key.data = key.data * 0.9 + query.data * 0.1


def _target_loss(how: str | None):
    def loss_fn(model: _MomentumTarget, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if how is not None:  # the training step's update, pasted into loss_fn
            model.momentum_update(how)
        return ((model.query(batch[0]) - model.key(batch[1])) ** 2).sum(1).mean()

    return loss_fn


@pytest.mark.parametrize("how", ["in_place", "data", "reassigned"])
@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_a_target_networks_update_inside_loss_fn_warns_and_once_per_window_is_exact(
    how: str, drive: str
) -> None:
    """A momentum update of frozen parameters written in `loss_fn` ran once per micro-batch
    (3 per step) silently, 1e-2 away from the full-batch run; it warns once, naming them. The
    update once per window, when `result.stepped`, equals the full-batch run and does not warn."""
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randn(12, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    reference = _MomentumTarget()
    plain = torch.optim.SGD(reference.query.parameters(), lr=0.1)
    for _ in range(3):
        reference.momentum_update(how)
        plain.zero_grad()
        _target_loss(None)(reference, (x, y)).backward()
        plain.step()

    def run(inside: bool) -> tuple[_MomentumTarget, list[str]]:
        model = _MomentumTarget()
        optimizer = torch.optim.SGD(model.query.parameters(), lr=0.1)
        step = {"micro_batch_size": 4} if drive == "step" else {"accumulation_steps": 3}
        acc = Accumulator(model, optimizer, **step)
        loss_fn = _target_loss(how if inside else None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                if not inside:
                    model.momentum_update(how)  # once per window, before its micro-batches
                if drive == "step":
                    assert acc.step((x, y), loss_fn).stepped
                else:
                    parts = zip(x.split(4), y.split(4), strict=True)
                    assert [acc.micro_step(mb, loss_fn) for mb in parts][-1].stepped
        return model, [str(w.message) for w in caught if w.category is ForwardStateWarning]

    def gap(model: _MomentumTarget) -> float:
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)

    model, messages = run(inside=True)
    assert len(messages) == 1
    assert "do not require grad (key.0.weight, key.0.bias, key.2.weight" in messages[0]
    assert "once per micro-batch" in messages[0]
    assert gap(model) > 1e-3  # the negative control: silently other steps
    model, messages = run(inside=False)
    assert messages == []
    assert gap(model) < 1e-10


def test_frozen_parameters_changed_two_ways_in_one_window_are_all_named() -> None:
    """One frozen tensor reassigned (`p.data = ...`: a new address), another changed through
    `.data` (no version bump, same address): both are named. The address check alone found the
    first, and the samples were then not compared, so the second went unnamed; a reassigned
    tensor that happens to reuse its old address was missed the same way (a flaky count)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)).double()
    model[0].requires_grad_(False)
    kept: list[torch.Tensor] = []  # the old tensors stay alive: the new address is another

    def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            kept.append(m[0].weight.data)
            m[0].weight.data = m[0].weight.data * 0.9  # reassigned
            m[0].bias.data.mul_(0.9)  # through .data: version and address unchanged
        return m(batch).pow(2).mean()

    acc = Accumulator(model, torch.optim.SGD(model[1].parameters(), lr=0.1), micro_batch_size=2)
    with pytest.warns(ForwardStateWarning) as caught:
        acc.step(torch.randn(6, 3, dtype=torch.float64), loss_fn)
    (message,) = [str(w.message) for w in caught if w.category is ForwardStateWarning]
    assert "2 parameters that do not require grad (0.weight, 0.bias)" in message, message


class _QatNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torch.ao import quantization

        self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
        self.hidden, self.out = torch.nn.Linear(4, 6), torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.out(torch.relu(self.hidden(self.quant(x)))))


def _qat_model() -> torch.nn.Module:
    """prepare_qat's default: per-channel weight observers, whose ranges start empty (shape 0)
    and take the channel count at the first forward, resized in place."""
    from torch.ao import quantization

    torch.manual_seed(0)
    model = _QatNet()
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    return quantization.prepare_qat(model.train())


def _qat_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _qat_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_a_failing_first_window_of_a_qat_model_puts_its_observers_back(tmp_path) -> None:
    """The observers' per-channel ranges are resized in place by the first forward.

    Before, putting them back (a failed first window, a planning probe) raised "The size of
    tensor a (6) must match the size of tensor b (0)" in place of the user's error, and left
    them resized; a checkpoint of a trained QAT model was refused by a fresh one ("holds
    hidden.weight_fake_quant.scale of shape (6,), the model has (1,)"), which torch loads.
    """
    from gradaccum import load_checkpoint, plan_micro_batch, save_checkpoint
    from tests.state import assert_bitwise, clone_state

    model = _qat_model()
    before = clone_state(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan_micro_batch(model, _qat_batch(0), _qat_loss, optimizer, memory_budget="1GiB")
    assert_bitwise(clone_state(model.state_dict()), before)
    acc = Accumulator(model, optimizer, micro_batch_size=2)
    calls = []

    def failing(model: torch.nn.Module, batch) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the user's own error")
        return _qat_loss(model, batch)

    with pytest.raises(RuntimeError, match="the user's own error"):
        acc.step(_qat_batch(0), failing)
    assert_bitwise(clone_state(model.state_dict()), before)
    # Trained, saved mid-window, loaded into a fresh model: as the uninterrupted run.
    acc = Accumulator(model, optimizer, accumulation_steps=2)
    for seed in range(2):
        acc.micro_step(_qat_batch(seed), _qat_loss)
    start = clone_state(model.state_dict())  # the open window's start
    acc.micro_step(_qat_batch(2), _qat_loss)
    save_checkpoint(tmp_path / "qat.pt", model=model, optimizer=optimizer, accumulator=acc)

    def fresh() -> tuple[torch.nn.Module, Accumulator]:
        model = _qat_model()  # its per-channel ranges empty again
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = Accumulator(model, optimizer, accumulation_steps=2)
        load_checkpoint(tmp_path / "qat.pt", model=model, optimizer=optimizer, accumulator=acc)
        return model, acc

    resumed_model, resumed = fresh()
    acc.micro_step(_qat_batch(3), _qat_loss)
    resumed.micro_step(_qat_batch(3), _qat_loss)
    assert_bitwise(clone_state(resumed_model.state_dict()), clone_state(model.state_dict()))
    failed_model, failed = fresh()
    calls.clear()
    calls.extend([1, 1])  # the next call raises
    with pytest.raises(RuntimeError, match="the user's own error"):
        failed.micro_step(_qat_batch(3), failing)
    assert_bitwise(clone_state(failed_model.state_dict()), start)
    # NEGATIVE CONTROL: the window's forwards did move the observers.
    with pytest.raises(AssertionError):
        assert_bitwise(clone_state(model.state_dict()), start)


class _Ratings(torch.nn.Module):
    """Mean-pooled item embeddings to a rating; `inv`: each lookup's gradient scale, given."""

    def __init__(self, by_freq: bool, bag: bool = False) -> None:
        super().__init__()
        kind = torch.nn.EmbeddingBag if bag else torch.nn.Embedding
        self.emb = kind(6, 4, scale_grad_by_freq=by_freq)
        self.bag = bag
        self.out = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor, inv: torch.Tensor | None = None) -> torch.Tensor:
        if self.bag:
            return self.out(self.emb(ids)).squeeze(-1)
        e = self.emb(ids)
        if inv is not None:  # the recipe: the full batch's 1 / count, on the gradient only
            e = e.detach() + (e - e.detach()) * inv[..., None]
        return self.out(e.mean(1)).squeeze(-1)


def test_an_embedding_scaling_gradients_by_frequency_is_warned_with_an_exact_recipe() -> None:
    """`nn.Embedding(scale_grad_by_freq=True)` divides a row's gradient by its id's count in
    each micro-batch's backward, not the batch's: silently 1.6 off the full-batch update (a
    row seen in k micro-batches gets about k times its gradient). The first split window warns
    (EmbeddingBag too); the recipe in the warning (1 / the batch's counts on the gradient) is
    the full-batch step; a single micro-batch, or the default, says nothing."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (11, 5), generator=generator)
    y = torch.randn(11, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    start = _Ratings(by_freq=True).double()
    full = copy.deepcopy(start)
    torch.nn.functional.mse_loss(full(ids), y).backward()
    torch.optim.SGD(full.parameters(), lr=0.5).step()

    def plain(m: torch.nn.Module, b) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[-1])

    model = copy.deepcopy(start)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=4)
    with pytest.warns(UserWarning, match=r"emb \(Embedding\) scales each row") as caught:
        acc.step((ids, y), plain)
    assert "scale_grad_by_freq=False" in str(caught[0].message)
    pairs = zip(model.parameters(), full.parameters(), strict=True)
    gap = max(float((a - b).detach().abs().max()) for a, b in pairs)
    assert gap > 1e-3  # the control: the micro-batches' own counts
    recipe = _Ratings(by_freq=False).double()
    recipe.load_state_dict(start.state_dict())
    inv = 1.0 / torch.bincount(ids.flatten(), minlength=6)[ids].double()
    acc = Accumulator(recipe, torch.optim.SGD(recipe.parameters(), lr=0.5), micro_batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.step((ids, inv, y), lambda m, b: torch.nn.functional.mse_loss(m(b[0], b[1]), b[2]))
        whole = copy.deepcopy(start)  # one micro-batch: exact, and not warned
        opt = torch.optim.SGD(whole.parameters(), lr=0.5)
        Accumulator(whole, opt, micro_batch_size=11).step((ids, y), plain)
    for exact, one, reference in zip(
        recipe.parameters(), whole.parameters(), full.parameters(), strict=True
    ):
        torch.testing.assert_close(exact, reference, rtol=1e-10, atol=0)
        torch.testing.assert_close(one, reference, rtol=1e-10, atol=0)
    bag = _Ratings(by_freq=True, bag=True)
    acc = Accumulator(bag, torch.optim.SGD(bag.parameters(), lr=0.5), micro_batch_size=4)
    with pytest.warns(UserWarning, match=r"emb \(EmbeddingBag\) scales each row"):
        acc.step((ids, y.float()), plain)
    report = gradaccum.check_equivalence(start, (ids, y), plain, 4)
    assert not report.ok
    assert [m.name for m in report.non_additive] == ["emb"]
    assert "scale_grad_by_freq=False" in report.explain()
