"""gradaccum.keras against plain Keras full-batch steps, on the TensorFlow and JAX backends.

The Keras backend is fixed when keras is first imported, so the checks run in subprocesses
(`keras_checks.py`), in a few shards per backend (`SHARDS`), each run once when a test first
asks for one of its checks, by whichever pytest-xdist worker asks first (`Shards`); each test
below reads its check's result (TensorFlow's checks also run examples/keras_digits.py).
Weights are float64, and `gap` is the largest relative
difference of a weight tensor from the plain full-batch run.

Tolerances: TensorFlow computes float64 throughout (1e-12). On JAX and torch, Keras 3.15's
`keras.ops.mean` computes float64 tensors in float32 (its `result_type(float64, float32)` is
float32 there), and losses use it: those backends match to float32 rounding (1e-6 on JAX, where
cross-entropy stays exact to 1e-15; 1e-5 on torch, where it does not).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock, Timeout

HERE = Path(__file__).resolve().parent
# Tiny models on a 2-core machine shared by several processes: one thread per process is fastest.
SINGLE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}
BACKENDS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}  # backend -> its module
TOLERANCE = {"tensorflow": 1e-12, "jax": 1e-6, "torch": 1e-5}
CAUGHT = 1e-2  # a negative control must end at least this far from the full-batch run
# Shards per backend: each one subprocess of about 25-35 s on one idle core (TensorFlow and JAX
# take about 190 s for all the checks, torch about 20 s), so no test waits long for its result.
SHARDS = {"tensorflow": 8, "jax": 8, "torch": 1}

# A test waits for its check's shard, and at worst for one other shard run meanwhile.
pytestmark = pytest.mark.timeout(600)

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed (pip install 'gradaccum[keras]')", allow_module_level=True)


def _available(backend: str) -> bool:
    return importlib.util.find_spec(BACKENDS[backend]) is not None


def _check_names() -> list[str]:
    """The checks of keras_checks.py, in its order (each is a function decorated `@check`)."""
    text = (HERE / "keras_checks.py").read_text()
    return re.findall(r"^@check\ndef (\w+)\(", text, re.MULTILINE)


def _shards(names: list[str], count: int) -> list[list[str]]:
    """`names` dealt round-robin into `count` shards: the slow checks (added loss terms,
    BatchNorm, the example, near the end of the file) spread over all of them."""
    return [names[i::count] for i in range(count)]


class Shards:
    """The checks' results, each shard run once per CI run, whichever worker asks first.

    pytest-xdist's workers each set up session fixtures, and `worksteal` hands a test of any
    shard to either worker, so the shards' results live in the run's shared temporary directory:
    a worker asking for a check runs its shard (holding that shard's lock) unless the other has;
    while the other worker runs it, it runs one shard nobody has started instead of idling. A lock
    is a file lock, freed if its worker dies; then the shard runs again.
    """

    def __init__(self, shared: Path) -> None:
        self.shared = shared
        names = _check_names()
        self.shard_of: dict[tuple[str, str], str] = {}
        self.shards: dict[str, tuple[str, list[str]]] = {}  # shard id -> (backend, names)
        for backend in BACKENDS:
            if not _available(backend):
                continue
            for i, part in enumerate(_shards(names, SHARDS[backend])):
                shard = f"{backend}-{i}"
                self.shards[shard] = (backend, part)
                self.shard_of.update({(backend, name): shard for name in part})
        self.read: dict[str, dict[str, Any]] = {}

    def __contains__(self, backend: str) -> bool:
        return any(b == backend for b, _ in self.shards.values())

    def get(self, backend: str, name: str) -> dict[str, Any]:
        """`{check: result, "_stderr": ...}` of the shard holding `name` on `backend`."""
        shard = self.shard_of.get((backend, name))
        assert shard is not None, f"{name} is not a check of keras_checks.py (@check def {name})"
        if not (self._load(shard) or self._run(shard, wait=False)):
            idle = [s for s in self.shards if s != shard and not self._done(s)]
            any(self._run(s, wait=False) for s in idle)  # at most one, while the other runs it
            self._run(shard, wait=True)  # then wait for it (or run it, if its worker died)
        return self.read[shard]

    def _file(self, shard: str) -> Path:
        return self.shared / f"keras-checks-{shard}.json"

    def _done(self, shard: str) -> bool:
        return self._file(shard).exists()

    def _load(self, shard: str) -> bool:
        if self._done(shard):
            self.read[shard] = json.loads(self._file(shard).read_text())
        return shard in self.read

    def _run(self, shard: str, *, wait: bool) -> bool:
        """Run `shard` unless another worker runs it (`wait`: wait for it); True if it is read."""
        lock = FileLock(str(self._file(shard)) + ".lock")
        try:
            lock.acquire(timeout=-1 if wait else 0)
        except Timeout:
            return False
        try:
            if not self._load(shard):  # not done by the other worker meanwhile
                results = _run_checks(*self.shards[shard])
                self._file(shard).write_text(json.dumps(results))
                self.read[shard] = results
        finally:
            lock.release()
        return True


def _run_checks(backend: str, names: list[str]) -> dict[str, Any]:
    """Run `names` in one keras_checks.py subprocess on `backend`: {check: result, "_stderr"}."""
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_ENABLE_X64="1", TF_CPP_MIN_LOG_LEVEL="3")
    env.update(SINGLE_THREAD)
    command = [sys.executable, str(HERE / "keras_checks.py"), *names]
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)
    except subprocess.TimeoutExpired as error:  # every check of the shard fails with this
        return {"_stderr": f"timed out after 500 s: {names}\n{str(error.stderr)[-3000:]}"}
    out = proc.stdout.splitlines()
    lines = [json.loads(line[7:]) for line in out if line.startswith("RESULT ")]
    results: dict[str, Any] = {r["name"]: r for r in lines}
    results["_stderr"] = f"(exit code {proc.returncode})\n{proc.stderr[-3000:]}"
    return results


@pytest.fixture(scope="session")
def keras_results(tmp_path_factory):
    """Every check's result, read lazily: see `Shards`."""
    base = tmp_path_factory.getbasetemp()  # under xdist, a worker's own; its parent is the run's
    return Shards(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    if not _available(request.param):
        pytest.skip(f"{request.param} is not installed")
    return request.param


def result(keras_results, backend, name):
    shard = keras_results.get(backend, name)
    found = shard.get(name)
    assert found is not None, f"{backend}: check {name} did not report\n{shard['_stderr']}"
    assert found["error"] is None, f"{backend}: {name} raised\n{found['error']}"
    return found


def assert_exact(found, backend, steps):
    assert found["gap"] < TOLERANCE[backend], found
    assert found["state"]["steps"] == steps, found
    assert found["state"]["skipped"] == 0, found


# --- exactness against one plain full-batch step per window ----------------------------------


def test_adam_with_a_schedule_on_ragged_micro_batches(keras_results, backend):
    assert_exact(result(keras_results, backend, "adam_schedule_ragged"), backend, steps=4)


def test_global_clipping_sees_the_window_gradient(keras_results, backend):
    found = result(keras_results, backend, "clipping")
    assert_exact(found, backend, steps=4)
    assert found["clip_changes_result"] > CAUGHT, "the clip did not bind: the check proves nothing"


def test_a_static_loss_scale_is_divided_out(keras_results, backend):
    assert_exact(result(keras_results, backend, "static_loss_scale"), backend, steps=4)


def test_nadam_state_outside_its_slots_is_stepped(keras_results, backend):
    found = result(keras_results, backend, "nadam_state_outside_its_slots")
    assert found["tracked"], "Nadam's u_product must be one of the optimizer's variables"
    assert_exact(found, backend, steps=4)


def test_ema_updates_once_per_window(keras_results, backend):
    assert_exact(result(keras_results, backend, "ema"), backend, steps=4)


def test_weight_regularizer_counts_once_per_window(keras_results, backend):
    assert_exact(result(keras_results, backend, "weight_regularizer"), backend, steps=4)


def test_masked_token_loss_divides_by_the_window_tokens(keras_results, backend):
    assert_exact(result(keras_results, backend, "masked_token_loss"), backend, steps=4)


def test_a_custom_count_function_replaces_the_default(keras_results, backend):
    found = result(keras_results, backend, "custom_count")
    assert found["gap"] < TOLERANCE[backend], "counting tokens by hand reproduces the default"
    assert found["gap_rows"] > CAUGHT, "counting rows instead must change the result"


def test_a_count_function_must_return_one_number(keras_results, backend):
    messages = result(keras_results, backend, "count_function_must_return_one_number")["messages"]
    assert "ValueError: count(x, y, y_pred, sample_weight) has shape (4,)" in (
        messages["vector"] or ""
    ), messages
    assert "keras.ops.sum" in messages["vector"], messages
    assert "TypeError: count(x, y, y_pred, sample_weight)='4'" in (messages["string"] or ""), (
        messages
    )
    assert all(v for k, v in messages.items() if k.endswith("_unchanged")), messages


def test_sample_weights_with_mean_with_sample_weight(keras_results, backend):
    assert_exact(result(keras_results, backend, "sample_weight_token_mean"), backend, steps=2)


@pytest.mark.parametrize(("policy", "steps"), [("step", 6), ("drop", 4)])
def test_epoch_end_leftover_policy(keras_results, backend, policy, steps):
    assert_exact(result(keras_results, backend, f"leftover_{policy}"), backend, steps=steps)


def test_epoch_end_leftover_carry_then_flush(keras_results, backend):
    found = result(keras_results, backend, "leftover_carry")
    assert_exact(found, backend, steps=7)
    assert found["state"]["pending"] == found["pending_ref"] == 2
    assert found["warned"], "an open window at the end of fit() must be warned about"
    assert found["flushed"], found
    assert found["gap_after_flush"] < TOLERANCE[backend], found


def test_epoch_end_leftover_of_a_dataset_of_unknown_length(keras_results, backend):
    assert_exact(result(keras_results, backend, "leftover_unknown_length"), backend, steps=3)


def test_carry_over_epochs_of_unknown_length_counts_only_real_micro_batches(keras_results, backend):
    found = result(keras_results, backend, "carry_over_epochs_of_unknown_length")
    if found.get("skipped"):
        pytest.skip(found["skipped"])
    assert_exact(found, backend, steps=7)
    assert found["state"]["pending"] == found["pending_ref"] == 2
    assert found["full_windows_state"] == {"steps": 4, "skipped": 0, "pending": 0}, found


def test_stop_training_mid_epoch_settles_the_open_window(keras_results, backend):
    found = result(keras_results, backend, "stop_training_mid_epoch_settles_the_open_window")
    assert found["state_after_stop"] == {"steps": 2, "skipped": 0, "pending": 0}, found
    assert_exact(found, backend, steps=5)  # 1 + the leftover, then 3 in the next fit
    assert found["val_gap"] < TOLERANCE[backend], "validation must see the leftover's step"
    assert found["gap_without_leftover"] > CAUGHT, found


def test_train_on_batch_steps_once_per_window_before_and_after_fit(keras_results, backend):
    found = result(keras_results, backend, "train_on_batch_windows")
    assert_exact(found, backend, steps=8)  # 2 windows, a fit's 3, then 3
    assert found["state"]["pending"] == 0, found
    assert found["gap_per_micro_batch"] > CAUGHT, found


def test_a_subclassed_model_unbuilt_before_fit(keras_results, backend):
    found = result(keras_results, backend, "subclassed_model_built_by_its_first_step")
    assert_exact(found, backend, steps=4)  # 2 epochs of 2 windows; each leftover dropped


@pytest.mark.parametrize("form", ["one", "list_object"])
def test_fit_takes_callbacks_in_any_form_keras_takes(keras_results, backend, form):
    found = result(keras_results, backend, "callbacks_in_any_form")[form]
    assert_exact(found, backend, steps=3)
    assert found["ran"] == [0], "the user's callback must run too"


def test_window_state_is_readable_from_a_callback_during_fit(keras_results, backend):
    found = result(keras_results, backend, "window_state_during_fit")
    assert found["pending"] == [1, 0, 1, 0, 0], found  # the epoch's last window steps on 1
    assert found["state"] == {"steps": 3, "skipped": 0, "pending": 0}, found


def test_backup_and_restore_resumes_exactly_with_the_optimizer_state(keras_results, backend):
    found = result(keras_results, backend, "backup_and_restore_resumes_exactly")
    assert_exact(found, backend, steps=4)  # the resumed run's own: 2 windows in epochs 3 and 4
    assert found["plain_iterations"] == 4, found  # 2 epochs of 2 windows, read by a plain model
    assert found["gap_weights_only"] > CAUGHT, found


def test_a_keras_file_resumes_exactly_with_the_optimizer_state(keras_results, backend):
    found = result(keras_results, backend, "keras_file_resumes_exactly")
    assert found["compiled"], "load_model must return a compiled model, as for a plain model"
    assert found["iterations"] == 4, found  # 2 epochs of 2 windows
    assert_exact(found, backend, steps=4)  # the resumed run's own: epochs 3 and 4
    assert found["gap_fresh_optimizer"] > CAUGHT, found
    assert found["fp16_skipped_loading"] == [], "mixed_float16: the LossScaleOptimizer must load"
    assert found["fp16_iterations"] == 4, found
    assert found["fp16_gap"] == 0.0, found  # the same float16 steps as the uninterrupted run


def test_backup_and_restore_of_epochs_of_unknown_length(keras_results, backend):
    found = result(keras_results, backend, "backup_and_restore_of_unknown_length")
    if found.get("skipped"):
        pytest.skip(found["skipped"])
    assert_exact(found, backend, steps=6)  # epochs 3 and 4: windows of 4, 4 and 2
    assert not found["warned_open_window"], "the epoch's leftover must be settled before saving"


def test_multi_output_dict_of_losses_is_exact(keras_results, backend):
    assert_exact(result(keras_results, backend, "multi_output_dict_of_losses"), backend, steps=4)


def test_multi_output_losses_that_count_differently_are_refused(keras_results, backend):
    found = result(keras_results, backend, "multi_output_counts_that_differ_are_refused")
    message = found["message"] or ""
    assert "count different items" in message, found
    assert "seq" in message, found
    assert "count=" in message, found
    assert found["unchanged"], found
    assert found["unmasked_state"] == {"steps": 2, "skipped": 0, "pending": 0}, found


def test_ignore_class_next_to_another_loss_is_refused(keras_results, backend):
    found = result(keras_results, backend, "ignore_class_next_to_another_loss_is_refused")
    messages = found["messages"]
    for label in ("dict", "list", "function"):
        assert "count different items" in (messages[label] or ""), messages
        assert "ignore_class" in messages[label], messages
        assert "count=" in messages[label], messages
    assert "'seq'" in messages["dict"], messages
    assert "'loss[1]'" in messages["list"], messages
    assert all(found["unchanged"].values()), found
    assert_exact(found, backend, steps=2)  # one ignore_class loss alone: exact
    assert found["gap_one_count"] > CAUGHT, "one count for both heads must be caught"


def test_steps_per_execution_and_jit_compile(keras_results, backend):
    found = result(keras_results, backend, "steps_per_execution_and_jit")
    if found.get("skipped"):
        pytest.skip(found["skipped"])
    assert_exact(found, backend, steps=4)


def test_hand_written_loop_with_gradient_window(keras_results, backend):
    found = result(keras_results, backend, "hand_written_loop")
    assert found["gap"] < TOLERANCE[backend], found
    assert found["stepped"] == 2


def test_a_loss_function_returning_the_batch_mean_counts_rows(keras_results, backend):
    found = result(keras_results, backend, "scalar_loss_function_on_ragged_micro_batches")
    assert_exact(found, backend, steps=4)  # micro-batches of 5 and 3 rows, 2 epochs
    assert found["gap_one_per_micro_batch"] > CAUGHT, "a mean of micro-batch means must be caught"
    assert found["loss_sum_count"] == 5.0, found  # the rows of the first micro-batch
    assert found["loss_sum_gap"] < TOLERANCE[backend], found


def test_loss_sum_reproduces_every_mean_reduction(keras_results, backend):
    assert result(keras_results, backend, "loss_sum_matches_keras")["gap"] < TOLERANCE[backend]


# --- negative controls: they must NOT match -----------------------------------------------------


def test_keras_builtin_gradient_accumulation_is_not_exact(keras_results, backend):
    found = result(keras_results, backend, "builtin_gradient_accumulation_fails")
    assert found["gap"] > CAUGHT, found


def test_the_seed_loop_is_not_exact(keras_results, backend):
    found = result(keras_results, backend, "seed_loop_fails")
    assert found["gap"] > CAUGHT, found


# --- precision, limits, bad input ---------------------------------------------------------------


def test_fp16_overflow_skips_the_whole_window(keras_results, backend):
    found = result(keras_results, backend, "fp16_overflow_skips_the_window")
    assert found["state"] == {"steps": 2, "skipped": 1, "pending": 0}, found
    assert found["inner_iterations"] == 2
    assert found["scale"] == 2.0**14, "the loss scale halves exactly once per bad window"
    assert found["gap_vs_clean_run"] == 0.0, "the run equals one without the bad window"
    assert found["gap_vs_full_batch"] < 1e-3, found  # float16 activations: fp16 rounding


def test_bf16_adds_only_float32_rounding(keras_results, backend):
    found = result(keras_results, backend, "bf16_adds_only_float32_rounding")
    assert found["state"] == {"steps": 2, "skipped": 0, "pending": 0}, found
    assert found["gap_one_micro_batch"] < 1e-5, "one micro-batch per window: float32 rounding only"
    assert found["gap_vs_plain_bf16"] < 2e-2, found  # each micro-batch's bf16 gradient rounding
    assert found["to_float32"] <= 1.1 * found["plain_to_float32"], found


def test_batchnorm_is_warned_about_and_is_not_exact(keras_results, backend):
    found = result(keras_results, backend, "batchnorm_warns")
    assert found["warned"] == 1
    assert found["file"].endswith("keras_checks.py"), "the warning points at the caller"
    assert found["gap"] > CAUGHT, "BatchNorm is not additive: the gap is real, hence the warning"


def test_bad_input_names_the_fix_and_changes_nothing(keras_results, backend):
    found = result(keras_results, backend, "bad_input_is_refused")
    messages = found["messages"]
    assert all(messages.values()), messages
    assert "positive int" in messages["steps=0"]
    assert "positive int" in messages["steps=True"]
    assert "got int64: pass steps=3" in messages["steps=np.int64(3)"], messages
    assert "'step', 'drop', 'carry'" in messages["policy"]
    assert "remove it" in messages["builtin"]
    assert "sum_over_batch_size" in messages["sum"]
    assert "remove it" in messages["builtin_in_loss_scale"]
    assert found["compiled"] is False, "a refused compile leaves the model uncompiled"
    for label in ("batch_size=0", "batch_size=-1", "batch_size='4'"):
        assert "must be a positive int" in messages[label], messages
    assert found["fit_unchanged"], "a refused fit must not train"
    assert found["fit_state"] == {"steps": 0, "skipped": 0, "pending": 0}, found


def test_frozen_batchnorm_is_exact_and_not_warned(keras_results, backend):
    found = result(keras_results, backend, "frozen_batchnorm_is_exact_and_not_warned")
    assert found["frozen_warned"] == 0, "a frozen BatchNormalization is exact: no warning"
    assert_exact(found, backend, steps=4)
    assert len(found["unfrozen"]) == 1, found  # unfrozen after wrapping: warned at compile()
    assert "batch_normalization" in found["unfrozen"][0], found


def test_batchnorm_called_in_inference_mode_is_exact_and_not_warned(keras_results, backend):
    found = result(
        keras_results, backend, "batchnorm_called_in_inference_mode_is_exact_and_not_warned"
    )
    assert found["inference"]["warned"] == 0, "base(x, training=False): exact, no warning"
    assert_exact(found["inference"], backend, steps=2)
    assert found["training"]["warned"] == 1, found  # the same model in training mode is warned
    assert found["training"]["gap"] > CAUGHT, found
    # Keras 3 overrides training=False in a functional graph: plain fit trains the layer too.
    assert found["functional"]["plain_fit_moves_statistics"], found
    assert found["functional"]["warned"] == 1, found


def test_a_batch_dice_is_warned_about_and_a_per_sample_dice_is_exact(keras_results, backend):
    found = result(keras_results, backend, "batch_dice_warns")
    assert len(found["batch"]["warned"]) == 1, found
    assert "axis=" in found["batch"]["warned"][0], found
    assert found["batch"]["gap"] > 1e-3, "the batch Dice is not additive: the warning is due"
    assert found["per_sample"]["warned"] == [], found
    assert_exact(found["per_sample"], backend, steps=2)


def test_an_activity_regularizer_is_exact_over_rows_and_refused_beside_other_counts(
    keras_results, backend
):
    found = result(keras_results, backend, "activity_regularizer_counts")
    assert_exact(found, backend, steps=4)  # per-row loss, ragged micro-batches, 2 epochs
    for label in ("masked", "weights"):
        message = found["messages"][label] or ""
        assert "have an activity_regularizer" in message, found["messages"]
        assert "subclass of AccumulatingModel" in message, message
        assert "count=" in message, message
    assert "masked output" in found["messages"]["masked"], found["messages"]
    assert "mean_with_sample_weight" in found["messages"]["weights"], found["messages"]
    assert all(found["unchanged"].values()), found
    assert found["gap_token_count"] > CAUGHT, "weighing the penalty by tokens must be caught"


def test_add_loss_terms_are_exact_or_refused(keras_results, backend):
    found = result(keras_results, backend, "add_loss_terms")
    for kind in ("row_mean", "const", "token_const"):  # a mean over rows, a weight penalty
        assert_exact(found[kind], backend, steps=2)
    summed = found["messages"]["row_sum"] or ""
    assert "sum over rows" in summed, found["messages"]
    assert "ops.mean" in summed, summed
    token = found["messages"]["token_row_mean"] or ""
    for part in ("add_loss", "masked output", "count="):
        assert part in token, token
    assert all(found["unchanged"].values()), found
    assert found["gap_row_sum"] > CAUGHT, "a summed add_loss term weighed like a mean is caught"


def test_subclassed_and_unreadable_add_loss_terms_are_read_on_the_first_batch(
    keras_results, backend
):
    found = result(keras_results, backend, "subclassed_and_unreadable_add_loss_terms")
    for kind in ("vae_mean", "conv_mean"):  # a subclassed VAE's KL; a conv unfit for tiny rows
        assert_exact(found[kind], backend, steps=2)
    for label, message in found["messages"].items():  # arrays, PyDataset, generator, tf.data...
        assert "sum over rows" in (message or ""), (label, found["messages"])
        assert "ops.mean" in message, message
    # A generator cannot be peeked: its first batch is gone, and the message says so.
    assert "pass a new generator" in found["messages"]["generator"], found["messages"]
    assert all(found["unchanged"].values()), found
    assert found["gap_vae_sum"] > CAUGHT, "a subclassed model's summed KL weighed like a mean"


def test_an_add_loss_term_added_only_in_training_is_read_in_training_mode(keras_results, backend):
    found = result(keras_results, backend, "add_loss_only_in_training")
    assert_exact(found, backend, steps=2)  # a mean over rows, added only when training
    for label in ("functional", "subclassed", "generator"):  # compile, and the first batch
        assert "sum over rows" in (found["messages"][label] or ""), found["messages"]
    assert "pass a new generator" in found["messages"]["generator"], found["messages"]
    assert all(found["unchanged"].values()), found
    assert found["gap_sum"] > CAUGHT, "a training-only summed term weighed like a mean is caught"


def test_class_weight_is_exact(keras_results, backend):
    found = result(keras_results, backend, "class_weight_is_exact")
    for reduction in ("sum_over_batch_size", "mean_with_sample_weight"):
        assert_exact(found[reduction], backend, steps=2)
        assert found[reduction]["gap_without_class_weight"] > CAUGHT, "the weights must matter"


def test_loss_sum_warns_about_a_batch_dice_in_a_hand_written_loop(keras_results, backend):
    found = result(keras_results, backend, "loss_sum_warns_about_a_batch_dice")
    assert found["batch"]["warned"] >= 1, found
    assert found["batch"]["file"].endswith("keras_checks.py"), "the warning points at the caller"
    assert found["batch"]["gap"] > 1e-2, "the batch Dice is not additive: the warning is due"
    assert found["per_sample"]["warned"] == 0, found
    assert found["per_sample"]["gap"] < TOLERANCE[backend], found


def test_gradient_window_refuses_mismatched_gradients_and_counts(keras_results, backend):
    found = result(keras_results, backend, "gradient_window_refuses_mismatched_input")
    messages = found["messages"]
    assert "ValueError: gradient 0 has shape (3,)" in (messages["swapped"] or ""), messages
    assert "in the order of the variables" in messages["swapped"], messages
    for label in ("count_str", "count_none"):
        assert (messages[label] or "").startswith("TypeError: count="), messages
    assert "must be one number" in (messages["count_vector"] or ""), messages
    assert found["mean"] == [[[0.5] * 3] * 3, [0.5] * 3], (
        "a refused add leaves the window as it was"
    )


def test_a_models_own_compute_loss_or_train_step_is_refused_not_ignored(keras_results, backend):
    found = result(keras_results, backend, "overridden_steps_are_refused")
    messages = found["messages"]
    for name in ("compute_loss", "train_step"):
        assert f".{name} would be ignored" in (messages[name] or ""), messages
        assert "Subclass AccumulatingModel" in messages[name], messages
        assert messages[f"{name}_unchanged"], messages
    assert_exact(found, backend, steps=2)  # the fix: the extra term in the wrapper's compute_loss
    assert found["gap_compiled_loss_only"] > CAUGHT, "ignoring the model's loss must be caught"


# --- the example ----------------------------------------------------------------------------------


def test_the_digits_example_catches_the_seed_loop_and_matches_with_the_fix(keras_results):
    if "tensorflow" not in keras_results:
        pytest.skip("examples/keras_digits.py is a TensorFlow loop")
    found = result(keras_results, "tensorflow", "digits_example")
    if found.get("skipped"):
        pytest.skip(found["skipped"])
    gaps = dict(re.findall(r"^\((\w)\) .*?\s(\d\.\de[-+]\d\d)\s", found["stdout"], re.MULTILINE))
    assert set(gaps) == {"b", "c", "d"}, found["stdout"]
    assert float(gaps["b"]) > CAUGHT, "the seed's loop must end far from the full batch"
    assert float(gaps["c"]) < 1e-12, "the fixed loop matches the full batch"
    assert float(gaps["d"]) < 1e-12, "fit + accumulate matches the full batch"
