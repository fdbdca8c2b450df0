"""The blog loops' lines that survive a port to `loss_fn`, and what gradaccum says of them.

`loss = loss / accumulation_steps` (the mean-reduction loops) and a `reduction='sum'` criterion
returned as a plain scalar (the sum-reduction loops) are silently wrong under gradaccum, which
reads a plain scalar as a mean over the micro-batch's rows and divides once by the window's
count: both warn (`CopiedLoopWarning`), and the correct ports equal the full-batch step.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, LossSum, accumulate_grad
from gradaccum.loss import CopiedLoopWarning, LossTerms, Term
from tests.models import IGNORE_INDEX, make_model, token_batch
from tests.reference import param_tensors, relative_gap

STEPS = 4
SIZES = (5, 5, 5, 3)  # a loader's last batch is smaller: the window is ragged


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _loader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 5, generator=generator, dtype=torch.float64), torch.arange(n) % 3)
        for n in SIZES
    ]


def _mean(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _divided(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _mean(model, batch) / STEPS  # the copied `loss = loss / gradient_accumulation_steps`


def _summed(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.CrossEntropyLoss(reduction="sum")(model(batch[0]), batch[1])


def _summed_by_hand(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    per_row = nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
    return per_row.sum()  # the per-sample-weights path, `(w * per_row).sum()` with w = 1


def _loss_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    return LossSum(_summed(model, batch), count=len(batch[1]))  # the port of the sum loop


def _reference() -> nn.Module:
    """One plain full-batch SGD step on the window's 18 items."""
    model = _model()
    x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
    _mean(model, (x, y)).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return model


def _streamed(loss_fn) -> tuple[nn.Module, list[warnings.WarningMessage]]:
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulation_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [acc.micro_step(batch, loss_fn) for batch in _loader()]
    assert results[-1].stepped
    return model, [w for w in caught if issubclass(w.category, CopiedLoopWarning)]


def _gap(model: nn.Module, reference: nn.Module) -> float:
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return max(float(((a - b).abs() / b.abs().max()).max().detach()) for a, b in pairs)


@pytest.mark.parametrize("loss_fn", [_mean, _loss_sum])
def test_the_correct_ports_equal_the_full_batch_step_and_do_not_warn(loss_fn) -> None:
    model, caught = _streamed(loss_fn)
    assert not caught
    assert _gap(model, _reference()) < 1e-10


@pytest.mark.parametrize(
    ("loss_fn", "says"),
    [
        (_divided, "divides its loss by 4"),
        (_summed, "reduction='sum'.*5 rows"),
        (_summed_by_hand, r"\.sum\(\) over the micro-batch's 5 rows"),
    ],
)
def test_a_copied_line_warns_once_naming_the_fix_and_is_far_from_the_step(loss_fn, says) -> None:
    model, caught = _streamed(loss_fn)
    assert len(caught) == 1
    assert caught[0].filename == __file__  # points at the user's call
    message = str(caught[0].message)
    assert re.search(says, message), message
    assert "Remove the division" in message or "LossSum" in message
    assert _gap(model, _reference()) > 1e-3  # the negative control: silently another step


def test_step_and_accumulate_grad_warn_too() -> None:
    x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=5)
    with pytest.warns(CopiedLoopWarning, match="divides its loss by 4"):
        acc.step((x, y), _divided)  # 18 items: 4 micro-batches
    with pytest.warns(CopiedLoopWarning, match="reduction='sum'"):
        accumulate_grad(copy.deepcopy(model), (x, y), _summed, micro_batch_size=5)


def test_negative_controls_counts_from_the_data_and_one_row_sums_do_not_warn() -> None:
    """A token mean `sum / n` whose n equals the micro-batch count once is not a copied line;
    a reduction='sum' over one row is that row's loss, a mean over one row."""
    counts = iter([STEPS, 7, 6, 5])

    def token_mean(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return _summed(model, batch) / torch.tensor(next(counts))

    for loss_fn, sizes in ((token_mean, SIZES), (_summed, (1, 1, 1, 1))):
        model = _model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulation_steps=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CopiedLoopWarning)
            for batch, n in zip(_loader(), sizes, strict=True):
                acc.micro_step((batch[0][:n], batch[1][:n]), loss_fn)


