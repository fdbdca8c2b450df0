"""RL and sequence-training loops accumulated: PPO, truncated BPTT, sequence-first RNNs.

Each exact case is compared with a plain full-batch PyTorch loop in float64 (rtol 1e-10), with a
negative control that must fail: the naive version of the same loop.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradaccum import Accumulator, LossSum, accumulate_grad, check_equivalence
from gradaccum._layout_watch import SequenceFirstWarning
from gradaccum.loss import Term

RTOL = 1e-10


def _gap(model: nn.Module, reference: nn.Module) -> float:
    with torch.no_grad():
        return max(
            float((p - q).abs().max() / q.abs().max())
            for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        )


# ---------------------------------------------------------------- PPO


class _ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.pi, self.v = nn.Linear(16, 3), nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(obs)
        return self.pi(h), self.v(h).squeeze(-1)


def _ppo_parts(model: nn.Module, b: dict, adv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits, value = model(b["obs"])
    dist = torch.distributions.Categorical(logits=logits)
    ratio = (dist.log_prob(b["act"]) - b["old_logp"]).exp()
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return pg, (value - b["ret"]) ** 2, dist.entropy()


def _normalized(adv: torch.Tensor) -> torch.Tensor:
    return (adv - adv.mean()) / (adv.std() + 1e-8)


def _ppo_terms(model: nn.Module, b: dict) -> object:
    """The exact recipe: advantages normalized over the minibatch before it is split."""
    pg, vl, ent = _ppo_parts(model, b, b["adv"])
    n = len(pg)
    return LossSum.terms(
        pg=(pg.sum(), n),
        v=Term(vl.sum(), count=n, weight=0.5),
        ent=Term(ent.sum(), count=n, weight=-0.01),
    )


def _ppo_normalized_per_micro_batch(model: nn.Module, b: dict) -> object:
    """The naive port: each micro-batch normalizes its own advantages."""
    pg, vl, ent = _ppo_parts(model, b, _normalized(b["adv_raw"]))
    n = len(pg)
    return LossSum.terms(
        pg=(pg.sum(), n),
        v=Term(vl.sum(), count=n, weight=0.5),
        ent=Term(ent.sum(), count=n, weight=-0.01),
    )


def _rollout(n: int) -> dict[str, torch.Tensor]:
    """`n` steps of observations, actions, old log-probabilities, raw advantages, returns."""
    return {
        "obs": torch.randn(n, 4, dtype=torch.float64),
        "act": torch.randint(0, 3, (n,)),
        "old_logp": torch.rand(n, dtype=torch.float64) * -1.5 - 0.5,
        "adv_raw": torch.randn(n, dtype=torch.float64) * 3 + 1,
        "ret": torch.randn(n, dtype=torch.float64),
    }


def _ppo(loss_fn, *, accumulate: bool) -> nn.Module:
    """3 epochs over one rollout of 23, minibatches of 12, clipped at 0.5 as PPO does."""
    torch.manual_seed(0)
    model = _ActorCritic().double()
    rollout = _rollout(23)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    acc = Accumulator(model, optimizer, micro_batch_size=4, max_grad_norm=0.5)
    for epoch in range(3):
        order = torch.randperm(23, generator=torch.Generator().manual_seed(epoch))
        for start in range(0, 23, 12):
            b = {k: v[order[start : start + 12]] for k, v in rollout.items()}
            b["adv"] = _normalized(b["adv_raw"])  # over the whole minibatch, before the split
            if accumulate:
                result = acc.step(b, loss_fn)
                assert result.stepped
                assert set(result.terms) == {"pg", "v", "ent"}
                continue
            optimizer.zero_grad()
            pg, vl, ent = _ppo_parts(model, b, b["adv"])
            (pg.mean() + 0.5 * vl.mean() - 0.01 * ent.mean()).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
    return model


def test_ppo_with_advantages_normalized_before_the_split_is_the_full_minibatch_update() -> None:
    reference = _ppo(None, accumulate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # normalized before the split: quiet
        assert _gap(_ppo(_ppo_terms, accumulate=True), reference) < RTOL
    # Negative control: the advantage mean and std of each micro-batch are another objective,
    # which the step warns of (the advantages have mean 0 over each micro-batch).
    with pytest.warns(UserWarning, match="Normalize over the whole batch before acc.step"):
        assert _gap(_ppo(_ppo_normalized_per_micro_batch, accumulate=True), reference) > 1e-3


# ---------------------------------------------------------------- truncated BPTT


class _CharRNN(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(7, 8), cell(8, 12, batch_first=True)
        self.head = nn.Linear(12, 7)

    def forward(self, x: torch.Tensor, state: object) -> tuple[torch.Tensor, object]:
        y, state = self.rnn(self.embed(x), state)
        return self.head(y), state


def _detached(state: object) -> object:
    return tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()  # type: ignore[union-attr]


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_tbptt_state_carried_across_micro_steps_and_windows_is_the_plain_loop(cell) -> None:
    """Chunks of 4 steps, 3 chunks a window, the state detached and carried across both."""
    torch.manual_seed(0)
    data = torch.randint(0, 7, (3, 41))
    keep = torch.rand(3, 40) > 0.2  # unscored positions: windows count different tokens
    chunks = [
        (data[:, t : t + 4], data[:, t + 1 : t + 5].masked_fill(~keep[:, t : t + 4], -100))
        for t in range(0, 40, 4)
    ]  # 10 chunks: 3 full windows and a partial one for flush()
    start = _CharRNN(cell).double()

    def run(naive: bool) -> nn.Module:
        model = copy.deepcopy(start)
        acc = Accumulator(
            model, torch.optim.Adam(model.parameters(), lr=1e-2), accumulation_steps=3
        )
        carried: dict[str, object] = {"state": None}

        def loss_fn(m: nn.Module, b: tuple) -> object:
            logits, state = m(b[0], carried["state"])
            carried["state"] = _detached(state)
            ce = F.cross_entropy(
                logits.flatten(0, 1), b[1].flatten(), ignore_index=-100, reduction="sum"
            )
            if naive:  # a per-chunk token mean, read by rows
                return ce / (b[1] != -100).sum()
            return LossSum(ce, (b[1] != -100).sum())

        for chunk in chunks:
            acc.micro_step(chunk, loss_fn)
        assert acc.flush().stepped
        return model

    reference = copy.deepcopy(start)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    state = None
    for w in range(0, len(chunks), 3):
        window = chunks[w : w + 3]
        tokens = sum(int((y != -100).sum()) for _, y in window)
        optimizer.zero_grad()
        for x, y in window:
            logits, state = reference(x, state)
            state = _detached(state)
            F.cross_entropy(
                logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"
            ).div(tokens).backward()
        optimizer.step()
    assert _gap(run(naive=False), reference) < RTOL
    with pytest.warns(UserWarning, match="-100"):  # TokenMeanWarning: the control's bug
        assert _gap(run(naive=True), reference) > 1e-6


def _streams(cell: type[nn.RNNBase]) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """8 streams in 3 chunks of 5 steps, a model, and the plain loop's SGD step per chunk."""
    torch.manual_seed(0)
    data = torch.randint(0, 7, (8, 16))
    chunks = [(data[:, t : t + 5], data[:, t + 1 : t + 6]) for t in range(0, 15, 5)]
    return _CharRNN(cell).double(), chunks


