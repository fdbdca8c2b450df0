"""Losses with several terms (`LossSum.terms`, gradaccum._terms): each term over its own count.

The objective is token-mean cross-entropy plus a weighted per-sequence auxiliary term, whose
counts (scored tokens, long-enough rows) differ between micro-batches. The reference is written
plainly: one forward on the whole batch, each term divided by its whole-batch count, one
backward. The negative control is what users write today: one LossSum, pre-weighting the
auxiliary term by the micro-batch's own ratio of counts.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum import Accumulator, LossSum
from gradaccum.loss import MAX_TERMS, Term
from tests.models import IGNORE_INDEX, NUM_CLASSES, make_model, token_batch
from tests.reference import param_tensors, relative_gap, split
from tests.state import assert_bitwise, clone_state

EXACT = 1e-10
AUX_WEIGHT = 0.3


def _batch(seed: int, items: int = 7) -> dict[str, torch.Tensor]:
    return token_batch(torch.Generator().manual_seed(seed), items)


def _parts(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each term's sum and count for `batch`: token CE, and a per-row auxiliary loss."""
    logits = model(batch["tokens"])
    labels = batch["labels"]
    ce = nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    long_rows = (labels != IGNORE_INDEX).sum(1) >= 3  # the auxiliary term counts these rows
    aux = logits[long_rows].pow(2).mean(dim=(1, 2)).sum()
    return {
        "ce": ce,
        "tokens": (labels != IGNORE_INDEX).sum(),
        "aux": aux,
        "rows": long_rows.sum(),
    }