def test_a_sum_divided_by_the_windows_count_warns_for_labelled_batches() -> None:
    """transformers' `num_items_in_batch`: `sum / n` with n the WINDOW's count, more than a
    micro-batch's labels can count, read as a row mean; dividing by the micro-batch's own count
    (a mean over it) does not warn."""
    x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
    batch = {"x": x, "labels": y}

    def over(n: int):
        def loss_fn(model: nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
            return _summed(model, (micro["x"], micro["labels"])) / n

        return loss_fn

    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=5)
    with pytest.warns(CopiedLoopWarning, match="num_items_in_batch"):
        acc.step(batch, over(len(y)))  # 18 items, 5 per micro-batch
    with warnings.catch_warnings():
        warnings.simplefilter("error", CopiedLoopWarning)
        acc.step({"x": x[:5], "labels": y[:5]}, over(5))  # the micro-batch's own count
        # A token mean over one scored label divides by 1: a mean, not a sum read as one.
        one = torch.where(torch.arange(5) == 0, y[:5], -100)
        acc.step({"x": x[:5], "labels": one}, over(1))


def _scaled_by(scaler: torch.amp.GradScaler, form: str):
    """A plain fp16 loop's `scaler.scale(loss)` ported into `loss_fn`, in each loss form."""

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        if form == "mean":
            return scaler.scale(_mean(model, batch))
        summed = scaler.scale(_summed(model, batch))
        if form == "sum":
            return LossSum(summed, count=len(batch[1]))
        return LossSum.terms(ce=(summed, len(batch[1])))

    return loss_fn


def _float_model() -> nn.Module:
    return _model().float()


def _float_loader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.float(), y) for x, y in _loader()]


@pytest.mark.parametrize("form", ["mean", "sum", "terms"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_a_loss_scaled_by_a_gradscaler_is_refused_changing_nothing(form, precision, drive) -> None:
    """`scaler.scale(loss)` returned from `loss_fn` (a hand AMP loop's line): gradaccum never
    unscales it, so fp32/bf16 stepped on 65536x gradients and fp16 skipped every window, all
    silently. It is refused before any backward: model, optimizer, both scalers bitwise as before.
    """
    scaler = torch.amp.GradScaler("cpu")
    model = _float_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    steps = {"step": None, "micro_step": STEPS}[drive]
    acc = Accumulator(
        model,
        optimizer,
        micro_batch_size=5 if drive == "step" else None,
        accumulation_steps=steps,
        precision=precision,
    )
    loader = _float_loader()
    x, y = (torch.cat(parts) for parts in zip(*loader, strict=True))
    assert acc.step((x, y), _mean).stepped if drive == "step" else True  # optimizer state held
    before = {
        "model": copy.deepcopy(model.state_dict()),
        "grads": [p.grad for p in model.parameters()],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scalers": [s.state_dict() for s in (scaler, acc.scaler) if s is not None],
    }
    loss_fn = _scaled_by(scaler, form)
    if drive == "step":
        call = lambda: acc.step((x, y), loss_fn)  # noqa: E731
    else:
        acc.micro_step(loader[0], _mean)  # an open window is forgotten with it
        call = lambda: acc.micro_step(loader[1], loss_fn)  # noqa: E731
    with pytest.raises(ValueError, match=r"GradScaler's loss scale \(65536.*acc\.scaler"):
        call()
    after_model = model.state_dict()
    assert all(torch.equal(before["model"][k], after_model[k]) for k in after_model)
    assert [p.grad for p in model.parameters()] == before["grads"]
    assert str(optimizer.state_dict()) == str(before["optimizer"])
    assert [s.state_dict() for s in (scaler, acc.scaler) if s is not None] == before["scalers"]


def test_negative_control_a_loss_weight_tensor_is_not_a_gradscaler() -> None:
    """The refusal is exact: the same factor held by no GradScaler (a loss weight) runs, and it
    shows what the refusal prevents: a step 65536 times the full-batch one."""
    weight = torch.tensor(65536.0)
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulation_steps=STEPS)
    for batch in _loader():
        result = acc.micro_step(batch, lambda m, b: _mean(m, b) * weight)
    assert result.stepped
    assert _gap(model, _reference()) > 1e3


def _scheduled_run(when: str) -> tuple[nn.Module, list[warnings.WarningMessage]]:
    """Three windows of the loader, with a warmup stepped `when` ("micro", "stepped", "epoch").

    "micro" is the copied loop's `scheduler.step()` after every micro-batch; "stepped" steps it
    when `result.stepped`; "epoch" once after a carried window's epoch (a per-epoch schedule).
    """
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 8))
    carry = "carry" if when == "epoch" else "step"
    acc = Accumulator(model, optimizer, accumulation_steps=STEPS, partial_window=carry)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for batch in _loader()[:-1] if when.startswith("epoch") else _loader():
                result = acc.micro_step(batch, _mean)
                if when == "micro" or (when == "stepped" and result.stepped):
                    warmup.step()
            if when.startswith("epoch"):
                if when == "epoch":  # "epoch-unflushed": the epoch's flush() left out
                    acc.flush()
                warmup.step()
        acc.flush("drop")
    return model, [w for w in caught if issubclass(w.category, CopiedLoopWarning)]