def _per_chunk_reference(start: nn.Module, chunks: list, naive_split: int = 0) -> nn.Module:
    """One step per chunk of all the streams; `naive_split`: micro-batches of that many rows,
    each run from the state the previous one left (what a state kept whole does)."""
    model = copy.deepcopy(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state = None
    for x, y in chunks:
        optimizer.zero_grad()
        for rows in torch.arange(len(x)).split(naive_split or len(x)):
            logits, state = model(x[rows], state)
            state = _detached(state)
            ce = F.cross_entropy(logits.flatten(0, 1), y[rows].flatten(), reduction="sum")
            (ce / y.numel()).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_state_carried_to_other_rows_of_a_split_chunk_is_refused_and_per_row_is_exact(
    cell,
) -> None:
    """Truncated BPTT over 8 streams with step(): a state kept whole (`self.h = h.detach()`,
    lazily created) ran micro-batch 2's rows from micro-batch 1's final state, silently (the
    control, 1e-2 off); now refused, changing nothing. The state kept per row, in the batch with
    the rows' indices, is the plain loop's step per chunk; a state kept per micro-batch across
    windows (the same rows) is not refused."""
    start, chunks = _streams(cell)
    reference = _per_chunk_reference(start, chunks)
    assert _gap(_per_chunk_reference(start, chunks, naive_split=4), reference) > 1e-3  # control

    model = copy.deepcopy(start)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=4)
    kept: dict[str, object] = {"state": None}

    def whole(m: nn.Module, b: tuple) -> torch.Tensor:
        logits, state = m(b[0], kept["state"])
        kept["state"] = _detached(state)
        return F.cross_entropy(logits.flatten(0, 1), b[1].flatten())

    with pytest.raises(ValueError, match=r"earlier micro-batch of this window.*one state per row"):
        acc.step(chunks[0], whole)
    assert _gap(model, start) == 0
    assert all(p.grad is None for p in model.parameters())

    for size in (3, 4):
        model = copy.deepcopy(start)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        acc = Accumulator(model, optimizer, micro_batch_size=size)
        shape = (1, 8, 12)
        h_all = [
            torch.zeros(shape, dtype=torch.float64) for _ in range(2 if cell is nn.LSTM else 1)
        ]

        def per_row(m: nn.Module, b: dict, h_all: list = h_all) -> torch.Tensor:
            h0 = tuple(h.transpose(0, 1).contiguous() for h in b["h"])
            logits, state = m(b["x"], h0 if cell is nn.LSTM else h0[0])
            for h, h_n in zip(h_all, state if cell is nn.LSTM else (state,), strict=True):
                h[:, b["idx"]] = h_n.detach()
            return F.cross_entropy(logits.flatten(0, 1), b["y"].flatten())

        for x, y in chunks:
            h = [h.transpose(0, 1).clone() for h in h_all]
            acc.step({"x": x, "y": y, "h": h, "idx": torch.arange(8)}, per_row)
        assert _gap(model, reference) < RTOL

    model = copy.deepcopy(start)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=4)
    by_position: dict[int, object] = {}

    def per_micro_batch(m: nn.Module, b: dict) -> torch.Tensor:
        first = int(b["idx"][0])
        logits, state = m(b["x"], by_position.get(first))
        by_position[first] = _detached(state)
        return F.cross_entropy(logits.flatten(0, 1), b["y"].flatten())

    for x, y in chunks:
        acc.step({"x": x, "y": y, "idx": torch.arange(8)}, per_micro_batch)
    assert _gap(model, reference) < RTOL  # the same rows in each window: exact, not refused
    assert len(by_position) == 2