def two_terms(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    p = _parts(model, batch)
    return LossSum.terms(
        ce=(p["ce"], p["tokens"]), aux=Term(p["aux"], count=p["rows"], weight=AUX_WEIGHT)
    )


def dict_terms(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """`two_terms` built as one dict, as a model's dict of losses is."""
    p = _parts(model, batch)
    named = {
        "ce": (p["ce"], p["tokens"]),
        "aux": Term(p["aux"], count=p["rows"], weight=AUX_WEIGHT),
    }
    return LossSum.terms(named)


class TwoTermsCountedAhead:
    """`two_terms` with its counts given ahead: one backward per micro-batch."""

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        return two_terms(model, batch)

    def items_counted(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scored = (batch["labels"] != IGNORE_INDEX).sum(1)
        return {"ce": scored.sum(), "aux": (scored >= 3).sum()}


def pre_weighted(model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    """The control: the auxiliary mean folded into the CE sum with this micro-batch's counts."""
    p = _parts(model, batch)
    aux_mean = p["aux"] / p["rows"].clamp(min=1)
    return LossSum(p["ce"] + AUX_WEIGHT * aux_mean * p["tokens"], p["tokens"])


def reference_objective(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    p = _parts(model, batch)
    return p["ce"] / p["tokens"] + AUX_WEIGHT * p["aux"] / p["rows"]


def _snapshot(model: nn.Module, acc: Accumulator) -> Any:
    return clone_state(
        {
            "model": model.state_dict(),
            "optimizer": acc.optimizer.state_dict(),
            "grads": [p.grad for p in model.parameters()],
        }
    )


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: a term scaled wrongly shows in the parameters (Adam would hide it).
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _reference(
    batches: list[dict[str, torch.Tensor]], max_norm: float | None = 1.0
) -> tuple[dict[str, Any], list[float]]:
    """Plain full-batch steps, one per batch, clipped at `max_norm` (None: not clipped)."""
    model = make_model("token")
    optimizer = _optimizer(model)
    objectives = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        objective = reference_objective(model, batch)
        objective.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm)
        optimizer.step()
        objectives.append(objective.item())
    return param_tensors(model), objectives


BATCHES = [_batch(seed) for seed in range(3)]


@pytest.mark.parametrize(
    "loss_fn", [two_terms, TwoTermsCountedAhead(), dict_terms], ids=["later", "ahead", "dict"]
)
@pytest.mark.parametrize("micro", [1, 3, 7])
def test_terms_step_equals_the_full_batch_objective(loss_fn: Any, micro: int) -> None:
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=micro, max_grad_norm=1.0)
    results = [acc.step(batch, loss_fn) for batch in BATCHES]
    expected_params, expected_objectives = _reference(BATCHES)
    assert relative_gap(param_tensors(model), expected_params) < EXACT
    for result, objective, batch in zip(results, expected_objectives, BATCHES, strict=True):
        assert result.loss == pytest.approx(objective, rel=1e-12)
        parts = _parts(make_model("token"), batch)  # the counts do not depend on the model
        assert set(result.terms) == {"ce", "aux"}
        assert result.count == batch["tokens"].shape[0]
        assert int(parts["rows"]) > 0


def test_reported_term_means_are_each_terms_window_mean() -> None:
    model = make_model("token")
    reference = copy.deepcopy(model)
    result = Accumulator(model, _optimizer(model), micro_batch_size=3).step(BATCHES[0], two_terms)
    with torch.no_grad():
        p = _parts(reference, BATCHES[0])
    assert result.terms["ce"] == pytest.approx(float(p["ce"] / p["tokens"]), rel=1e-12)
    assert result.terms["aux"] == pytest.approx(float(p["aux"] / p["rows"]), rel=1e-12)
    assert result.loss == pytest.approx(
        result.terms["ce"] + AUX_WEIGHT * result.terms["aux"], rel=1e-12
    )


def test_negative_control_pre_weighting_per_micro_batch_is_not_exact() -> None:
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=3, max_grad_norm=1.0)
    for batch in BATCHES:
        acc.step(batch, pre_weighted)
    assert relative_gap(param_tensors(model), _reference(BATCHES)[0]) > 1e-4


def test_counts_ahead_save_the_extra_backward_and_a_wrong_count_changes_nothing() -> None:
    """Given ahead, both terms share one backward; a count that disagrees is refused at the
    boundary, before anything steps."""
    passes = []

    class Counting(TwoTermsCountedAhead):
        def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
            loss = super().__call__(model, batch)
            passes.append(loss)
            return loss

    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=3)
    original = torch.autograd.grad
    calls = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    torch.autograd.grad = spy  # type: ignore[assignment]
    try:
        acc.step(BATCHES[0], Counting())
        assert calls == []  # no extra pass
        acc.step(BATCHES[0], two_terms)
        assert len(calls) == 3  # counts unknown: the aux term took one pass per micro-batch
    finally:
        torch.autograd.grad = original  # type: ignore[assignment]

    class Wrong(TwoTermsCountedAhead):
        def items_counted(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            counts = super().items_counted(batch)
            return {"ce": counts["ce"] + 1, "aux": counts["aux"]}

    before = _snapshot(model, acc)
    with pytest.raises(ValueError, match="items_counted said term 'ce'"):
        acc.step(BATCHES[1], Wrong())
    assert_bitwise(_snapshot(model, acc), before)


def test_a_constant_denominator_term_dr_grpo_style() -> None:
    """A constant denominator divides whatever the split; alone it needs no extra pass."""
    constant = 64.0

    def constant_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        p = _parts(model, batch)
        return LossSum.terms(ce=Term(p["ce"], denominator=constant))

    model = make_model("token")
    reference = copy.deepcopy(model)
    Accumulator(model, _optimizer(model), micro_batch_size=2).step(BATCHES[0], constant_loss)
    opt = _optimizer(reference)
    (_parts(reference, BATCHES[0])["ce"] / constant).backward()
    opt.step()
    assert relative_gap(param_tensors(model), param_tensors(reference)) < EXACT


def test_a_constant_term_next_to_a_counted_term() -> None:
    def mixed(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        p = _parts(model, batch)
        return LossSum.terms(
            ce=(p["ce"], p["tokens"]), aux=Term(p["aux"], denominator=10.0, weight=2.0)
        )

    model = make_model("token")
    reference = copy.deepcopy(model)
    Accumulator(model, _optimizer(model), micro_batch_size=3).step(BATCHES[1], mixed)
    opt = _optimizer(reference)
    p = _parts(reference, BATCHES[1])
    (p["ce"] / p["tokens"] + 2.0 * p["aux"] / 10.0).backward()
    opt.step()
    assert relative_gap(param_tensors(model), param_tensors(reference)) < EXACT


def _stream(acc: Accumulator, batches: list[dict[str, torch.Tensor]], loss_fn: Any) -> list[Any]:
    """The stepped results; each pending one is checked: its loss is this rank's objective so
    far, and it reports no term means yet."""
    results = []
    for batch in batches:
        for micro_batch in split(batch, 3):
            result = acc.micro_step(micro_batch, loss_fn)
            if result.stepped:
                results.append(result)
            else:
                assert result.loss > 0.0
                assert dict(result.terms) == {}
    return results


def test_streamed_terms_with_flush_equal_the_full_batch_objective() -> None:
    """micro_step over windows of 3 micro-batches; the second batch has only 2, so its window
    is closed by flush(): each window is one full-batch step of its batch."""
    batches = [_batch(10, 9), _batch(11, 5)]  # 3 micro-batches, then 2 (the last one ragged)
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), accumulation_steps=3, partial_window="step")
    results = _stream(acc, batches, two_terms)
    assert len(results) == 1
    flushed = acc.flush()
    assert flushed.stepped
    assert flushed.micro_batches == 2
    expected, objectives = _reference(batches, max_norm=None)
    assert relative_gap(param_tensors(model), expected) < EXACT
    assert [results[0].loss, flushed.loss] == pytest.approx(objectives, rel=1e-12)


def test_checkpoint_mid_window_with_terms_resumes_bitwise(tmp_path: Any) -> None:
    """Saved to a file after 2 of 3 micro-batches (the auxiliary term's own gradient buffer
    included) and loaded weights-only into fresh objects: the window ends bitwise alike."""
    batch = _batch(20, 9)
    micro_batches = split(batch, 3)
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), accumulation_steps=3)
    acc.micro_step(micro_batches[0], two_terms)
    acc.micro_step(micro_batches[1], two_terms)
    path = tmp_path / "mid-window.pt"
    gradaccum.save_checkpoint(path, model=model, optimizer=acc.optimizer, accumulator=acc)
    final = acc.micro_step(micro_batches[2], two_terms)
    assert final.stepped

    resumed_model = make_model("token", seed=1)  # other weights: the checkpoint must set them
    resumed = Accumulator(resumed_model, _optimizer(resumed_model), accumulation_steps=3)
    gradaccum.load_checkpoint(
        path, model=resumed_model, optimizer=resumed.optimizer, accumulator=resumed
    )
    again = resumed.micro_step(micro_batches[2], two_terms)
    assert again.stepped
    assert again.loss == final.loss
    assert dict(again.terms) == dict(final.terms)
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_terms_match_the_float32_step() -> None:
    """The fp16 loss scale multiplies every term's backward, the extra pass included, and is
    divided out once: the step is the fp32 one up to fp16 autocast rounding."""
    batch = _batch(30)
    results = {}
    for precision in ("fp32", "fp16"):
        model = make_model("token", dtype=torch.float32)
        acc = Accumulator(model, _optimizer(model), micro_batch_size=3, precision=precision)
        if acc.scaler is not None:
            acc.scaler.load_state_dict({**acc.scaler.state_dict(), "scale": 2.0**8})
        assert acc.step(batch, two_terms).stepped
        results[precision] = param_tensors(model)
    assert relative_gap(results["fp16"], results["fp32"]) < 1e-2


