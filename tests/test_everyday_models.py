"""Everyday models that are not a plain feed-forward classifier, each against a full-batch step.

Tied weights, a shared siamese encoder, distillation from a frozen teacher (KL, batchmean, with
temperature), CTC summed over target tokens, a packed GRU, attention with a key padding mask,
early exit, `torch.func.functional_call` and a dict output: two SGD (momentum) steps of
`Accumulator.step` in float64 equal two plain full-batch steps within 1e-10 (docs/losses.md,
"Models that are not a plain classifier"). The negative control weights the token-level loss
per micro-batch, as the copied loops do. In-batch negatives (InfoNCE, CLIP, a batch-hard triplet)
step exactly with gradient caching; their control is the loss on each micro-batch alone.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from gradaccum import Accumulator, LossSum
from gradaccum.loss import Term, TokenMeanWarning
from tests.reference import param_tensors, relative_gap

_B = 11
_GEN = torch.Generator().manual_seed(7)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_GEN, dtype=torch.float64)


def _ints(high: int, *shape: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=_GEN)


class _TiedLm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix = nn.Embedding(13, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def _tied_lm() -> tuple[nn.Module, Any, Callable[..., Any]]:
    ids, labels = _ints(13, _B, 6), _ints(13, _B, 6)
    labels[0, 2:], labels[5, 1:] = -100, -100

    def loss(model: nn.Module, batch: Any) -> LossSum:
        logits = model(batch[0]).flatten(0, 1)
        ce = F.cross_entropy(logits, batch[1].flatten(), ignore_index=-100, reduction="sum")
        return LossSum(ce, (batch[1] != -100).sum())

    return _TiedLm(), (ids, labels), loss


def _encoder() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _siamese() -> tuple[nn.Module, Any, Callable[..., Any]]:
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        left, right, same = batch
        distance = F.pairwise_distance(model(left), model(right))
        return (same * distance**2 + (1 - same) * F.relu(1 - distance) ** 2).mean()

    return _encoder(), (_randn(_B, 4), _randn(_B, 4), _ints(2, _B).double()), loss


def _distillation() -> tuple[nn.Module, Any, Callable[..., Any]]:
    teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double().eval()
    teacher.requires_grad_(False)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        student = model(batch[0])
        with torch.no_grad():
            target = teacher(batch[0])
        soft = F.kl_div(
            F.log_softmax(student / 2.0, -1), F.softmax(target / 2.0, -1), reduction="batchmean"
        )
        return 0.5 * soft * 4.0 + 0.5 * F.cross_entropy(student, batch[1])

    return _encoder(), (_randn(_B, 4), _ints(3, _B)), loss


class _PackedGru(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        hidden, _ = pad_packed_sequence(self.rnn(packed)[0], True, total_length=x.shape[1])
        return self.out(hidden).log_softmax(-1)


def _ctc() -> tuple[nn.Module, Any, Callable[..., Any]]:
    lengths, target_lengths = _ints(10, _B, low=5), _ints(4, _B, low=1)

    def loss(model: nn.Module, batch: Any) -> LossSum:
        x, lengths, targets, target_lengths = batch
        log_probs = model(x, lengths).transpose(0, 1)
        ctc = F.ctc_loss(log_probs, targets, lengths, target_lengths, reduction="sum")
        return LossSum(ctc, target_lengths.sum())  # the token mean over the window

    return _PackedGru(), (_randn(_B, 9, 4), lengths, _ints(6, _B, 3, low=1), target_lengths), loss


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha, self.out = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.out(self.mha(x, x, x, key_padding_mask=padding)[0]).squeeze(-1)


def _attention() -> tuple[nn.Module, Any, Callable[..., Any]]:
    padding = torch.arange(7)[None] >= _ints(8, _B, low=2)[:, None]

    def loss(model: nn.Module, batch: Any) -> LossSum:
        x, padding, y = batch
        kept = ~padding
        return LossSum(((model(x, padding) - y) ** 2)[kept].sum(), kept.sum())

    return _Attention(), (_randn(_B, 7, 4), padding, _randn(_B, 7)), loss


class _EarlyExit(nn.Module):
    """Rows marked deep go through a second layer; a micro-batch without them never uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, deep: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.first(x))
        if bool(deep.any()):
            hidden = torch.where(deep[:, None], torch.tanh(self.second(hidden)), hidden)
        return {"logits": self.out(hidden), "hidden": hidden}