def test_a_state_kept_for_the_whole_batch_fails_with_a_note_naming_the_per_row_state() -> None:
    """An RNN given a state of the batch's 8 rows in a micro-batch of 3: torch's shape error
    now carries the per-row recipe; the window changes nothing."""
    model = nn.GRU(3, 5, batch_first=True).double()
    before = copy.deepcopy(model.state_dict())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=3)
    state = torch.zeros(1, 8, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Expected hidden size") as caught:
        acc.step(torch.randn(8, 4, 3, dtype=torch.float64), lambda m, b: m(b, state)[0].mean())
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "initial state of 8 rows for an input of 3" in notes
    assert "Carry one state per row" in notes
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- sequence-first modules


class _SeqFirst(nn.Module):
    """nn.LSTM's default layout: (S, B, features)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class _BatchFirstOutside(_SeqFirst):
    """Takes (B, S, features) and transposes before its sequence-first LSTM: correct."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(0, 1)).transpose(0, 1)


def _seq_loss(model: nn.Module, b: tuple) -> torch.Tensor:
    return (
        F.cross_entropy(model(b[0]).flatten(0, 1), b[1].flatten(), reduction="sum") / b[1].numel()
    )


def _full_batch_step(start: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The reference: one SGD step on the token-mean cross-entropy of the whole batch."""
    reference = copy.deepcopy(start)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.cross_entropy(reference(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    return reference


def _step(model: nn.Module, batch: tuple, loss_fn, **kwargs) -> list[warnings.WarningMessage]:
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=3, **kwargs
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step(batch, loss_fn)
    return [w for w in caught if issubclass(w.category, SequenceFirstWarning)]


def test_a_sequence_first_lstm_split_along_time_is_warned_and_batch_dim_1_is_exact() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(10, 4, 3, dtype=torch.float64), torch.randint(0, 2, (10, 4))  # S=10, B=4
    start = _SeqFirst().double()
    reference = _full_batch_step(start, x, y)

    def token_sum(model: nn.Module, b: tuple) -> LossSum:  # rows are columns here: count tokens
        return LossSum(
            F.cross_entropy(model(b[0]).flatten(0, 1), b[1].flatten(), reduction="sum"),
            b[1].numel(),
        )

    cut = copy.deepcopy(start)
    warned = _step(cut, (x, y), token_sum)  # batch_dim=0: micro-batches of 3 time steps
    assert len(warned) == 1
    assert "'rnn'" in str(warned[0].message)
    assert "batch_dim=1" in str(warned[0].message)
    assert _gap(cut, reference) > 1e-3  # what the warning is about: not the full-batch step

    exact = copy.deepcopy(start)
    assert _step(exact, (x, y.t().contiguous().t()), token_sum, batch_dim=1) == []
    assert _gap(exact, reference) < RTOL

    with warnings.catch_warnings(record=True) as caught:  # accumulate_grad splits along dim 0 too
        warnings.simplefilter("always")
        accumulate_grad(copy.deepcopy(start), (x, y), token_sum, micro_batch_size=3)
    assert [w for w in caught if issubclass(w.category, SequenceFirstWarning)]


def test_a_batch_first_model_transposing_before_its_lstm_is_not_warned_and_is_exact() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(10, 5, 3, dtype=torch.float64), torch.randint(0, 2, (10, 5))  # B=10, S=5
    start = _BatchFirstOutside().double()
    reference = _full_batch_step(start, x, y)
    model = copy.deepcopy(start)
    assert _step(model, (x, y), _seq_loss) == []
    assert _gap(model, reference) < RTOL


class _OneSequenceAtATime(nn.Module):
    """Reads one `(T, features)` sequence of a per-item list through a sequence-first GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 8), nn.Linear(8, 1)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(sequence.unsqueeze(1))[1][-1])  # (T, 1, features)