def test_term_errors_name_the_fix_and_change_nothing() -> None:
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=3)
    before = _snapshot(model, acc)
    value = torch.tensor(1.0, requires_grad=True)

    def renamed(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        p = _parts(model, batch)
        name = "ce" if batch["tokens"].shape[0] == 3 and renamed.calls == 0 else "other"
        renamed.calls += 1
        return LossSum.terms(**{name: (p["ce"], p["tokens"])})

    renamed.calls = 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="return the same terms"):
        acc.step(BATCHES[0], renamed)
    with pytest.raises(ValueError, match="exactly one of count= "):
        acc.step(BATCHES[0], lambda m, b: LossSum.terms(x=Term(value)))
    with pytest.raises(ValueError, match="must be > 0"):
        acc.step(BATCHES[0], lambda m, b: LossSum.terms(x=Term(value, denominator=0.0)))
    with pytest.raises(TypeError, match="give \\(value_sum, count\\)"):
        LossSum.terms(x=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most"):
        LossSum.terms(**{f"t{i}": (value, 1) for i in range(MAX_TERMS + 1)})
    with pytest.raises(ValueError, match="at least one term"):
        LossSum.terms()
    assert_bitwise(_snapshot(model, acc), before)
    with pytest.raises(ValueError, match=r"use Accumulator\.step"):
        gradaccum.accumulate_grad(model, BATCHES[0], two_terms, micro_batch_size=3)
    with pytest.raises(ValueError, match="one denominator"):
        gradaccum.check_equivalence(model, BATCHES[0], two_terms, micro_batch_size=3)


def test_a_damaged_terms_ledger_is_refused_before_anything_loads() -> None:
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), accumulation_steps=3)
    acc.micro_step(split(_batch(21, 6), 3)[0], two_terms)
    state = acc.state_dict()
    del state["engine"]["window"]["terms"]["counts"]
    fresh_model = make_model("token")
    fresh = Accumulator(fresh_model, _optimizer(fresh_model), accumulation_steps=3)
    before = _snapshot(fresh_model, fresh)
    with pytest.raises(ValueError, match=r"damaged LossSum\.terms ledger"):
        fresh.load_state_dict(state)
    assert_bitwise(_snapshot(fresh_model, fresh), before)
    assert fresh.state_dict()["engine"]["window"]["micro_batches"] == 0