def _early_exit() -> tuple[nn.Module, Any, Callable[..., Any]]:
    deep = torch.zeros(_B, dtype=torch.bool)
    deep[8:] = True

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        params = dict(model.named_parameters())  # functional_call, as torch.func code does
        out = torch.func.functional_call(model, params, (batch[0], batch[1]))
        return F.cross_entropy(out["logits"], batch[2]) + 0.1 * out["hidden"].pow(2).mean()

    return _EarlyExit(), (_randn(_B, 4), deep, _ints(3, _B)), loss


_SETUPS = {
    "tied_lm_head": _tied_lm,
    "siamese": _siamese,
    "distillation_kl_batchmean": _distillation,
    "ctc_packed_gru": _ctc,
    "attention_key_padding_mask": _attention,
    "early_exit_functional_call_dict": _early_exit,
}


def _steps(model: nn.Module, batch: Any, loss: Callable[..., Any], micro: int | None) -> nn.Module:
    model = copy.deepcopy(model)
    # SGD, not AdamW: an attention key bias's exact gradient is zero, and AdamW would step on
    # its rounding noise (README, the charlm comparison).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    acc = Accumulator(model, optimizer, micro_batch_size=micro) if micro else None
    for _ in range(2):
        if acc is not None:
            acc.step(batch, loss)
            continue
        optimizer.zero_grad()
        out = loss(model, batch)
        (out.value / out.count if isinstance(out, LossSum) else out).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("name", sorted(_SETUPS))
def test_everyday_model_steps_equal_the_full_batch_steps(name: str, micro: int) -> None:
    torch.manual_seed(0)
    model, batch, loss = _SETUPS[name]()
    model = model.double()
    full = _steps(model, batch, loss, None)
    accumulated = _steps(model, batch, loss, micro)
    assert relative_gap(param_tensors(accumulated), param_tensors(full)) < 1e-10


def test_negative_control_a_per_micro_batch_token_mean_misses_the_tied_lm_step() -> None:
    torch.manual_seed(0)
    model, batch, loss = _tied_lm()
    model = model.double()

    def token_mean(m: nn.Module, b: Any) -> torch.Tensor:  # read as a mean per row
        out = loss(m, b)
        return out.value / out.count

    full = _steps(model, batch, loss, None)
    with pytest.warns(TokenMeanWarning):  # the library says so, too
        naive = _steps(model, batch, token_mean, 4)
    assert relative_gap(param_tensors(naive), param_tensors(full)) > 1e-4