def test_per_item_sequences_through_a_sequence_first_gru_are_not_warned_and_are_exact() -> None:
    """`{"seqs": [B sequences of varied lengths], "y": ...}`, each sequence fed as `(T, 1, F)`:
    one of T == 3 in a micro-batch of 3 items was taken for a batch split along time, and the
    warning advised batch_dim=1, which breaks this correct step. The time-split control warns."""
    torch.manual_seed(0)
    sequences = [torch.randn(n, 3, dtype=torch.float64) for n in (3, 5, 2, 3, 4, 3, 6)]
    batch = {"seqs": sequences, "y": torch.randn(7, 1, dtype=torch.float64)}

    def loss_fn(model: nn.Module, b: dict) -> torch.Tensor:
        return F.mse_loss(torch.cat([model(s) for s in b["seqs"]]), b["y"])

    start = _OneSequenceAtATime().double()
    reference = copy.deepcopy(start)
    loss_fn(reference, batch).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    model = copy.deepcopy(start)
    assert _step(model, batch, loss_fn) == []
    assert _gap(model, reference) < RTOL
    x, y = torch.randn(10, 4, 3, dtype=torch.float64), torch.randint(0, 2, (10, 4))
    assert len(_step(_SeqFirst().double(), (x, y), _seq_loss)) == 1  # split along time


def test_check_equivalence_names_advantage_normalization_and_its_exact_recipe() -> None:
    torch.manual_seed(0)
    model = _ActorCritic().double()
    b = _rollout(12)
    b["adv"] = _normalized(b["adv_raw"])

    def per_micro_batch(m: nn.Module, mb: dict) -> torch.Tensor:
        pg, vl, _ = _ppo_parts(m, mb, _normalized(mb["adv_raw"]))
        return (pg + 0.5 * vl).mean()

    def up_front(m: nn.Module, mb: dict) -> torch.Tensor:
        pg, vl, _ = _ppo_parts(m, mb, mb["adv"])
        return (pg + 0.5 * vl).mean()

    with pytest.warns(UserWarning, match="mean 0 over this micro-batch's 5 rows"):
        report = check_equivalence(model, b, per_micro_batch, 5)
    assert not report.ok
    assert "advantage normalization" in report.explain()
    assert "before splitting" in report.explain()
    assert check_equivalence(model, b, up_front, 5).ok


# ---------------------------------------------------------------- REINFORCE, VAE