def test_a_scheduler_stepped_per_micro_batch_warns_once_and_is_far_from_the_steps() -> None:
    """The copied loop's `scheduler.step()` per micro-batch: the warmup runs 4 times too fast."""
    model, caught = _scheduled_run("micro")
    assert len(caught) == 1
    assert caught[0].filename == __file__  # points at the user's micro_step() call
    message = str(caught[0].message)
    assert "learning rate changed between two micro_step() calls" in message
    assert "result.stepped" in message
    assert "scheduler=" in message
    reference, _ = _scheduled_run("stepped")  # control: the schedule a step at a time
    assert _gap(model, reference) > 1e-3


def test_a_scheduler_stepped_per_window_or_per_epoch_does_not_warn_and_is_exact() -> None:
    model, caught = _scheduled_run("stepped")
    assert not caught
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 8))
    x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
    for _ in range(3):
        optimizer.zero_grad()
        _mean(reference, (x, y)).backward()
        optimizer.step()
        warmup.step()
    assert _gap(model, reference) < 1e-10
    _, caught = _scheduled_run("epoch")  # a carried window spans the epoch's step: no warning
    assert not caught


def test_an_epoch_scheduler_stepped_with_the_epochs_last_window_open_warns_naming_flush() -> None:
    """A per-epoch scheduler.step() with no acc.flush() at the epoch's end moves the lr inside
    the epoch's last window, which goes on into the next epoch: the warning names the flush."""
    _, caught = _scheduled_run("epoch-unflushed")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "learning rate changed between two micro_step() calls" in message
    assert "call acc.flush() before it" in message


def _mean_as_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    return LossSum(_mean(model, batch), count=len(batch[1]))  # a mean where the sum belongs


def _mean_of_rows_as_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    per_row = nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
    return LossSum(per_row.mean(), count=len(batch[1]))