def test_a_gan_with_gradient_penalty_and_two_accumulators_equals_the_plain_loop() -> None:
    # WGAN-GP: the critic's penalty differentiates through torch.autograd.grad(create_graph=True)
    # per item, so it is a sum over items; the generator's backward fills the critic's .grad
    # too, which the plain loop zeroes and the critic's next window sets aside.
    torch.manual_seed(0)
    gen_a = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    critic_a = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    gen_b, critic_b = copy.deepcopy(gen_a), copy.deepcopy(critic_a)

    def adam(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.9))

    opt_gen_a, opt_critic_a = adam(gen_a), adam(critic_a)
    acc_critic = Accumulator(critic_b, adam(critic_b), micro_batch_size=4)
    acc_gen = Accumulator(gen_b, adam(gen_b), micro_batch_size=4)
    batch = (_randn(_B, 3), _randn(_B, 2), torch.rand(_B, 1, generator=_GEN, dtype=torch.float64))

    def critic_loss(generator: nn.Module) -> Callable[[nn.Module, Any], torch.Tensor]:
        def loss(critic: nn.Module, b: Any) -> torch.Tensor:
            real, noise, mix = b
            with torch.no_grad():
                fake = generator(noise)
            between = (mix * real + (1 - mix) * fake).requires_grad_(True)
            (slope,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
            penalty = (slope.norm(dim=1) - 1) ** 2
            return (critic(fake) - critic(real)).squeeze(1).mean() + 10 * penalty.mean()

        return loss

    def gen_loss(critic: nn.Module) -> Callable[[nn.Module, Any], torch.Tensor]:
        return lambda generator, b: -critic(generator(b[1])).mean()

    for _ in range(3):
        opt_critic_a.zero_grad()
        critic_loss(gen_a)(critic_a, batch).backward()
        opt_critic_a.step()
        acc_critic.step(batch, critic_loss(gen_b))
        opt_gen_a.zero_grad()
        critic_a.zero_grad()
        gen_loss(critic_a)(gen_a, batch).backward()
        opt_gen_a.step()
        acc_gen.step(batch, gen_loss(critic_b))
    assert relative_gap(param_tensors(critic_b), param_tensors(critic_a)) < 1e-10
    assert relative_gap(param_tensors(gen_b), param_tensors(gen_a)) < 1e-10


# In-batch negatives with gradient caching (docs/losses.md, "In-batch negatives"): pass 1 embeds
# the whole batch without a graph and takes the loss's gradient per embedding; each micro-batch
# then backpropagates its embeddings' dot product with their cached gradient, a sum over items.
# Each loss takes the embeddings of every view and the items' labels.


def _info_nce(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    left, right = (F.normalize(e, dim=1) for e in embeddings)
    return F.cross_entropy(left @ right.T / 0.1, torch.arange(len(left)))


def _clip(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    return (_info_nce(embeddings, labels) + _info_nce(embeddings[::-1], labels)) / 2


def _batch_hard_triplet(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    distance = torch.cdist(embeddings[0], embeddings[0])
    same = labels[:, None] == labels[None]
    hardest_positive = (distance * same).amax(1)
    hardest_negative = (distance + 1e3 * same).amin(1)
    return F.relu(hardest_positive - hardest_negative + 0.5).mean()


_IN_BATCH = {"info_nce": (_info_nce, 2), "clip": (_clip, 2), "triplet": (_batch_hard_triplet, 1)}


def _cached_gradients(model: nn.Module, batch: dict[str, Any], loss_of: Any) -> dict[str, Any]:
    """Pass 1, once per batch: the batch for `acc.step`, with each embedding's gradient."""
    views = [batch[f"x{i}"] for i in range(len(batch) - 1)]
    with torch.no_grad():
        embeddings = [model(view).requires_grad_() for view in views]
    loss = loss_of(embeddings, batch["labels"])
    grads = torch.autograd.grad(loss, embeddings)
    share = torch.full((len(views[0]),), loss.item() / len(views[0]), dtype=torch.float64)
    return batch | {f"grad{i}": grad for i, grad in enumerate(grads)} | {"share": share}


def _cached_loss(model: nn.Module, micro_batch: dict[str, Any]) -> LossSum:
    """Pass 2, per micro-batch: the gradient is the full batch's; the value its loss's share."""
    views = sum(1 for key in micro_batch if key.startswith("grad"))
    dot = sum((model(micro_batch[f"x{i}"]) * micro_batch[f"grad{i}"]).sum() for i in range(views))
    assert isinstance(dot, torch.Tensor)
    return LossSum.terms(loss=Term(dot - dot.detach() + micro_batch["share"].sum(), denominator=1))


def _sgd_steps(
    model: nn.Module, batch: dict[str, Any], step: Callable[..., Any], micro: int | None
) -> nn.Module:
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    acc = (
        Accumulator(model, optimizer, micro_batch_size=micro, max_grad_norm=0.5) if micro else None
    )
    for _ in range(2):
        if acc is not None:
            step(acc, model)
            continue
        optimizer.zero_grad()
        step(None, model).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
    return model


@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("name", sorted(_IN_BATCH))
def test_in_batch_negatives_with_cached_gradients_equal_the_full_batch_steps(
    name: str, micro: int
) -> None:
    loss_of, views = _IN_BATCH[name]
    torch.manual_seed(0)
    model = _encoder().double()
    batch = {f"x{i}": _randn(_B, 4) for i in range(views)} | {"labels": _ints(3, _B)}

    def plain(m: nn.Module, b: dict[str, Any]) -> torch.Tensor:
        return loss_of([m(b[f"x{i}"]) for i in range(views)], b["labels"])

    losses: list[tuple[float, float]] = []

    def cached(acc: Accumulator | None, m: nn.Module) -> Any:
        if acc is None:
            return plain(m, batch)
        expected = plain(m, batch).item()
        losses.append((acc.step(_cached_gradients(m, batch, loss_of), _cached_loss).loss, expected))
        return None

    full = _sgd_steps(model, batch, cached, None)
    accumulated = _sgd_steps(model, batch, cached, micro)
    assert relative_gap(param_tensors(accumulated), param_tensors(full)) < 1e-10
    assert all(got == pytest.approx(want, rel=1e-12) for got, want in losses)  # result.loss

    # Control: the loss on each micro-batch alone sees fewer negatives: another step.
    with pytest.warns(UserWarning, match="compares the rows of its micro-batch"):
        naive = _sgd_steps(model, batch, lambda acc, m: acc.step(batch, plain), 4)
    assert relative_gap(param_tensors(naive), param_tensors(full)) > 1e-3


def test_the_gradient_caching_block_of_docs_losses_md_runs_and_is_exact() -> None:
    """The block users copy (docs/losses.md, "In-batch negatives") is the tested recipe."""
    import textwrap

    from tests.test_docs_examples import python_block

    torch.manual_seed(0)
    model = _encoder().double()
    batch = {"a": _randn(_B, 4), "b": _randn(_B, 4)}

    def info_nce(za: torch.Tensor, zb: torch.Tensor) -> torch.Tensor:
        return _info_nce([za, zb], torch.zeros(0))

    full = copy.deepcopy(model)
    optimizer = torch.optim.SGD(full.parameters(), lr=0.1, momentum=0.9)
    loss = info_nce(full(batch["a"]), full(batch["b"]))
    loss.backward()
    optimizer.step()
    acc = Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), micro_batch_size=4
    )
    scope = {"torch": torch, "info_nce": info_nce, "model": model, "batch": batch, "acc": acc}
    exec(textwrap.dedent(python_block("losses.md", "def with_cached_gradients(")), scope)
    assert scope["result"].loss == pytest.approx(loss.item(), rel=1e-12)
    assert relative_gap(param_tensors(model), param_tensors(full)) < 1e-10


def _simclr(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    z = F.normalize(torch.cat(embeddings), dim=1)
    n = len(embeddings[0])
    scores = (z @ z.T / 0.5).masked_fill(torch.eye(2 * n, dtype=torch.bool), -1e9)
    return F.cross_entropy(scores, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


def _barlow_twins(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    z1, z2 = ((e - e.mean(0)) / e.std(0) for e in embeddings)
    c = z1.T @ z2 / len(z1)
    return (torch.diagonal(c) - 1).pow(2).sum() + 0.005 * c.triu(1).pow(2).sum()


def _einsum_nce(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("id,jd->ij", *embeddings)
    return -scores.log_softmax(1).diagonal().mean()


def _broadcast_triplet(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    z = embeddings[0]
    distance = (z[:, None] - z[None]).pow(2).sum(-1)  # by hand, not torch.cdist
    same = labels[:, None] == labels[None]
    return F.relu((distance * same).amax(1) - (distance + 1e3 * same).amin(1) + 0.5).mean()


def _broadcast_cosine(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    z = torch.cat(embeddings)
    n = len(embeddings[0])
    scores = F.cosine_similarity(z.unsqueeze(1), z.unsqueeze(0), dim=2) / 0.5
    scores = scores.masked_fill(torch.eye(2 * n, dtype=torch.bool), -1e9)
    return F.cross_entropy(scores, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


def _mined_triplet(embeddings: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """Batch-hard triplets mined under no_grad, then gathered by index (no cdist in the graph)."""
    z = embeddings[0]
    with torch.no_grad():
        distance, same = torch.cdist(z, z), labels[:, None] == labels[None]
        positive, negative = (distance * same).argmax(1), (distance + 1e3 * same).argmin(1)
    return F.triplet_margin_loss(z, z[positive], z[negative], margin=0.5)


_MIXING = _IN_BATCH | {
    "mined_triplet": (_mined_triplet, 1),
    "simclr": (_simclr, 2), "barlow_twins": (_barlow_twins, 2), "einsum": (_einsum_nce, 2),
    "broadcast_triplet": (_broadcast_triplet, 1), "broadcast_cosine": (_broadcast_cosine, 2),
}  # fmt: skip


def _step_warnings(model: nn.Module, batch: Any, loss: Any, micro: int) -> tuple[nn.Module, list]:
    model = copy.deepcopy(model)
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=0.01), micro_batch_size=micro)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step(batch, loss)
    return model, [str(w.message) for w in caught]


@pytest.mark.parametrize("name", sorted(_MIXING))
def test_in_batch_losses_given_plainly_warn_naming_gradient_caching(name: str) -> None:
    """A loss comparing the micro-batch's rows (a rows x rows matrix, or a sum over rows of two
    activations) warns once at the split step, naming gradient caching; the step it took is not
    the full-batch one (the control: it used to be silent). One micro-batch is quiet."""
    loss_of, views = _MIXING[name]
    torch.manual_seed(0)
    model = _encoder().double()
    batch = {f"x{i}": _randn(12, 4) for i in range(views)} | {"labels": _ints(3, 12)}

    def plain(m: nn.Module, b: dict[str, Any]) -> torch.Tensor:
        return loss_of([m(b[f"x{i}"]) for i in range(views)], b["labels"])

    if name == "clip":  # as one term of LossSum.terms, beside a per-row term

        def plain(m: nn.Module, b: dict[str, Any]) -> LossSum:
            embeddings = [m(b[f"x{i}"]) for i in range(views)]
            rows = len(embeddings[0])
            return LossSum.terms(
                clip=Term(loss_of(embeddings, b["labels"]) * rows, count=rows),
                norm=Term(embeddings[0].pow(2).sum(), count=rows, weight=0.01),
            )

    full, quiet = _step_warnings(model, batch, plain, 12)
    assert quiet == []
    split, told = _step_warnings(model, batch, plain, 4)
    assert len(told) == 1, told
    for said in ("compares the rows of its micro-batch", "gradient caching", "In-batch negatives"):
        assert said in told[0]
    assert relative_gap(param_tensors(split), param_tensors(full)) > 1e-4


class _Heads(nn.Module):
    """An encoder with the heads whose matrix products must not read as in-batch negatives."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = _encoder()
        self.head = nn.Linear(3, 8, bias=False)  # 8 outputs: a multiple of 4 rows
        self.normed = nn.utils.parametrizations.weight_norm(nn.Linear(3, 8, bias=False))
        self.register_buffer("queue", torch.randn(16, 3, dtype=torch.float64))


def _moco(m: nn.Module, b: dict[str, Any]) -> torch.Tensor:
    q, k = F.normalize(m.enc(b["x0"]), dim=1), F.normalize(m.enc(b["x1"]), dim=1).detach()
    scores = torch.cat([(q * k).sum(1, keepdim=True), q @ F.normalize(m.queue, dim=1).T], 1)
    return F.cross_entropy(scores / 0.07, torch.zeros(len(q), dtype=torch.long))


_QUIET = {
    "bias_free_head": lambda m, b: F.cross_entropy(m.head(m.enc(b["x0"])), b["labels"]),
    "weight_norm_head": lambda m, b: F.cross_entropy(m.normed(m.enc(b["x0"])), b["labels"]),
    "moco_queue": _moco,
    "siamese_cosine": lambda m, b: (1 - F.cosine_similarity(m.enc(b["x0"]), m.enc(b["x1"]))).mean(),
    "cached_gradients": _cached_loss,
    "outer_product": lambda m, b: (m.enc(b["x0"])[:, :, None] * m.enc(b["x1"])[:, None]).mean(),
    "rows_sorted_then_unsorted": lambda m, b: F.cross_entropy(
        m.head(m.enc(b["x0"]))[b["labels"].argsort()][b["labels"].argsort().argsort()], b["labels"]
    ),
    "picked_log_probs": lambda m, b: (
        -(m.head(m.enc(b["x0"])).log_softmax(1)[torch.arange(len(b["labels"])), b["labels"]].mean())
    ),
}


@pytest.mark.parametrize("name", sorted(_QUIET))
def test_per_row_losses_with_matrix_products_do_not_warn_as_in_batch_negatives(name: str) -> None:
    torch.manual_seed(0)
    model = _Heads().double()
    batch = {"x0": _randn(12, 4), "x1": _randn(12, 4), "labels": _ints(8, 12)}
    if name == "cached_gradients":
        batch = _cached_gradients(model.enc, batch, _info_nce)
        model = model.enc
    assert _step_warnings(model, batch, _QUIET[name], 4)[1] == []


class _Clip(nn.Module):
    """Two towers and CLIP's learnable temperature, used by the loss, not by the towers."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
        self.text = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))


def _clip_loss(za: torch.Tensor, zb: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    logits = logit_scale.exp() * F.normalize(za, dim=1) @ F.normalize(zb, dim=1).T
    targets = torch.arange(len(za))
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def test_gradient_caching_with_a_learnable_temperature_is_exact() -> None:
    """docs/losses.md's temperature block: CLIP's two towers and `logit_scale` step as the full
    batch (AdamW, float64, 1e-10); control: the plain recipe leaves `logit_scale` unmoved."""
    import textwrap

    from tests.test_docs_examples import python_block

    torch.manual_seed(0)
    base = _Clip().double()
    batch = {"a": _randn(12, 6), "b": _randn(12, 4)}
    full = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(full.parameters(), lr=0.01)
    loss = _clip_loss(full.image(batch["a"]), full.text(batch["b"]), full.logit_scale)
    loss.backward()
    optimizer.step()

    model = copy.deepcopy(base)
    acc = Accumulator(model, torch.optim.AdamW(model.parameters(), lr=0.01), micro_batch_size=5)
    scope = {"torch": torch, "clip_loss": _clip_loss, "model": model, "batch": batch, "acc": acc}
    scope |= {"LossSum": LossSum, "Term": Term}
    exec(textwrap.dedent(python_block("losses.md", "def with_cached_gradients_and_")), scope)
    assert scope["result"].loss == pytest.approx(loss.item(), rel=1e-12)
    assert relative_gap(param_tensors(model), param_tensors(full)) < 1e-10

    plain = copy.deepcopy(base)  # control: the embeddings' gradients cached, not the temperature's
    acc = Accumulator(plain, torch.optim.AdamW(plain.parameters(), lr=0.01), micro_batch_size=5)
    with torch.no_grad():
        za, zb = plain.image(batch["a"]).requires_grad_(), plain.text(batch["b"]).requires_grad_()
    ga, gb = torch.autograd.grad(_clip_loss(za, zb, plain.logit_scale), (za, zb))

    def dotted(m: nn.Module, mb: dict[str, Any]) -> LossSum:
        dot = (m.image(mb["a"]) * mb["ga"]).sum() + (m.text(mb["b"]) * mb["gb"]).sum()
        return LossSum.terms(loss=Term(dot, denominator=1))

    acc.step(batch | {"ga": ga, "gb": gb}, dotted)
    assert plain.logit_scale.item() == base.logit_scale.item() != full.logit_scale.item()
    assert relative_gap(param_tensors(plain), param_tensors(full)) > 1e-4


def test_gradient_caching_replays_dropout_chunk_by_chunk() -> None:
    """docs/losses.md's replay block: an encoder with dropout, pass 1 in the step's chunks with
    their RNG states, each micro-batch replaying its chunk's: the step is the full-batch step
    over those chunks' embeddings (float64, 1e-10); control: pass 2 without the replay draws other
    masks. A finer split than pass 1's chunks is refused before anything changes."""
    import textwrap

    from tests.test_docs_examples import python_block

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 5)).double()
    batch, size = {"a": _randn(12, 4), "b": _randn(12, 4)}, 5

    def info_nce(za: torch.Tensor, zb: torch.Tensor) -> torch.Tensor:
        return _info_nce([za, zb], torch.zeros(0))

    torch.manual_seed(1)
    full = copy.deepcopy(base)
    optimizer = torch.optim.SGD(full.parameters(), lr=0.1)
    chunks = [(full(batch["a"][s : s + size]), full(batch["b"][s : s + size])) for s in (0, 5, 10)]
    loss = info_nce(torch.cat([a for a, _ in chunks]), torch.cat([b for _, b in chunks]))
    loss.backward()
    optimizer.step()

    def run(replay: bool, split: int = size) -> nn.Module:
        torch.manual_seed(1)
        model = copy.deepcopy(base)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=size)
        scope = {"torch": torch, "info_nce": info_nce, "model": model, "batch": batch, "acc": acc}
        scope |= {"LossSum": LossSum, "Term": Term}
        block = textwrap.dedent(python_block("losses.md", "def with_cached_gradients_replayed("))
        block = block.replace("result =", "acc.micro_batch_size = split\nresult =")
        if not replay:
            block = block.replace("torch.set_rng_state(states[start // size])", "pass")
        exec(block, scope | {"split": split})
        return model

    assert relative_gap(param_tensors(run(True)), param_tensors(full)) < 1e-10
    assert relative_gap(param_tensors(run(False)), param_tensors(full)) > 1e-3  # control
    with pytest.raises(ValueError, match="replay needs the same size"):
        run(True, split=3)