class _PackedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 8, batch_first=True)
        self.pi, self.v = nn.Linear(8, 4), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        y, _ = nn.utils.rnn.pad_packed_sequence(
            self.rnn(packed)[0], batch_first=True, total_length=x.shape[1]
        )
        return self.pi(y), self.v(y).squeeze(-1)


def _a2c_per_step(model: nn.Module, b: dict) -> torch.Tensor:
    logits, value = model(b["x"], b["lengths"])
    logp = torch.distributions.Categorical(logits=logits).log_prob(b["act"])
    return (-(logp * (b["ret"] - value).detach()) + 0.5 * (value - b["ret"]) ** 2) * b["mask"]


@pytest.mark.parametrize("per", ["step", "episode"])
def test_reinforce_on_packed_episodes_of_different_lengths_is_the_full_batch_step(per: str) -> None:
    torch.manual_seed(0)
    lengths = torch.randint(1, 10, (13,))
    mask = (torch.arange(9)[None] < lengths[:, None]).double()
    rewards = torch.randn(13, 9, dtype=torch.float64) * mask
    batch = {
        "x": torch.randn(13, 9, 3, dtype=torch.float64),
        "lengths": lengths,
        "act": torch.randint(0, 4, (13, 9)),
        "ret": rewards.flip(1).cumsum(1).flip(1),  # returns-to-go per episode
        "mask": mask,
    }

    def loss_fn(model: nn.Module, b: dict) -> LossSum:
        loss = _a2c_per_step(model, b)
        if per == "step":
            return LossSum(loss.sum(), b["mask"].sum())
        return LossSum((loss.sum(1) / b["mask"].sum(1)).sum(), len(loss))

    def naive(model: nn.Module, b: dict) -> torch.Tensor:  # a per-micro-batch step mean
        return _a2c_per_step(model, b).sum() / b["mask"].sum()

    start = _PackedPolicy().double()
    reference = copy.deepcopy(start)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        loss = _a2c_per_step(reference, batch)
        (
            loss.sum() / mask.sum() if per == "step" else (loss.sum(1) / mask.sum(1)).mean()
        ).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
    for fn, exact in ((loss_fn, True), (naive, False)):
        model = copy.deepcopy(start)
        acc = Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            micro_batch_size=4,
            max_grad_norm=0.5,
        )
        for _ in range(2):
            acc.step(batch, fn)
        assert (_gap(model, reference) < RTOL) is exact


class _VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 6), nn.Linear(3, 6)

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_var = self.enc(x).chunk(2, -1)
        q = torch.distributions.Normal(mu, (0.5 * log_var).exp())
        z = q.loc + q.scale * eps  # rsample() with the batch's own noise
        kl = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0)).sum(-1)
        return self.dec(z), kl


def test_a_vae_with_the_noise_in_the_batch_is_exact_as_two_terms_of_different_counts() -> None:
    torch.manual_seed(0)
    x, eps = torch.randn(11, 6, dtype=torch.float64), torch.randn(11, 3, dtype=torch.float64)

    def loss_fn(model: nn.Module, b: dict) -> object:
        recon, kl = model(b["x"], b["eps"])
        return LossSum.terms(
            recon=(F.mse_loss(recon, b["x"], reduction="sum"), b["x"].numel()),  # per pixel
            kl=Term(kl.sum(), count=len(kl), weight=0.1),  # per item
        )

    start = _VAE().double()
    model, reference = copy.deepcopy(start), copy.deepcopy(start)
    acc = Accumulator(model, torch.optim.Adam(model.parameters(), lr=1e-2), micro_batch_size=4)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(3):
        acc.step({"x": x, "eps": eps}, loss_fn)
        optimizer.zero_grad()
        recon, kl = reference(x, eps)
        (F.mse_loss(recon, x) + 0.1 * kl.mean()).backward()
        optimizer.step()
    assert _gap(model, reference) < RTOL
    # Negative control: rsample() drawing its own noise per micro-batch is another step.
    drawn = copy.deepcopy(start)
    acc = Accumulator(drawn, torch.optim.Adam(drawn.parameters(), lr=1e-2), micro_batch_size=4)
    for _ in range(3):
        acc.step(
            {"x": x, "eps": eps},
            lambda m, b: loss_fn(m, {"x": b["x"], "eps": torch.randn_like(b["eps"])}),
        )
    assert _gap(drawn, reference) > 1e-3


# ---------------------------------------------------------------- CTC