def _mean_as_a_term(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossTerms:
    return LossSum.terms(ce=(_mean(model, batch), len(batch[1])))


@pytest.mark.parametrize(
    ("loss_fn", "where"),
    [
        (_mean_as_sum, r"LossSum\(value, count\)"),
        (_mean_of_rows_as_sum, r"LossSum\(value, count\)"),
        (_mean_as_a_term, r"LossSum.terms\(ce=...\)"),
    ],
)
def test_a_mean_given_as_a_loss_sums_value_warns_and_is_far_from_the_step(loss_fn, where) -> None:
    """`LossSum(mean, count)` divides the micro-batches' means by the window's count (was
    silent); `LossSum(mean, 1)`, a mean over one item, and the sum do not warn."""
    model, caught = _streamed(loss_fn)
    assert len(caught) == 1
    said = str(caught[0].message)
    assert re.search(where + r" whose value is a MEAN .* count of 5", said), said
    assert _gap(model, _reference()) > 1e-3  # the negative control: silently another step

    def one_row(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
        return LossSum(_mean(model, (batch[0][:1], batch[1][:1])), count=1)

    for fine in (one_row, _loss_sum):
        _, caught = _streamed(fine)
        assert not caught


def _row_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _summed(model, batch) / len(batch[1])  # a mean over the rows, written by hand


def _batchmean_kl(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    target = nn.functional.one_hot(batch[1], 3).double() * 0.8 + 0.2 / 3  # a teacher's soft labels
    logp = nn.functional.log_softmax(model(batch[0]), dim=-1)
    return nn.functional.kl_div(logp, target, reduction="batchmean")  # sum / rows, torch's own


@pytest.mark.parametrize("loss_fn", [_row_sum, _batchmean_kl])
@pytest.mark.parametrize("drive", ["step", "micro_step"])
def test_a_sum_over_rows_divided_by_rows_does_not_warn_when_rows_equal_micro_batches(
    loss_fn, drive
) -> None:
    """16 rows in 4 micro-batches of 4: `sum / len(x)` and `kl_div(reduction='batchmean')` (a
    distillation loss) divide by 4, the micro-batches' number, but they are row means, exactly
    what a plain scalar is read as. It warned, telling the user to remove the division (which
    would make every gradient 4x too large); the step is the full-batch one. `mean / 4` (the
    copied line) on the same split still warns."""
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 5, generator=generator, dtype=torch.float64), torch.arange(16) % 3
    reference = _model()
    loss_fn(reference, (x, y)).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    def run(fn) -> tuple[nn.Module, list[warnings.WarningMessage]]:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if drive == "step":
                assert Accumulator(model, optimizer, micro_batch_size=4).step((x, y), fn).stepped
            else:
                acc = Accumulator(model, optimizer, accumulation_steps=4)
                parts = zip(x.split(4), y.split(4), strict=True)
                results = [acc.micro_step(mb, fn) for mb in parts]
                assert results[-1].stepped
        return model, [w for w in caught if issubclass(w.category, CopiedLoopWarning)]

    model, caught = run(loss_fn)
    assert not caught, [str(w.message) for w in caught]
    assert _gap(model, reference) < 1e-10
    divided, caught = run(lambda model, batch: _mean(model, batch) / 4)  # negative control
    assert len(caught) == 1
    assert "divides its loss by 4" in str(caught[0].message)
    if loss_fn is _row_sum:  # the same objective, divided by 4 once more: another step
        assert _gap(divided, reference) > 1e-3


def test_a_plateau_step_inside_a_window_is_named_harmless_and_is_the_plain_step() -> None:
    """`ReduceLROnPlateau.step(val_loss)` (stepped by the user, as the constructor's error says)
    after a validation that falls inside a window changes the rate once: the warning says that is
    the plain loop's step too, and the steps equal a full-batch loop reducing at the same time."""
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    plateaus = [
        torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0) for o in (optimizer, plain)
    ]
    acc = Accumulator(model, optimizer, accumulation_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            for index, batch in enumerate(_loader()):
                acc.micro_step(batch, _mean)
                if index == 1:  # a validation in the window's middle, worse every time
                    plateaus[0].step(float(epoch))
            x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
            plateaus[1].step(float(epoch))
            plain.zero_grad()
            _mean(reference, (x, y)).backward()
            plain.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, CopiedLoopWarning)]
    assert len(messages) == 1
    assert "ReduceLROnPlateau" in messages[0]
    assert optimizer.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.05
    assert _gap(model, reference) < 1e-10


