"""Code blocks users copy from docs/*.md: they run, and the figures printed next to them are real.

Each test pulls a block out of its page by a line it holds, runs it on a tiny float64 setup
(filling in only what the page elides: the model, the optimizer, the batch) and checks the
numbers written in its comments against the run and against a plain full-batch reference.
"""

from __future__ import annotations

import ast
import copy
import html
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum import Accumulator, LossSum

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_block(page: str, holding: str) -> str:
    """The ```python block of docs/`page` that holds the text `holding`."""
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    found = [block for block in blocks if holding in block]
    assert len(found) == 1, f"{page}: {len(found)} python blocks hold {holding!r}"
    return found[0]


class _RouterModel(nn.Module):
    """A tiny token model with a router: returns logits and a per-sequence auxiliary loss."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.router = nn.Linear(8, 2)
        self.head = nn.Linear(8, vocab)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.embed(ids))
        shares = self.router(hidden).softmax(-1).mean(1)  # each sequence's load per expert
        return self.head(hidden), 2 * shares.pow(2).sum(-1)  # 1 when balanced


def test_losses_md_two_term_example_runs_and_its_figures_are_that_run() -> None:
    """docs/losses.md's `LossSum.terms` block: the commented figures add up and are real.

    They once came from a run with another auxiliary weight (0.3) than the code shows (0.01),
    so `result.loss` was not `ce + 0.01 * aux` of the figures next to it.
    """
    block = python_block("losses.md", "router_loss_per_seq")
    code, _, shown = block.partition("result = acc.step(batch, loss_fn)")
    loss_shown = float(re.search(r"result\.loss\s+# ([0-9.]+)", shown).group(1))  # type: ignore[union-attr]
    terms_shown = ast.literal_eval(re.search(r"result\.terms\s+# (\{.*?\})", shown).group(1))  # type: ignore[union-attr]
    weight = float(re.search(r"weight=([0-9.]+)", code).group(1))  # type: ignore[union-attr]
    assert abs(loss_shown - (terms_shown["ce"] + weight * terms_shown["aux"])) < 1e-4

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as the figures' run: weights drawn in float64
    try:
        vocab = 11
        model = _RouterModel(vocab)
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, vocab, (10, 7))
        labels = ids.roll(-1, 1).clone()
        for row in range(10):
            labels[row, int(torch.randint(1, 7, ())) :] = -100  # ragged padding
    finally:
        torch.set_default_dtype(default)
    batch = {"input_ids": ids, "labels": labels}
    namespace: dict[str, Any] = {"F": nn.functional}
    exec(code, namespace)  # the documentation's own code
    acc = Accumulator(model, optimizer, micro_batch_size=3)
    result = acc.step(batch, namespace["loss_fn"])
    assert round(result.loss, 4) == loss_shown
    assert {name: round(mean, 4) for name, mean in result.terms.items()} == terms_shown

    logits, router = reference(ids)
    ce = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    objective = ce + weight * router.mean()
    assert abs(result.loss - objective.item()) <= 1e-10 * abs(objective.item())
    objective.backward()
    with torch.no_grad():
        for ours, param in zip(model.parameters(), reference.parameters(), strict=True):
            param -= 0.1 * param.grad
            assert torch.allclose(ours, param, rtol=1e-10, atol=0)


def test_every_test_the_docs_cite_exists() -> None:
    """README.md and docs/*.md prove claims by naming tests (`tests/x.py::test_y`): each exists.

    docs/reliability.md once cited two renamed tests, one of them for a claim ("compare stopped by
    SIGTERM leaves nothing behind") that the code no longer made: it keeps the finished configs.
    """
    root = DOCS.parent
    pages = [root / "README.md", *sorted(DOCS.glob("*.md"))]
    missing = []
    for page in pages:
        for match in re.finditer(r"(tests/[\w/]+\.py)(?:::(\w+))?", page.read_text("utf-8")):
            path, name = root / match.group(1), match.group(2)
            if not path.is_file():
                missing.append(f"{page.name}: {match.group(1)}")
            elif name and not re.search(
                rf"^\s*(?:async )?(?:def|class) {name}\b", path.read_text("utf-8"), re.M
            ):
                missing.append(f"{page.name}: {match.group(1)}::{name}")
    assert missing == []


def test_readme_lists_every_column_of_metrics_jsonl() -> None:
    """README.md lists the columns of `gradaccum train`'s metrics.jsonl; it once left out
    noise_scale, which every row has (null until the gradient noise scale is measured)."""
    from tests.cli._helpers import METRIC_COLUMNS

    readme = " ".join((DOCS.parent / "README.md").read_text("utf-8").split())
    listed = re.search(r"`metrics\.jsonl` \(one line per optimizer step: ([^)]*)\)", readme)
    assert listed is not None
    assert {column for column in METRIC_COLUMNS if column not in listed.group(1)} == set()


def test_architecture_md_names_every_module() -> None:
    """docs/architecture.md's module map ("what is built today") names every module and package
    of src/gradaccum; it once left out result.py, keras/ and five private modules."""
    source = DOCS.parent / "src" / "gradaccum"
    text = (DOCS / "architecture.md").read_text("utf-8")
    names = [p.name for p in source.glob("*.py") if p.name != "__init__.py"]
    names += [f"{p.name}/" for p in source.iterdir() if (p / "__init__.py").is_file()]
    assert [name for name in sorted(names) if not re.search(rf"(?<![\w/]){name}", text)] == []


def test_experiments_md_quotes_the_demo_figures_of_the_readme() -> None:
    """experiments.md quoted the demo's float64 gap as 8.2e-13 after the demo printed 4.9e-13.

    README's demo block is rerun by tests/test_readme_outputs.py, so it is the current output;
    the figures experiments.md repeats must be the ones it shows.
    """
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    experiments = (root / "docs/experiments.md").read_text(encoding="utf-8")
    exact = re.search(r"\(b\) matches \(a\) to float64 rounding: (\S+) < 1e-10", readme)
    naive = re.search(r"\(c\) ends (\S+) away from \(a\)", readme)
    assert exact, "README's demo block lost its verdict line"
    assert naive, "README's demo block lost its negative-control line"
    quoted = re.search(
        r"ends (\S+) away from the full-batch\s+run after 12 steps, against (\S+) for", experiments
    )
    assert quoted, "docs/experiments.md no longer quotes the demo's gaps"
    assert quoted.groups() == (naive.group(1), exact.group(1))


def _readme_block(holding: str) -> str:
    text = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    found = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if holding in b]
    assert len(found) == 1, f"README.md: {len(found)} python blocks hold {holding!r}"
    return found[0]


def _clip_setup() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(24, 6, dtype=torch.float64)
    return model, x, 10 * torch.randn(24, 3, dtype=torch.float64)  # large errors: the clip bites


def _clip_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _gap(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).detach().abs().max()) for p, q in pairs)


def _clipped_full_batch_step(base: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The reference: one backward over the whole batch, clip_grad_value_, one SGD step."""
    model = copy.deepcopy(base)
    _clip_loss(model, (x, y)).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.5)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return model


def test_readme_step_pre_hook_clips_by_value_the_full_batch_gradient() -> None:
    """README's step pre-hook recipe equals clipping the full-batch gradient by value, and its
    per-layer norms are the step's; negative control: the same clip applied in a backward hook
    (per micro-batch share) is not the full-batch step."""
    base, x, y = _clip_setup()
    reference = _clipped_full_batch_step(base, x, y)
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = Accumulator(model, optimizer, micro_batch_size=5)
    scope: dict[str, Any] = {
        "torch": torch, "model": model, "optimizer": optimizer, "acc": acc,
        "batch": (x, y), "loss_fn": _clip_loss,
    }  # fmt: skip
    exec(_readme_block("register_step_pre_hook"), scope)
    assert scope["result"].stepped
    assert _gap(model, reference) < 1e-12
    assert set(scope["layer_norms"]) == {name for name, _ in model.named_parameters()}
    grads = copy.deepcopy(base)
    _clip_loss(grads, (x, y)).backward()
    assert any(float(p.grad.abs().max()) > 0.5 for p in grads.parameters() if p.grad is not None)

    control = copy.deepcopy(base)  # clipping each micro-batch's share as it arrives
    for param in control.parameters():
        param.register_hook(lambda g: g.clamp(-0.5 * 5 / 24, 0.5 * 5 / 24))
    control_opt = torch.optim.SGD(control.parameters(), lr=0.5)
    with pytest.warns(UserWarning, match="not a fixed scaling"):  # tests/test_grad_hooks.py
        Accumulator(control, control_opt, micro_batch_size=5).step((x, y), _clip_loss)
    assert _gap(control, reference) > 1e-3


def test_readme_step_pre_hook_skips_skipped_windows_and_its_error_changes_nothing() -> None:
    base, x, y = _clip_setup()
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    acc = Accumulator(model, optimizer, micro_batch_size=5)
    calls: list[int] = []

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("logging backend down")

    optimizer.register_step_pre_hook(before_step)
    assert acc.step((torch.full_like(x, float("nan")), y), _clip_loss).skipped
    assert not calls
    assert acc.step((x, y), _clip_loss).stepped
    before = copy.deepcopy(model)
    momenta = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="logging backend down"):
        acc.step((x, y), _clip_loss)
    assert _gap(model, before) == 0.0
    assert all(p.grad is None for p in model.parameters())
    for param, momentum in zip(model.parameters(), momenta, strict=True):
        assert torch.equal(optimizer.state[param]["momentum_buffer"], momentum)
    assert acc.step((x, y), _clip_loss).stepped  # the run goes on
    assert len(calls) == 3


class _TinyLM(nn.Module):
    """Token ids (B, S) to logits (B, S, V): what README's 30-line block calls `model`."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_readme_api_in_30_lines_runs_as_written(tmp_path: Path, monkeypatch: Any) -> None:
    """README's "API in 30 lines", run top to bottom (only the Hugging Face line swapped for the
    same call with the block's own loss_fn, which needs no transformers model); its stage change
    used to leave `optimizer` the old one, so the next `save_checkpoint` was refused."""
    block = _readme_block("def loss_fn(model, batch):")
    hf_line = "result = acc.step(batch, hf.causal_lm)"
    assert hf_line in block
    block = block.replace(hf_line, "result = acc.step(batch, loss_fn)")
    torch.manual_seed(0)
    model = _TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, 20, (32, 12))
    labels = ids.masked_fill(torch.arange(12) >= 8, -100)  # padding is -100
    batch = {"input_ids": ids, "labels": labels}
    loader = [{k: v[i : i + 8] for k, v in batch.items()} for i in range(0, 32, 8)]
    scope: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10),
        "batch": batch,
        "loader": loader,
    }
    monkeypatch.chdir(tmp_path)  # the block writes ckpt.pt
    exec(compile(block, "README.md: The API in 30 lines", "exec"), scope)
    assert (tmp_path / "ckpt.pt").is_file()
    assert scope["acc"].micro_batch_size == "auto"


@pytest.mark.parametrize(
    ("partial_window", "windows"),
    [
        ("step", lambda n, k, e: e * -(-n // k)),
        ("drop", lambda n, k, e: e * (n // k)),
        ("carry", lambda n, k, e: -(-e * n // k)),
    ],
)
def test_readme_schedule_sizes_count_the_windows(partial_window: str, windows: Any) -> None:
    """README: a `OneCycleLR` sized by the windows each `partial_window` makes (10 micro-batches
    per epoch, windows of 4, 3 epochs) ends exactly at its `total_steps`, its final rate."""
    loader, steps, epochs = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(10)], 4, 3
    total = windows(len(loader), steps, epochs)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=total)
    acc = Accumulator(model, optimizer, accumulation_steps=steps, scheduler=schedule)
    mse = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    for _ in range(epochs):
        for micro_batch in loader:
            acc.micro_step(micro_batch, mse)
        acc.flush(partial_window)
    if partial_window == "carry":
        acc.flush("step")  # the run's last window
    assert schedule.last_epoch == total
    acc.micro_step(loader[0], mse)
    with pytest.raises(ValueError, match="Tried to step"):  # one window more: past its end
        acc.flush("step")


def _as_pattern(example: str) -> re.Pattern[str]:
    """A sizing message quoted in the docs as a pattern: its numbers and `...` stand for any."""
    parts = re.split(r"(\.\.\.|\d+(?:\.\d+)?)", example)
    return re.compile(
        "".join(
            ".*" if part == "..." else r"\d+(?:\.\d+)?" if part[:1].isdigit() else re.escape(part)
            for part in parts
        )
    )


def test_memory_md_auto_block_quotes_the_sizing_messages_a_run_prints() -> None:
    """docs/memory.md's `"auto"` block and its "Seen" list quote `StepResult.sizing` in the order a
    run prints them. Both once skipped the first window's warm-up message: the block's comment
    put the timed choice on the first call's result, which says `warm-up before timing`."""
    text = (DOCS / "memory.md").read_text(encoding="utf-8")
    block = python_block("memory.md", 'micro_batch_size="auto", memory_budget="2GiB"')
    commented = re.findall(r"'(auto [^']*)'", block)
    seen = " ".join(text.split("*Seen.*", 1)[1].split("A window that ran out", 1)[0].split())
    listed = re.findall(r"`(auto [^`]*)`", seen)
    assert commented, block
    assert len(listed) >= 3, listed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    batch = (torch.randn(64, 6, dtype=torch.float64), torch.randn(64, 3, dtype=torch.float64))
    scope: dict[str, Any] = {
        "Accumulator": Accumulator, "model": model, "batch": batch, "loss_fn": _clip_loss,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
    }  # fmt: skip
    exec(compile(block, "docs/memory.md: auto", "exec"), scope)
    first = scope["result"].sizing
    acc = scope["acc"]
    later = [acc.step(batch, _clip_loss).sizing for _ in range(9)]
    assert _as_pattern(commented[0]).fullmatch(first), (commented[0], first)
    assert _as_pattern(listed[0]).fullmatch(first), (listed[0], first)
    assert _as_pattern(listed[1]).fullmatch(later[0]), (listed[1], later[0])
    decided = [_as_pattern(example) for example in (*commented[1:], *listed[2:])]
    assert any(pattern.fullmatch(later[-1]) for pattern in decided), later[-1]


def _reliability_table(heading: str) -> dict[str, str]:
    """docs/reliability.md's table under `heading`: input cell -> message cell."""
    text = (DOCS / "reliability.md").read_text(encoding="utf-8")
    rows: dict[str, str] = {}
    for line in text.split(heading, 1)[1].split("\n###", 1)[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and cells[0] not in ("input", "---"):
            rows[cells[0]] = html.unescape(cells[1])
    return rows


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _build(**settings: Any) -> Accumulator:
    model = _mlp()
    return Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings)


def _load(saved: dict[str, Any], settings: dict[str, Any]) -> None:
    _build(**settings).load_state_dict(_build(**saved).state_dict())


def _step(batch: Any, loss_fn: Any = _mse) -> None:
    _build(micro_batch_size=2).step(batch, loss_fn)


_PAIR = (torch.randn(4, 3), torch.randn(4, 1))


def _other_terms_later() -> None:
    acc = _build(accumulation_steps=3)
    acc.micro_step(_PAIR, lambda m, b: LossSum.terms(ce=(4 * _mse(m, b), 4)))
    acc.micro_step(_PAIR, lambda m, b: LossSum.terms(other=(4 * _mse(m, b), 4)))


_RAISED_AS_TABLED = {
    "### `Accumulator(model, optimizer, ...)`": {
        "`micro_batch_size=0`": lambda: _build(micro_batch_size=0),
        '`micro_batch_size="8"`': lambda: _build(micro_batch_size="8"),
        '`micro_batch_size="auto"` on CPU without `memory_budget`': lambda: _build(
            micro_batch_size="auto"
        ),
        '`micro_batch_size=8, memory_budget="1GiB"`': lambda: _build(
            micro_batch_size=8, memory_budget="1GiB"
        ),
        "`accumulation_steps=0`": lambda: _build(accumulation_steps=0),
        '`precision="fp8"`': lambda: _build(micro_batch_size=2, precision="fp8"),
        "`batch_dim=-1`": lambda: _build(micro_batch_size=2, batch_dim=-1),
        "`step()` without `micro_batch_size`": lambda: _build(accumulation_steps=2).step(
            _PAIR, _mse
        ),
    },
    "### Accumulator state (`acc.load_state_dict`)": {
        "other `accumulation_steps`": lambda: _load(
            {"accumulation_steps": 3}, {"accumulation_steps": 4}
        ),
        "other `batch_dim`": lambda: _load(
            {"micro_batch_size": 2}, {"micro_batch_size": 2, "batch_dim": 1}
        ),
    },
    "### Batches and losses": {
        "an empty batch": lambda: _step((torch.randn(0, 3), torch.randn(0, 1))),
        "`LossSum(value, 2.5)`": lambda: _step(_PAIR, lambda m, b: LossSum(_mse(m, b), 2.5)),
        "a detached loss": lambda: _step(_PAIR, lambda m, b: _mse(m, b).detach()),
        "the model, a torch criterion (`nn.CrossEntropyLoss()`) or a string as `loss_fn`": (
            lambda: _step(_PAIR, nn.CrossEntropyLoss())
        ),
        "a later micro-batch returning other terms": lambda: _other_terms_later(),
    },
}


@pytest.mark.parametrize(
    ("heading", "row"), [(h, row) for h, rows in _RAISED_AS_TABLED.items() for row in rows]
)
def test_reliability_md_error_tables_quote_the_messages_raised_now(heading: str, row: str) -> None:
    """docs/reliability.md's tables of refused inputs give each exception's message; rows run
    here raise it verbatim (a cell may add a note in parentheses after it). Six of them had
    drifted (and the checkpoint table's twin of the state row): `'largest'` missing from two, the
    state mismatch's `acc.accumulation_steps` fix, `LossSum(value, 2.5)`'s weighted-mean recipe,
    the detached loss's activation-checkpointing note and other terms' count-0 recipe."""
    tabled = _reliability_table(heading)[row]
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the table names the type
        _RAISED_AS_TABLED[heading][row]()
    message = f"{type(raised.value).__name__}: {raised.value}"
    assert message == tabled or tabled.startswith(f"{message} ("), (message, tabled)
