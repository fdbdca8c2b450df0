"""The embedded tasks: registry, determinism, batch layout, loss convention, exactness, learning.

Loss values and gradients are checked against plain PyTorch references written here (no
gradaccum), in float64 with rtol 1e-10. Every exactness claim has a negative control that must
show a large gap: BatchNorm in train mode for `shapes`, mean-of-means normalization for `charlm`.
"""

from __future__ import annotations

import math
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradaccum import LossSum, check_equivalence
from gradaccum.experiments.tasks import TASKS, get_task
from gradaccum.experiments.tasks.charlm import IGNORE_INDEX, decode, load_lines
from gradaccum.experiments.tasks.shapes import CLASSES, mean_iou

ROOT = Path(__file__).resolve().parents[1]
EXACT = {"rtol": 1e-10, "atol": 0.0}


def _leaves(batch):
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def _take(batch, count):
    if isinstance(batch, dict):
        return {key: value[:count] for key, value in batch.items()}
    return tuple(value[:count] for value in batch)


def _max_rel_gap(grads_a, grads_b):
    """Largest per-parameter gap, relative to the parameter's largest reference entry."""
    return max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(grads_a, grads_b, strict=True)
    )


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning threads crawl on a busy box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def datasets():
    return {name: get_task(name).make_data(seed=0) for name in TASKS}


# --- registry ----------------------------------------------------------------------------------


def test_registry_lists_three_tasks_with_the_protocol_attributes():
    assert TASKS == ("digits", "shapes", "charlm")
    for name in TASKS:
        task = get_task(name)
        assert task.name == name
        assert isinstance(task.metric, str)
        assert isinstance(task.higher_is_better, bool)
        for attribute in ("reference_batch_size", "default_batch_size", "default_epochs"):
            assert getattr(task, attribute) > 0
        assert task.default_lr > 0
    assert get_task("charlm").higher_is_better is False


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown task 'mnist'") as error:
        get_task("mnist")
    assert all(name in str(error.value) for name in TASKS)


@pytest.mark.parametrize(
    ("name", "bad"), [("digits", "group"), ("charlm", "group"), ("shapes", "layer")]
)
def test_invalid_norm_is_rejected_with_the_choices(name, bad):
    with pytest.raises(ValueError, match=f"norm={bad!r}.*batch"):
        get_task(name).make_model(0, norm=bad)


def test_shapes_norm_picks_batchnorm_or_groupnorm():
    task = get_task("shapes")
    kinds = {
        norm: {type(m) for m in task.make_model(0, norm).modules()} for norm in ("batch", "group")
    }
    assert torch.nn.BatchNorm2d in kinds["batch"]
    assert torch.nn.GroupNorm not in kinds["batch"]
    assert torch.nn.GroupNorm in kinds["group"]
    assert torch.nn.BatchNorm2d not in kinds["group"]


# --- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TASKS)
def test_same_seed_same_data_other_seed_other_data(name, datasets):
    task = get_task(name)
    again, other = task.make_data(seed=0), task.make_data(seed=1)
    for split in ("train", "val"):
        first = _leaves(getattr(datasets[name], split))
        assert all(
            torch.equal(a, b) for a, b in zip(first, _leaves(getattr(again, split)), strict=True)
        )
    assert not torch.equal(_leaves(datasets[name].train)[0], _leaves(other.train)[0])


@pytest.mark.parametrize("name", TASKS)
def test_same_seed_same_weights_and_the_callers_rng_is_untouched(name):
    task = get_task(name)
    rng_before = torch.get_rng_state()
    first, second, other = (task.make_model(seed).state_dict() for seed in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first)


# --- batch layout ------------------------------------------------------------------------------


def test_digits_layout(datasets):
    (x_train, y_train), y_val = datasets["digits"].train, datasets["digits"].val[1]
    assert x_train.shape[1:] == (1, 8, 8)
    assert x_train.dtype == torch.float32
    assert y_train.dtype == torch.int64
    assert len(y_train) == len(x_train)
    assert len(y_train) + len(y_val) == 1797
    assert len(y_val) == 359
    assert float(x_train.min()) >= 0.0
    assert float(x_train.max()) <= 1.0
    assert set(y_val.tolist()) == set(range(10))