# ---------------------------------------------------------------- weighted means

CLASS_WEIGHTS = torch.linspace(0.3, 2.1, NUM_CLASSES, dtype=torch.float64)


def _weighted_ce_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(
        model(batch["tokens"]).flatten(0, 1),
        batch["labels"].flatten(),
        weight=CLASS_WEIGHTS,
        ignore_index=IGNORE_INDEX,
        label_smoothing=0.1,
        reduction="sum",
    )


def _summed_weights(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = batch["labels"]
    return CLASS_WEIGHTS[labels[labels != IGNORE_INDEX]].sum()


def weighted_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """`CrossEntropyLoss(weight=...)`'s mean divides by the targets' summed weights: a term
    whose count is that sum (a real number, not a number of items)."""
    return LossSum.terms(ce=(_weighted_ce_sum(model, batch), _summed_weights(batch)))


def _weighted_reference(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain loop: nn.CrossEntropyLoss(weight=..., ignore_index=...) on the whole batch."""
    model = make_model("token")
    optimizer = _optimizer(model)
    criterion = nn.CrossEntropyLoss(
        weight=CLASS_WEIGHTS, ignore_index=IGNORE_INDEX, label_smoothing=0.1
    )
    criterion(model(batch["tokens"]).flatten(0, 1), batch["labels"].flatten()).backward()
    optimizer.step()
    return param_tensors(model)


@pytest.mark.parametrize("micro", [1, 3, 7])
def test_class_weighted_cross_entropy_is_exact_as_a_term_counting_summed_weights(
    micro: int,
) -> None:
    """Was refused: a term's count had to be a whole number, so a class-weighted mean had no
    exact recipe. Splits of 1 item include micro-batches whose weights sum to 0."""
    batch = _batch(40, 7)
    batch["labels"][2] = IGNORE_INDEX  # a row with no target: its micro-batch counts 0.0
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=micro)
    result = acc.step(batch, weighted_ce)
    assert result.stepped
    assert relative_gap(param_tensors(model), _weighted_reference(batch)) < EXACT
    expected = float(_weighted_ce_sum(make_model("token"), batch) / _summed_weights(batch))
    assert result.loss == pytest.approx(expected, rel=1e-12)


def test_class_weighted_terms_stream_and_resume_mid_window_exactly() -> None:
    """micro_step + flush, with a state saved after 2 micro-batches loaded into a fresh
    Accumulator: the summed weights so far are kept as they are (not truncated to items)."""
    batch = _batch(41, 9)
    micro_batches = split(batch, 2)
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), accumulation_steps=8)
    for micro_batch in micro_batches[:2]:
        acc.micro_step(micro_batch, weighted_ce)
    state = acc.state_dict()
    resumed = Accumulator(model, _optimizer(model), accumulation_steps=8)
    resumed.optimizer.load_state_dict(acc.optimizer.state_dict())
    resumed.load_state_dict(state)
    for micro_batch in micro_batches[2:]:
        assert not resumed.micro_step(micro_batch, weighted_ce).stepped
    assert resumed.flush().stepped
    assert relative_gap(param_tensors(model), _weighted_reference(batch)) < EXACT


@pytest.mark.filterwarnings("ignore::gradaccum._token_mean.TokenMeanWarning")  # the naive way warns
def test_negative_control_class_weighted_mean_returned_plainly_is_not_exact() -> None:
    """The plain scalar (read as a mean over rows) and a LossSum counting targets both miss."""

    def plain(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return _weighted_ce_sum(model, batch) / _summed_weights(batch).clamp(min=1e-12)

    def by_targets(model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
        return LossSum(_weighted_ce_sum(model, batch), (batch["labels"] != IGNORE_INDEX).sum())

    batch = _batch(40, 7)
    for loss_fn in (plain, by_targets):
        model = make_model("token")
        Accumulator(model, _optimizer(model), micro_batch_size=3).step(batch, loss_fn)
        assert relative_gap(param_tensors(model), _weighted_reference(batch)) > 1e-4


def test_a_fractional_loss_sum_count_names_the_weighted_term_recipe_and_changes_nothing() -> None:
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=3)
    before = _snapshot(model, acc)

    def summed_weights_as_count(model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
        return LossSum(_weighted_ce_sum(model, batch), _summed_weights(batch))

    with pytest.raises(ValueError, match=r"whole number.*LossSum\.terms\(loss="):
        acc.step(_batch(40, 7), summed_weights_as_count)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="count"):
            acc.step(
                _batch(40, 7), lambda m, b, bad=bad: LossSum.terms(x=(m(b["tokens"]).sum(), bad))
            )
    assert_bitwise(_snapshot(model, acc), before)


# ---------------------------------------------------------------- a term some micro-batches lack


def _aux_only_where_long(model: nn.Module, batch: dict[str, torch.Tensor], *, omit: bool) -> Any:
    """`two_terms`, but a micro-batch without a long row has no auxiliary item: it leaves the
    term out (`omit`), or returns it counting 0 with a constant value (the recipe)."""
    p = _parts(model, batch)
    terms: dict[str, Any] = {"ce": (p["ce"], p["tokens"])}
    if int(p["rows"]) > 0:
        terms["aux"] = Term(p["aux"], count=p["rows"], weight=AUX_WEIGHT)
    elif not omit:
        terms["aux"] = Term(torch.zeros((), dtype=torch.float64), count=0, weight=AUX_WEIGHT)
    return LossSum.terms(**terms)


def test_a_term_absent_from_some_micro_batches_is_refused_naming_the_zero_count_recipe() -> None:
    batch = _batch(50, 7)
    long_rows = (batch["labels"] != IGNORE_INDEX).sum(1) >= 3
    assert bool(long_rows[0])  # the first micro-batch has the term,
    assert not bool(long_rows.all())  # some later ones lack it
    model = make_model("token")
    acc = Accumulator(model, _optimizer(model), micro_batch_size=1, max_grad_norm=1.0)
    before = _snapshot(model, acc)
    with pytest.raises(ValueError, match=r"counting 0.*Term\(torch\.zeros\(\(\)\), count=0\)"):
        acc.step(batch, lambda m, b: _aux_only_where_long(m, b, omit=True))
    assert_bitwise(_snapshot(model, acc), before)
    assert acc.step(batch, lambda m, b: _aux_only_where_long(m, b, omit=False)).stepped
    expected, _ = _reference([batch])
    assert relative_gap(param_tensors(model), expected) < EXACT


def test_a_learnable_term_weight_is_refused_and_multiplying_the_value_is_exact() -> None:
    """`Term(weight=torch.exp(-s))` with `s` a parameter (uncertainty weighting) was read with
    float(): its graph dropped, `s` silently never moved. It is refused naming the fix, changing
    nothing; the fix, the weight on the value, steps `s` as the full-batch objective does."""
    batch = _batch(60, 7)
    log_var = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def weighted_terms(model: nn.Module, batch: dict[str, torch.Tensor], *, on_value: bool) -> Any:
        p = _parts(model, batch)
        if on_value:
            aux = Term(p["aux"] * torch.exp(-log_var), count=p["rows"])
        else:
            aux = Term(p["aux"], count=p["rows"], weight=torch.exp(-log_var))  # type: ignore[arg-type]
        return LossSum.terms(ce=(p["ce"], p["tokens"]), aux=aux)

    model = make_model("token")
    optimizer = torch.optim.SGD([*model.parameters(), log_var], lr=0.5)
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    before = _snapshot(model, acc)
    with pytest.raises(ValueError, match=r"requires grad.*Term\(value \* weight"):
        acc.step(batch, lambda m, b: weighted_terms(m, b, on_value=False))
    assert_bitwise(_snapshot(model, acc), before)
    assert log_var.grad is None
    assert acc.step(batch, lambda m, b: weighted_terms(m, b, on_value=True)).stepped

    reference = make_model("token")
    reference_log_var = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
    p = _parts(reference, batch)
    objective = p["ce"] / p["tokens"] + torch.exp(-reference_log_var) * p["aux"] / p["rows"]
    objective.backward()
    torch.optim.SGD([*reference.parameters(), reference_log_var], lr=0.5).step()
    assert relative_gap(param_tensors(model), param_tensors(reference)) < EXACT
    assert log_var.item() != 0.5
    assert log_var.item() == pytest.approx(reference_log_var.item(), rel=1e-12)


class _SwitchMoE(nn.Module):
    """Top-1 routing over 4 experts; the load-balancing loss is E * sum_i f_i * P_i (Switch)."""

    experts_count = 4

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.router = nn.Linear(8, self.experts_count)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(self.experts_count))
        self.head = nn.Linear(8, 13)

    def route(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.emb(ids).flatten(0, 1)
        return hidden, self.router(hidden).softmax(-1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, probs = self.route(ids)
        top = probs.argmax(-1)
        mixed = torch.stack([e(hidden) for e in self.experts], 1)[torch.arange(len(hidden)), top]
        return self.head(torch.tanh(mixed * probs.gather(1, top[:, None]))), probs


def _balance(probs: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    return _SwitchMoE.experts_count * (fractions * probs.mean(0)).sum()


def _fractions(probs: torch.Tensor) -> torch.Tensor:
    return nn.functional.one_hot(probs.argmax(-1), _SwitchMoE.experts_count).double().mean(0)


def test_moe_load_balancing_loss_is_exact_with_the_batchs_dispatch_fractions() -> None:
    # The Switch/Mixtral loss multiplies two batch means, f (tokens routed to each expert) and
    # P (mean router probability): a forward's own f and P are another loss than the batch's.
    # f has no gradient and the router does not move inside a window, so docs/losses.md
    # computes it over the whole batch first (no_grad); then E * sum_t p_t . f is a sum over
    # tokens, a term counting them.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 13, (16, 6), generator=generator)
    labels = torch.randint(0, 13, (16, 6), generator=generator)
    torch.manual_seed(1)
    full = _SwitchMoE().double()
    naive, fixed, start = copy.deepcopy(full), copy.deepcopy(full), copy.deepcopy(full)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (full, naive, fixed)]

    def per_forward(model: nn.Module, batch: Any) -> torch.Tensor:  # each forward's own f, P
        logits, probs = model(batch[0])
        ce = nn.functional.cross_entropy(logits, batch[1].flatten())
        return ce + 0.01 * _balance(probs, _fractions(probs))

    per_forward(full, (ids, labels)).backward()
    optimizers[0].step()
    Accumulator(naive, optimizers[1], micro_batch_size=4).step((ids, labels), per_forward)
    counts = torch.zeros(_SwitchMoE.experts_count, dtype=torch.float64)
    with torch.no_grad():  # the recipe: the batch's dispatch fractions, micro-batch by micro-batch
        for chunk in ids.split(4):
            counts += _fractions(fixed.route(chunk)[1]) * chunk.numel()
    fractions = counts / counts.sum()

    def exact(model: nn.Module, batch: Any) -> LossSum:
        logits, probs = model(batch[0])
        ce = nn.functional.cross_entropy(logits, batch[1].flatten(), reduction="sum")
        balance = _SwitchMoE.experts_count * (probs @ fractions).sum()
        tokens = len(probs)
        return LossSum.terms(ce=(ce, tokens), aux=Term(balance, count=tokens, weight=0.01))

    Accumulator(fixed, optimizers[2], micro_batch_size=4).step((ids, labels), exact)
    steps = [
        (p - q).abs().max()
        for p, q in zip(full.router.parameters(), start.router.parameters(), strict=True)
    ]
    for model, within in ((fixed, True), (naive, False)):  # negative control: per forward
        gaps = [
            float((p - q).abs().max() / s)
            for p, q, s in zip(
                model.router.parameters(), full.router.parameters(), steps, strict=True
            )
        ]
        assert (max(gaps) < 1e-10) is within, gaps
    assert relative_gap(param_tensors(fixed), param_tensors(full)) < 1e-10


def _critic_batch() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    real, fake = (torch.randn(11, 3, generator=generator, dtype=torch.float64) for _ in "rf")
    mix = torch.rand(11, 1, generator=generator, dtype=torch.float64)
    penalized = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1], dtype=torch.bool)
    return real, fake, mix, penalized


def _gradient_penalty(critic: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """WGAN-GP's penalty per item, on the items `penalized` marks (0 to 3 per micro-batch)."""
    real, fake, mix, penalized = batch
    between = (mix * real + (1 - mix) * fake).requires_grad_(True)
    (slope,) = torch.autograd.grad(critic(between).sum(), between, create_graph=True)
    return ((slope.norm(dim=1) - 1) ** 2 * penalized).sum(), penalized.sum()


def _critic_terms(critic: nn.Module, batch: Any) -> Any:
    real, fake = batch[0], batch[1]
    penalty, penalized = _gradient_penalty(critic, batch)
    wasserstein = (critic(fake) - critic(real)).sum()
    return LossSum.terms(w=(wasserstein, len(real)), gp=Term(penalty, count=penalized, weight=10))


def test_a_gradient_penalty_term_with_its_own_count_equals_the_full_batch_step() -> None:
    """A penalty through torch.autograd.grad(create_graph=True) as a term counted on its own
    items: the ledger's extra pass (the window learns the penalty's count last) runs through the
    double-backward graph; with clipping, two Adam steps equal the full-batch ones."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    batch = _critic_batch()

    def run(loss_fn: Any, micro: int | None) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(critic)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.9))
        acc = Accumulator(model, optimizer, micro_batch_size=micro or 1, max_grad_norm=1.0)
        for _ in range(2):
            if micro is not None:
                acc.step(batch, loss_fn)
                continue
            optimizer.zero_grad()
            penalty, penalized = _gradient_penalty(model, batch)
            wasserstein = (model(batch[1]) - model(batch[0])).mean()
            (wasserstein + 10 * penalty / penalized).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        return param_tensors(model)

    full = run(None, None)
    for micro in (1, 4):
        assert relative_gap(run(_critic_terms, micro), full) < 1e-10

    # Control: the penalty divided by all items (one LossSum) is another objective.
    def one_count(critic: nn.Module, b: Any) -> LossSum:
        penalty, _ = _gradient_penalty(critic, b)
        return LossSum((critic(b[1]) - critic(b[0])).sum() + 10 * penalty, len(b[0]))

    assert relative_gap(run(one_count, 4), full) > 1e-3


def test_terms_given_as_one_dict_are_checked_like_named_ones() -> None:
    value = torch.tensor(3.0, requires_grad=True)
    by_name = LossSum.terms(ce=(value, 4), aux=Term(value, count=2, weight=0.5))
    as_dict = LossSum.terms({"ce": (value, 4)}, aux=Term(value, count=2, weight=0.5))
    assert as_dict.terms == by_name.terms
    with pytest.raises(TypeError, match=r"by name \(ce=\(ce_sum, tokens\)\) or as one dict"):
        LossSum.terms([("ce", (value, 4))])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="as one dict of them keyed by str"):
        LossSum.terms({0: (value, 4)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"got the terms \['ce'\] twice"):
        LossSum.terms({"ce": (value, 4)}, ce=(value, 4))
    with pytest.raises(ValueError, match="needs at least one term"):
        LossSum.terms({})