def test_a_sum_of_a_few_heads_means_is_no_per_row_sum_and_does_not_warn() -> None:
    """`torch.stack([ce_main, ce_aux]).sum()` sums two means, not a value per row: it is the
    full-batch step (the control, the same stack of per-row losses summed, warns above)."""

    def two_heads(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.stack([_mean(model, batch), 0.5 * _mean(model, batch)]).sum()

    model, caught = _streamed(two_heads)
    assert not caught
    reference = _model()
    x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
    (1.5 * _mean(reference, (x, y))).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert _gap(model, reference) < 1e-10


_TEACHER = nn.Linear(5, 3).double().requires_grad_(False)
_T = 2.0  # distillation temperature


def _soft_targets(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return nn.functional.softmax(_TEACHER(batch[0]) / _T, -1)


def _kd(reduction: str):
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        student = nn.functional.log_softmax(model(batch[0]) / _T, -1)
        kl = nn.functional.kl_div(student, _soft_targets(batch), reduction=reduction)
        return kl * _T * _T  # Hinton's T^2

    return loss


def _half_ce_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return 0.5 * _summed(model, batch)  # a loss weight on a reduction='sum' criterion


def _ce_sum_over_rows(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _summed(model, batch) * (1 / len(batch[1]))  # the row mean, written as a product


def _plain_full_batch(loss_fn) -> nn.Module:
    """The plain loop on the whole window: whatever `loss_fn` returns is the objective."""
    model = _model()
    x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
    loss_fn(model, (x, y)).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return model


@pytest.mark.parametrize(
    ("loss_fn", "warns"),
    [
        (_kd("sum"), True),
        (_half_ce_sum, True),
        (_kd("batchmean"), False),
        (_ce_sum_over_rows, False),
    ],
    ids=["kd-sum-times-T2", "weighted-ce-sum", "kd-batchmean-times-T2", "ce-sum-times-1/rows"],
)
def test_a_sum_seen_through_constant_factors_warns_and_a_row_mean_does_not(loss_fn, warns) -> None:
    """A distillation's `kl_div(reduction='sum') * T * T` (a whole `.sum()` inside) and a
    weighted `0.5 * ce_sum` returned plainly were silently another step: the check read only
    the last node, a multiplication. They warn now; the row means (`batchmean`, a sum times
    `1 / rows`) do not and equal the plain full-batch step."""
    model, caught = _streamed(loss_fn)
    if warns:
        assert len(caught) == 1
        assert re.search(r"\.sum\(\).*5 rows", str(caught[0].message))
        # Control: read as row means, the sums are another step than the plain loop's.
        assert _gap(model, _plain_full_batch(loss_fn)) > 1e-3
    else:
        assert not caught
        assert _gap(model, _plain_full_batch(loss_fn)) < 1e-10


def test_a_sum_over_outputs_of_means_over_rows_does_not_warn_when_outputs_equal_rows() -> None:
    """`.mean(0).sum()`: 5 outputs' means over the rows, summed, is a row mean (exact, plain),
    although its summed tensor has 5 entries like the 5-row micro-batches; summing the rows'
    own means, `.mean(1).sum()`, is a sum over rows and warns (control: far from the step)."""
    generator = torch.Generator().manual_seed(2)
    x, y = (torch.randn(15, 5, generator=generator, dtype=torch.float64) for _ in "xy")

    def run(loss_fn, micro: int | None) -> tuple[nn.Module, list[warnings.WarningMessage]]:
        torch.manual_seed(0)
        model = nn.Linear(5, 5).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if micro:
                Accumulator(model, optimizer, micro_batch_size=micro).step((x, y), loss_fn)
            else:
                loss_fn(model, (x, y)).backward()
                optimizer.step()
        return model, [w for w in caught if issubclass(w.category, CopiedLoopWarning)]

    def per_output(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (m(b[0]) - b[1]).pow(2).mean(0).sum()

    def per_row(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (m(b[0]) - b[1]).pow(2).mean(1).sum()

    model, caught = run(per_output, 5)
    assert not caught
    assert _gap(model, run(per_output, None)[0]) < 1e-10
    model, caught = run(per_row, 5)
    assert len(caught) == 1
    assert _gap(model, run(per_row, None)[0]) > 1e-3


def _bpr(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """BPR on given (positive, negative) pairs, per row: the score of class 0 over class 1."""
    scores = model(batch[0])
    return nn.functional.logsigmoid(scores[:, 0] - scores[:, 1])


def test_a_negated_sum_returned_plainly_warns_and_its_loss_sum_is_the_full_batch_step() -> None:
    """Log-likelihoods are negated sums: BPR's `-F.logsigmoid(diff).sum()` returned plainly is
    read as a mean over the rows and weighted by them again (4 rows: 4 times too large). The
    `NegBackward0` node on top hid the sum from the check, which warned of `(-l).sum()` only:
    silently 0.6 off. The LossSum it names is the full-batch step; negated means do not warn."""
    x, y = (torch.cat(parts) for parts in zip(*_loader(), strict=True))
    reference = _model()
    (-_bpr(reference, (x, y)).mean()).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    steps = {}
    for name, loss_fn in (
        ("plain", lambda m, b: -_bpr(m, b).sum()),
        ("counted", lambda m, b: LossSum(-_bpr(m, b).sum(), count=len(b[0]))),
    ):
        model = steps[name] = _model()
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.step((x, y), loss_fn)
        copied = [str(w.message) for w in caught if w.category is CopiedLoopWarning]
        assert len(copied) == (name == "plain"), [str(w.message) for w in caught]
        assert all("a .sum() over the micro-batch's 4 rows" in text for text in copied)
    for exact, plain, full in zip(
        steps["counted"].parameters(),
        steps["plain"].parameters(),
        reference.parameters(),
        strict=True,
    ):
        torch.testing.assert_close(exact, full, rtol=1e-10, atol=0)
        assert float((plain - full).abs().max()) > 1e-2  # the control: the rows counted twice
    quiet = [
        lambda m, b: -_bpr(m, b).mean(),
        lambda m, b: -(_bpr(m, b).sum() / len(b[0])),
        lambda m, b: -_bpr(m, b).sum() / len(b[0]),  # 4 rows, 4 micro-batches: not a copied line
        lambda m, b: LossSum(-_bpr(m, b).mean() * len(b[0]), count=len(b[0])),
        lambda m, b: LossSum(-_bpr(m, b).sum(), count=len(b[0])),
    ]
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loss_fn in quiet:
            accumulate_grad(model, (x[:16], y[:16]), loss_fn, micro_batch_size=4)
    with pytest.warns(CopiedLoopWarning, match="whose value is a MEAN"):  # negated too
        accumulate_grad(model, (x, y), lambda m, b: LossSum(-_bpr(m, b).mean(), count=len(b[0])), 4)


def test_a_z_loss_mean_counted_once_beside_the_tokens_warns_and_its_sum_is_exact() -> None:
    """A PaLM z-loss written as a mean over the scored tokens, `Term(z.mean(), count=1)`, beside
    the token loss: the window averaged the micro-batches' means, 2.7e-3 off the full-batch
    step on GPT-2, silently. It warns naming the sum; the sum with the tokens' count is exact."""
    batch = token_batch(torch.Generator().manual_seed(2), 7)

    def parts(model: nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        logits = model(mb["tokens"])
        scored = mb["labels"] != IGNORE_INDEX
        ce = nn.functional.cross_entropy(
            logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return ce, torch.logsumexp(logits, -1)[scored] ** 2, scored.sum()

    def as_mean(model: nn.Module, mb: dict[str, torch.Tensor]) -> LossSum:
        ce, z, tokens = parts(model, mb)
        return LossSum.terms(ce=(ce, tokens), z=Term(z.mean(), count=1, weight=0.1))

    def as_sum(model: nn.Module, mb: dict[str, torch.Tensor]) -> LossSum:
        ce, z, tokens = parts(model, mb)
        return LossSum.terms(ce=(ce, tokens), z=Term(z.sum(), count=tokens, weight=0.1))

    def run(loss_fn: object) -> tuple[dict[str, torch.Tensor], list[str]]:
        model = make_model("token")
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert acc.step(batch, loss_fn).stepped
        said = [str(w.message) for w in caught if issubclass(w.category, CopiedLoopWarning)]
        return param_tensors(model), said

    model = make_model("token")
    ce, z, tokens = parts(model, batch)
    (ce / tokens + 0.1 * z.mean()).backward()  # the full batch: both means over its tokens
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    reference = param_tensors(model)
    exact, quiet = run(as_sum)
    assert relative_gap(exact, reference) < 1e-10
    assert not quiet
    off, said = run(as_mean)
    assert relative_gap(off, reference) > 1e-5  # negative control: silently off before
    assert len(said) == 1
    assert "MEAN over" in said[0]
    assert "Term((lse[scored] ** 2).sum(), count=scored.sum()" in said[0]


def test_a_loss_sum_value_divided_by_its_count_warns_and_a_scaled_sum_does_not() -> None:
    """`LossSum(ce_sum / n, n)` divides twice (the window divides by its count): it warns. A
    sum scaled by a convention's constant (`sq.sum() / 2`) is no mean over the counted items."""
    batch = token_batch(torch.Generator().manual_seed(3), 7)

    def run(loss_fn: object) -> list[str]:
        model = make_model("token")
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert acc.step(batch, loss_fn).stepped
        return [str(w.message) for w in caught if issubclass(w.category, CopiedLoopWarning)]

    def summed(model: nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(mb["tokens"]).flatten(0, 1)
        labels = mb["labels"].flatten()
        loss = nn.functional.cross_entropy(
            logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss, (labels != IGNORE_INDEX).sum()

    def twice(model: nn.Module, mb: dict[str, torch.Tensor]) -> LossSum:
        loss, tokens = summed(model, mb)
        return LossSum(loss / tokens, tokens)

    def halved(model: nn.Module, mb: dict[str, torch.Tensor]) -> LossSum:
        loss, tokens = summed(model, mb)
        return LossSum(loss / 2, tokens)

    said = run(twice)
    assert len(said) == 1
    assert "SUM divided by" in said[0]
    assert not run(halved)


class _TwoHeads(nn.Module):
    """A shared encoder and two heads, one optimizer (and Accumulator) per task."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.ha, self.hb = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 1)
        self.double()


def _task(head: str):  # type: ignore[no-untyped-def]
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = getattr(model, head)(torch.tanh(model.enc(batch[0])))
        return nn.functional.mse_loss(out, batch[1])

    return loss


def _two_task_setup() -> tuple[nn.Module, list[torch.optim.Optimizer], list[Accumulator]]:
    model = _TwoHeads()
    opts = [
        torch.optim.SGD([*model.enc.parameters(), *getattr(model, head).parameters()], lr=0.1)
        for head in ("ha", "hb")
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the other head: in no param group
        accs = [Accumulator(model, opt, accumulation_steps=2) for opt in opts]
    return model, opts, accs


def _two_task_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    return x, torch.randn(8, 1, generator=generator, dtype=torch.float64)


def _two_task_reference(x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The plain steps: each head's SGD step (lr 0.1) over the encoder and itself, full batch."""
    reference = _TwoHeads()
    for head in ("ha", "hb"):
        params = [*reference.enc.parameters(), *getattr(reference, head).parameters()]
        grads = torch.autograd.grad(_task(head)(reference, (x, y)), params)
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param -= 0.1 * grad
    return reference


def test_two_accumulators_interleaved_over_a_shared_encoder_are_refused_naming_the_other() -> None:
    """Two optimizers over one encoder, `acc_a.micro_step` and `acc_b.micro_step` alternating:
    the second window's opening set the first's partial gradients aside; both were refused
    later (as a `zero_grad()`), leaving the first's stale partial sums in `.grad`. Now the second
    window is refused before it runs, naming the other Accumulator and the fix; the first window
    is kept whole and, run one window after the other, both steps are the plain full-batch steps
    in that order."""
    model, _, (acc_a, acc_b) = _two_task_setup()
    x, y = _two_task_data()
    acc_a.micro_step((x[:4], y[:4]), _task("ha"))
    held = copy.deepcopy((model.state_dict(), [p.grad for p in model.parameters()]))
    with pytest.raises(RuntimeError, match=r"another Accumulator has a window open") as error:
        acc_b.micro_step((x[:4], y[:4]), _task("hb"))
    assert "Run the other window to its step" in str(error.value)
    weights, grads = held  # nothing changed, the open window included
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name])
    for param, grad in zip(model.parameters(), grads, strict=True):
        assert (param.grad is None and grad is None) or torch.equal(param.grad, grad)
    assert not acc_b._engine.window.is_open
    # The fix: the open window to its step, then the other's.
    assert acc_a.micro_step((x[4:], y[4:]), _task("ha")).stepped
    acc_b.micro_step((x[:4], y[:4]), _task("hb"))
    assert acc_b.micro_step((x[4:], y[4:]), _task("hb")).stepped
    reference = _two_task_reference(x, y)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=0)


def test_negative_control_interleaved_plain_windows_over_a_shared_encoder_leak() -> None:
    """The same interleaving in a plain loop: each step takes the other task's gradient too."""
    model = _TwoHeads()
    x, y = _two_task_data()
    opts = [
        torch.optim.SGD([*model.enc.parameters(), *getattr(model, head).parameters()], lr=0.1)
        for head in ("ha", "hb")
    ]
    for half in (slice(0, 4), slice(4, 8)):
        for head in ("ha", "hb"):
            (_task(head)(model, (x[half], y[half])) / 2).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    reference = _two_task_reference(x, y)
    gap = max(
        float((a - b).detach().abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )
    assert gap > 1e-3


def test_negative_control_the_second_window_opened_leaves_stale_partial_sums(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gradaccum._parameters.busy_error", lambda *args: None)
    model, _, (acc_a, acc_b) = _two_task_setup()
    x, y = _two_task_data()
    acc_a.micro_step((x[:4], y[:4]), _task("ha"))
    acc_b.micro_step((x[:4], y[:4]), _task("hb"))  # sets acc_a's sums aside
    with pytest.raises(RuntimeError, match="changed between two micro-batches"):
        acc_a.micro_step((x[4:], y[4:]), _task("ha"))
    with pytest.raises(RuntimeError, match="changed between two micro-batches"):
        acc_b.micro_step((x[4:], y[4:]), _task("hb"))
    assert model.enc.weight.grad is not None  # acc_a's discarded partial sum, put back by acc_b


class _Config:
    """A training config as a copied loop keeps it: the scale read from it in `loss_fn`."""

    accumulation_steps = STEPS
    loss_scale = 1 / STEPS


def _times_reciprocal(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _mean(model, batch) * (1 / STEPS)


def _times_quarter(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return 0.25 * _mean(model, batch)  # 1 / STEPS, written out


def _times_config(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _mean(model, batch).mul(_Config.loss_scale)


def _times_tensor(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _mean(model, batch) * torch.tensor(1 / STEPS, dtype=torch.float64)


def _each_term_divided(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    aux = model(batch[0]).pow(2).mean()
    return _mean(model, batch) / _Config.accumulation_steps + 0.1 * aux / STEPS


def _loss_sum_times_reciprocal(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    return LossSum(_summed(model, batch) * (1 / STEPS), count=len(batch[1]))


@pytest.mark.parametrize(
    "loss_fn",
    [
        _times_reciprocal,
        _times_quarter,
        _times_config,
        _times_tensor,
        _each_term_divided,
        _loss_sum_times_reciprocal,
    ],
    ids=["loss*(1/k)", "0.25*loss", "loss.mul(cfg)", "loss*tensor", "ce/k+aux/k", "LossSum*(1/k)"],
)
def test_a_loss_scaled_by_one_over_the_micro_batches_warns_however_spelled(loss_fn) -> None:
    """`loss * (1 / accumulation_steps)` and its spellings were silent (0.13 off the step):
    only a division by the micro-batches was read. They warn once now, naming the factor."""
    model, caught = _streamed(loss_fn)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__
    assert re.search(r"scales its loss by 1/4.*Remove the factor", str(caught[0].message))
    # Control: the step taken is not the full-batch one (the factor divides twice).
    assert _gap(model, _reference()) > 1e-3


def _heads(count: int):
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(batch[0])
        losses = [nn.functional.cross_entropy(out * (i + 1), batch[1]) for i in range(count)]
        return sum(losses[1:], losses[0]) / count  # the mean of `count` heads' losses

    return loss_fn


@pytest.mark.parametrize(
    ("loss_fn", "steps"),
    [
        (_heads(STEPS), STEPS),  # a mean of 4 heads on 4 micro-batches: told to remove it before
        (lambda m, b: _heads(3)(m, b) * 1.0, 3),
        (lambda m, b: 0.5 * nn.functional.mse_loss(m(b[0]), torch.zeros_like(m(b[0]))), 2),
        (lambda m, b: 0.3 * _mean(m, b), STEPS),
    ],
    ids=["mean-of-4-heads", "mean-of-3-heads", "0.5*mse-on-2", "weight-0.3"],
)
def test_a_mean_of_k_losses_or_a_weight_does_not_warn_and_is_the_full_batch_step(
    loss_fn, steps
) -> None:
    """False alarms: a mean of as many heads' losses as micro-batches (`(a + b + c) / 3` on
    three micro-batches) warned "remove the division", which breaks the loss; `0.5 * mse` on
    two micro-batches is a convention, not a copied line. None warns; each is exact."""
    batches = _loader()[:steps]
    model = _model()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), accumulation_steps=steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CopiedLoopWarning)
        results = [acc.micro_step(batch, loss_fn) for batch in batches]
    assert results[-1].stepped
    reference = _model()
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    loss_fn(reference, (x, y)).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert _gap(model, reference) < 1e-10