def test_ctc_with_per_sample_target_lengths_is_exact_and_concatenated_targets_are_refused() -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 12, 4, dtype=torch.float64)
    input_lengths, target_lengths = torch.randint(6, 13, (9,)), torch.randint(1, 5, (9,))
    padded = torch.randint(1, 5, (9, 4))
    listed = [padded[i, : target_lengths[i]] for i in range(9)]
    start = nn.GRU(4, 5, batch_first=True).double()

    def log_probs(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs)[0].log_softmax(-1).transpose(0, 1)

    def ctc(model: nn.Module, b: tuple) -> LossSum:
        targets = torch.cat(b[1]) if isinstance(b[1], list) else b[1]  # a list: concatenated here
        value = F.ctc_loss(log_probs(model, b[0]), targets, b[2], b[3], reduction="sum")
        return LossSum(value, b[3].sum())  # a token mean: / the window's target tokens

    reference = copy.deepcopy(start)
    F.ctc_loss(log_probs(reference, x), padded, input_lengths, target_lengths, reduction="sum").div(
        target_lengths.sum()
    ).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for targets in (padded, listed):
        model = copy.deepcopy(start)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4)
        acc.step((x, targets, input_lengths, target_lengths), ctc)
        assert _gap(model, reference) < RTOL
    # Negative control: a per-micro-batch mean over its own target tokens, read by rows.
    naive = copy.deepcopy(start)
    acc = Accumulator(naive, torch.optim.SGD(naive.parameters(), lr=0.1), micro_batch_size=4)
    acc.step((x, padded, input_lengths, target_lengths), lambda m, b: ctc(m, b).value / b[3].sum())
    assert _gap(naive, reference) > 1e-6

    before = [p.detach().clone() for p in naive.parameters()]
    with pytest.raises(ValueError, match=r"pad it to \(B, max_len\).*list of B tensors"):
        acc.step((x, torch.cat(listed), input_lengths, target_lengths), ctc)
    assert all(torch.equal(p, q) for p, q in zip(naive.parameters(), before, strict=True))


def test_an_approximate_kl_rides_along_as_a_weight_0_term_for_early_stopping() -> None:
    """PPO's KL early stop reads the minibatch's mean KL from the stepped result; no gradient."""
    torch.manual_seed(0)
    start = nn.Linear(4, 3).double()
    obs, act = torch.randn(10, 4, dtype=torch.float64), torch.randint(0, 3, (10,))
    old_logp, adv = torch.rand(10, dtype=torch.float64) - 1.5, torch.randn(10, dtype=torch.float64)

    def surrogate(model: nn.Module, b: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.distributions.Categorical(logits=model(b[0])).log_prob(b[1])
        return -((logp - b[2]).exp() * b[3]), b[2] - logp

    def loss_fn(model: nn.Module, b: tuple) -> object:
        pg, kl = surrogate(model, b)
        return LossSum.terms(
            pg=(pg.sum(), len(pg)), kl=Term(kl.detach().sum(), count=len(kl), weight=0.0)
        )

    model, reference = copy.deepcopy(start), copy.deepcopy(start)
    result = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=3
    ).step((obs, act, old_logp, adv), loss_fn)
    pg, kl = surrogate(reference, (obs, act, old_logp, adv))
    pg.mean().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert _gap(model, reference) < RTOL
    assert result.terms["kl"] == pytest.approx(float(kl.detach().mean()), rel=1e-12)
    # The weight-0 term adds nothing to the objective.
    assert result.loss == pytest.approx(float(pg.detach().mean()), rel=1e-12)