def test_shapes_layout(datasets):
    (x_train, y_train), (x_val, y_val) = datasets["shapes"].train, datasets["shapes"].val
    assert x_train.shape == (400, 1, 32, 32)
    assert x_train.dtype == torch.float32
    assert y_train.shape == (400, 32, 32)
    assert y_train.dtype == torch.int64
    assert x_val.shape == (100, 1, 32, 32)
    assert y_val.shape == (100, 32, 32)
    frequency = torch.bincount(y_train.flatten(), minlength=len(CLASSES)) / y_train.numel()
    assert frequency.shape == (len(CLASSES),)
    assert bool((frequency > 0.03).all())


def test_charlm_layout_padding_and_shift(datasets):
    train, val = datasets["charlm"].train, datasets["charlm"].val
    assert len(train["tokens"]) + len(val["tokens"]) == len(load_lines())
    tokens, labels = train["tokens"], train["labels"]
    assert tokens.shape == labels.shape
    assert tokens.dtype == labels.dtype == torch.int64
    real = labels != IGNORE_INDEX
    lengths = real.sum(dim=1)
    assert len(set(lengths.tolist())) > 20  # genuinely ragged lines
    # Labels are the inputs shifted by one; padding sits only at the end of each row.
    assert torch.equal(tokens[:, 1:][real[:, 1:]], labels[:, :-1][real[:, 1:]])
    assert torch.equal(real, torch.arange(labels.shape[1]) < lengths[:, None])
    assert bool((tokens[~real] == 0).all())
    assert decode(tokens[0, 1 : int(lengths[0])].tolist()) in load_lines()


def test_charlm_text_ships_as_package_data():
    text = resources.files("gradaccum.experiments.tasks").joinpath("data/charlm.txt")
    assert text.is_file()
    assert 400 <= len(load_lines()) <= 700
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # tomllib needs 3.11
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"experiments/tasks/data/*.txt"' in section


def test_digits_without_scikit_learn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(
        ImportError, match=r"pip install 'gradaccum\[cli\]' \(see the README, section Installing\)"
    ):
        get_task("digits").make_data(0)


# --- loss convention (plain float64 references) ------------------------------------------------


def test_digits_loss_is_the_per_image_mean(datasets):
    task = get_task("digits")
    model = task.make_model(0).double()
    images, labels = _take(datasets["digits"].train, 20)
    loss = task.loss_fn(model, (images.double(), labels))
    assert isinstance(loss, torch.Tensor)
    assert loss.dim() == 0
    reference = F.cross_entropy(model(images.double()), labels)
    torch.testing.assert_close(loss, reference, **EXACT)


def test_shapes_loss_is_a_pixel_sum_counted_in_pixels(datasets):
    task = get_task("shapes")
    model = task.make_model(0, "group").double()
    images, labels = _take(datasets["shapes"].train, 3)
    result = task.loss_fn(model, (images.double(), labels))
    assert isinstance(result, LossSum)
    assert int(result.count) == 3 * 32 * 32
    reference = F.cross_entropy(model(images.double()), labels)
    torch.testing.assert_close(result.value / result.count, reference, **EXACT)


def test_charlm_loss_counts_non_pad_labels_and_matches_the_token_mean(datasets):
    task = get_task("charlm")
    model = task.make_model(0).double()
    batch = _take(datasets["charlm"].train, 9)
    result = task.loss_fn(model, batch)
    assert isinstance(result, LossSum)
    assert int(result.count) == int((batch["labels"] != IGNORE_INDEX).sum())
    # Reference: the whole padded width (no trimming), token mean over non-pad labels.
    logits = model(batch["tokens"])
    reference = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(result.value / int(result.count), reference, **EXACT)


# --- exactness ---------------------------------------------------------------------------------


def _gradients(model, loss):
    return list(torch.autograd.grad(loss, list(model.parameters()), retain_graph=True))


def test_charlm_token_sum_accumulation_is_exact_and_mean_of_means_is_not(datasets):
    """Plain reference: full-batch token mean vs sums over micro-batches divided once."""
    task = get_task("charlm")
    model = task.make_model(0).double()
    batch = _take(datasets["charlm"].train, 12)
    full = F.cross_entropy(
        model(batch["tokens"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    )
    reference = _gradients(model, full)

    parts = [{key: value[i : i + 4] for key, value in batch.items()} for i in range(0, 12, 4)]
    results = [task.loss_fn(model, part) for part in parts]
    total = sum(int(r.count) for r in results)
    assert len({int(r.count) for r in results}) == 3  # micro-batches count different tokens
    exact = _gradients(model, sum(r.value for r in results) / total)
    # Per-parameter relative gap: the key bias has an exactly-zero true gradient (softmax ignores
    # it), so elementwise rtol would compare rounding noise against 0.
    assert _max_rel_gap(exact, reference) < 1e-10

    naive = _gradients(model, sum(r.value / r.count for r in results) / len(results))
    assert _max_rel_gap(naive, reference) > 1e-3


@pytest.mark.parametrize(
    ("name", "norm", "items", "micro"),
    [("digits", "batch", 10, 3), ("shapes", "group", 4, 3), ("charlm", "batch", 10, 4)],
)
def test_check_equivalence_is_ok_without_batchnorm(datasets, name, norm, items, micro):
    task = get_task(name)
    report = check_equivalence(
        task.make_model(0, norm), _take(datasets[name].train, items), task.loss_fn, micro
    )
    assert report.ok, str(report)
    assert report.non_additive == ()


def test_check_equivalence_flags_batchnorm_in_shapes(datasets):
    task = get_task("shapes")
    report = check_equivalence(
        task.make_model(0, "batch"), _take(datasets["shapes"].train, 4), task.loss_fn, 2
    )
    assert not report.ok
    assert report.max_rel_diff > 1e-3
    assert report.non_additive
    assert all(m.kind == "BatchNorm2d" for m in report.non_additive)


def test_check_equivalence_rejects_charlm_mean_of_means(datasets):
    task = get_task("charlm")
    report = check_equivalence(
        task.make_model(0), _take(datasets["charlm"].train, 10), task.naive_loss_fn, 4
    )
    assert not report.ok
    assert report.max_rel_diff > 1e-3


# --- evaluation and learning -------------------------------------------------------------------


@pytest.mark.parametrize("name", TASKS)
def test_evaluate_is_independent_of_its_batch_size_and_restores_the_mode(name, datasets):
    task = get_task(name)
    model = task.make_model(0)
    val = _take(datasets[name].val, 24)
    by_five, whole = task.evaluate(model, val, 5), task.evaluate(model, val, 64)
    assert model.training
    assert set(by_five) == {"metric", "loss"}
    assert by_five["metric"] == pytest.approx(whole["metric"], rel=1e-5)
    assert by_five["loss"] == pytest.approx(whole["loss"], rel=1e-5)


def test_evaluate_matches_plain_references(datasets):
    digits = get_task("digits")
    model = digits.make_model(0)
    images, labels = datasets["digits"].val
    with torch.no_grad():
        accuracy = float((model(images).argmax(1) == labels).double().mean())
    assert digits.evaluate(model, (images, labels), 50)["metric"] == pytest.approx(accuracy)

    charlm = get_task("charlm")
    model = charlm.make_model(0).eval()
    val = datasets["charlm"].val
    with torch.no_grad():
        logits = model(val["tokens"])
    loss = float(F.cross_entropy(logits.flatten(0, 1), val["labels"].flatten()))
    result = charlm.evaluate(model, val, 16)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["metric"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_mean_iou_from_a_hand_computed_confusion_matrix():
    confusion = torch.tensor([[5, 1, 0], [2, 3, 0], [0, 0, 0]])  # class 2 absent: left out
    expected = (5 / (5 + 1 + 2) + 3 / (3 + 2 + 1)) / 2
    assert mean_iou(confusion) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "norm", "items", "steps"),
    [
        ("digits", "batch", 64, 10),
        ("shapes", "batch", 8, 5),
        ("shapes", "group", 8, 5),
        ("charlm", "batch", 32, 10),
    ],
)
def test_a_few_optimizer_steps_reduce_the_training_loss(datasets, name, norm, items, steps):
    task = get_task(name)
    model = task.make_model(0, norm)
    batch = _take(datasets[name].train, items)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.default_lr)

    def loss_now():
        result = task.loss_fn(model, batch)
        if isinstance(result, LossSum):
            return result.value / result.count
        return result

    with torch.no_grad():
        start = float(loss_now())
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_now().backward()
        optimizer.step()
    with torch.no_grad():
        assert float(loss_now()) < 0.9 * start