def test_a_carried_state_not_detached_names_the_fix_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = nn.GRU(3, 4, batch_first=True).double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    before = [p.detach().clone() for p in model.parameters()]
    carried: dict[str, object] = {"state": None}

    def loss_fn(m: nn.Module, b: torch.Tensor) -> LossSum:
        y, state = m(b, carried["state"])
        carried["state"] = state  # the bug: the next micro-batch backpropagates into this graph
        return LossSum(y.pow(2).sum(), y.numel())

    acc.micro_step(torch.randn(2, 5, 3, dtype=torch.float64), loss_fn)
    with pytest.raises(RuntimeError, match="second time") as info:
        acc.micro_step(torch.randn(2, 5, 3, dtype=torch.float64), loss_fn)
    assert any("h.detach()" in note for note in getattr(info.value, "__notes__", []))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_a_compiled_model_is_not_hooked_for_the_layout_check() -> None:
    """Hooks added for the first micro-batches and removed after would recompile it twice."""
    from gradaccum._layout_watch import SequenceFirstCheck

    eager = _SeqFirst()
    with SequenceFirstCheck(eager, batch_dim=0).watch(3, 10):  # eager: hooked while it runs
        assert eager.rnn._forward_pre_hooks
    assert not eager.rnn._forward_pre_hooks
    compiled, inner = torch.compile(_SeqFirst()), _SeqFirst()
    inner.rnn.compile()  # a compiled submodule
    for model in (compiled, inner):
        check = SequenceFirstCheck(model, batch_dim=0)
        with check.watch(3, 10):  # a no-op context: no hook was added
            assert not any(m._forward_pre_hooks for m in model.modules())


class _RecurrentAgent(nn.Module):
    """CleanRL's recurrent PPO agent: time-major flattened rows, reshaped to (-1, envs), and a
    sequence-first LSTM stepped one time step at a time, its state reset where an episode ended."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.lstm, self.pi = nn.Linear(4, 8), nn.LSTM(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, state: tuple, done: torch.Tensor) -> torch.Tensor:
        envs = state[0].shape[1]
        hidden = self.net(x).reshape(-1, envs, 8)
        out = []
        for h, d in zip(hidden, done.reshape(-1, envs), strict=True):
            keep = (1.0 - d).view(1, -1, 1)
            y, state = self.lstm(h.unsqueeze(0), (keep * state[0], keep * state[1]))
            out.append(y)
        return self.pi(torch.cat(out).flatten(0, 1))


def test_recurrent_ppo_rows_flattened_time_major_are_warned_and_batch_dim_1_is_exact() -> None:
    """A minibatch of 4 envs x 8 steps flattened time-major (CleanRL's ppo_atari_lstm) split
    into micro-batches of 8 rows: each ran 2 steps of every env from the rollout's initial
    state, silently (control: 1e-3 off). Now a SequenceFirstWarning names the layout; kept as
    (T, N) tensors with batch_dim=1 the step is the full minibatch's, with no warning."""
    torch.manual_seed(0)
    steps, envs = 8, 4
    rollout = {
        "obs": torch.randn(steps, envs, 4, dtype=torch.float64),
        "dones": (torch.rand(steps, envs) < 0.2).double(),
        "act": torch.randint(0, 3, (steps, envs)),
        "adv": torch.randn(steps, envs, dtype=torch.float64),
    }
    initial = (
        torch.randn(1, envs, 16, dtype=torch.float64),
        torch.randn(1, envs, 16, dtype=torch.float64),
    )
    start = _RecurrentAgent().double()

    def pg(m: nn.Module, obs, state, dones, act, adv) -> torch.Tensor:
        logp = m(obs, state, dones).log_softmax(-1).gather(1, act[:, None]).squeeze(1)
        return -(logp * adv).mean()

    reference = copy.deepcopy(start)
    flat = {k: v.flatten(0, 1) for k, v in rollout.items()}  # time-major rows
    pg(reference, flat["obs"], initial, flat["dones"], flat["act"], flat["adv"]).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    naive = copy.deepcopy(start)
    acc = Accumulator(naive, torch.optim.SGD(naive.parameters(), lr=0.5), micro_batch_size=8)
    with pytest.warns(SequenceFirstWarning, match="2 time steps of 4 sequences.*batch_dim=1"):
        acc.step(flat, lambda m, b: pg(m, b["obs"], initial, b["dones"], b["act"], b["adv"]))
    assert _gap(naive, reference) > 1e-3  # the control: cut in time

    model = copy.deepcopy(start)
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=1, batch_dim=1
    )
    batch = {**rollout, "h0": initial[0], "c0": initial[1]}

    def per_env(m: nn.Module, b: dict) -> torch.Tensor:
        f = {k: b[k].flatten(0, 1) for k in ("obs", "dones", "act", "adv")}
        return pg(m, f["obs"], (b["h0"], b["c0"]), f["dones"], f["act"], f["adv"])

    with warnings.catch_warnings():
        warnings.simplefilter("error", SequenceFirstWarning)
        assert acc.step(batch, per_env).micro_batches == 4
    assert _gap(model, reference) < RTOL
