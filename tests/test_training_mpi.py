"""Data-parallel training under a real ``mpirun``: consistency across ranks, equivalence
with single-rank training, compression, both backends, and errors that end every rank.

Each launch trains a tiny MLP for a few steps (tests/mpi/train_tiny.py) and saves every
rank's parameters; launches are cached per configuration and shared between tests.
"""
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mpi_harness import ROOT, hpctrain, mpirun, needs_horovod

pytestmark = pytest.mark.mpi

TINY = "tests/mpi/train_tiny.py"
ERRORS = "tests/mpi/train_errors.py"

_runs = {}
_scratch = tempfile.mkdtemp(prefix="hpctrain-train-mpi-")


def train(n, backend, compression="none", batch=8, accumulation=1, stop_at=None, predivide=1.0):
    """Launch train_tiny.py on ``n`` ranks (cached); return (per-rank arrays, result, output)."""
    key = (n, backend, compression, batch, accumulation, stop_at, predivide)
    if key not in _runs:
        out = Path(_scratch) / f"run{len(_runs)}"
        out.mkdir()
        extra = ["--stop-at", str(stop_at)] if stop_at is not None else []
        overrides = [f"comm.backend={backend}", f"comm.compression={compression}",
                     f"train.batch_size={batch}", f"train.accumulation={accumulation}",
                     f"comm.gradient_predivide_factor={predivide}"]
        result = mpirun(n, [TINY, out, *extra, *overrides], timeout=150)
        assert result.returncode == (3 if stop_at is not None else 0), result.output[-4000:]
        ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(n)]
        _runs[key] = (ranks, json.loads((out / "result.json").read_text()), result.output)
    return _runs[key]


def params(rank_arrays):
    return [v for k, v in sorted(rank_arrays.items(), key=lambda kv: kv[0]) if k.startswith("p")]


def max_diff(a, b):
    return max(float(np.abs(x.astype(np.float64) - y).max()) for x, y in zip(params(a), params(b)))


BACKENDS = [pytest.param("horovod", marks=needs_horovod), "mpi"]


@pytest.mark.parametrize("backend, n, compression", [
    pytest.param("horovod", 2, "none", marks=[needs_horovod, pytest.mark.smoke]),
    pytest.param("horovod", 2, "fp16", marks=needs_horovod),
    pytest.param("mpi", 2, "none", marks=pytest.mark.smoke),
    ("mpi", 4, "fp16"),
])
def test_every_rank_ends_with_bitwise_identical_parameters(backend, n, compression):
    ranks, result, _ = train(n, backend, compression)
    assert result["steps"] == 12
    for other in ranks[1:]:
        for a, b in zip(params(ranks[0]), params(other)):
            assert a.tobytes() == b.tobytes()
    # Identical although each rank saw different samples (its local losses differ).
    assert not np.array_equal(ranks[0]["losses"], ranks[1]["losses"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_match_one_rank_with_twice_the_batch(backend):
    two, _, _ = train(2, backend, batch=8)
    one, _, _ = train(1, backend, batch=16)
    assert max_diff(two[0], one[0]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_matches_one_larger_batch(backend):
    accumulated, _, _ = train(1, backend, batch=8, accumulation=2)
    one, _, _ = train(1, backend, batch=16)
    assert max_diff(accumulated[0], one[0]) <= 1e-5


def test_ranks_and_accumulation_together_match_one_rank():
    both, _, _ = train(2, "mpi", batch=4, accumulation=2)
    one, _, _ = train(1, "mpi", batch=16)
    assert max_diff(both[0], one[0]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_compression_final_loss_within_one_percent(backend):
    _, exact, _ = train(2, backend, "none")
    _, fp16, _ = train(2, backend, "fp16")
    assert abs(fp16["metrics"]["val_loss"] - exact["metrics"]["val_loss"]) <= 0.01 * exact["metrics"]["val_loss"]
    assert fp16["metrics"]["val_loss"] != exact["metrics"]["val_loss"]  # it did go through float16


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_predivide_factor_changes_only_the_rounding(backend):
    exact, _, _ = train(2, backend, "none")
    split, _, _ = train(2, backend, "fp16", predivide=2.0)
    assert max_diff(split[0], exact[0]) <= 2e-3
    for a, b in zip(params(split[0]), params(split[1])):
        assert a.tobytes() == b.tobytes()


@needs_horovod
@pytest.mark.parametrize("compression, tolerance", [("none", 1e-5), ("fp16", 2e-3)])
def test_horovod_and_mpi_backends_agree(compression, tolerance):
    hvd, hvd_result, said = train(2, "horovod", compression)
    mpi, mpi_result, _ = train(2, "mpi", compression)
    assert "cycle 0.2 ms (hpctrain's default; Horovod's is 1 ms" in said  # the run's first line says it
    assert "MPI waits: OMPI_MCA_mpi_yield_when_idle=true (as set)" in said  # the test harness sets it
    assert max_diff(hvd[0], mpi[0]) <= tolerance
    assert hvd_result["metrics"]["val_loss"] == pytest.approx(mpi_result["metrics"]["val_loss"], rel=1e-3)


def test_stop_requested_on_one_rank_stops_every_rank_after_the_same_step():
    ranks, result, output = train(2, "mpi", stop_at=5)
    assert result["stopped"] is True and result["steps"] == 5
    assert [int(r["steps"]) for r in ranks] == [5, 5]
    assert "stop requested: saving at step 5" in output


@pytest.mark.parametrize("backend", BACKENDS)
def test_stopped_run_resumes_mid_epoch_on_another_rank_count_and_matches_an_uninterrupted_one(tmp_path, backend):
    """Momentum SGD stopped at step 5 of 12 on 2 ranks, resumed on 1: the parameters and losses of the uninterrupted
    run. Horovod starts after the resume (its thread would slow the checkpoint's MPI-IO): the state read into the
    plain optimizer is carried into Horovod's wrapper, or the momentum would be lost."""
    pytest.importorskip("hpctrain.checkpoint")
    common = [f"comm.backend={backend}", "train.global_batch_size=16", "checkpoint.on_finish=true"]

    def launch(n, name, *extra):
        out = tmp_path / name
        out.mkdir(exist_ok=True)
        return out, mpirun(n, [TINY, out, *extra, "--checkpoints", f"run.run_dir={tmp_path}/{name}-run", *common],
                           timeout=150)

    ref_out, ref = launch(2, "reference")
    assert ref.returncode == 0, ref.output[-4000:]
    out, first = launch(2, "interrupted", "--stop-at", "5")
    assert first.returncode == 3 and "stop requested: saving at step 5" in first.output, first.output[-4000:]
    # Same run directory, one rank (batch 16 instead of 2 x 8): continues at step 5 of epoch 0.
    out2 = tmp_path / "interrupted"
    second = mpirun(1, [TINY, out2, "--checkpoints", f"run.run_dir={tmp_path}/interrupted-run", *common], timeout=150)
    assert second.returncode == 0, second.output[-4000:]
    assert json.loads((out2 / "result.json").read_text())["horovod_at_resume"] is False
    resumed, reference = dict(np.load(out2 / "rank0.npz")), dict(np.load(ref_out / "rank0.npz"))
    assert int(resumed["steps"]) == 12 and len(resumed["losses"]) == 7  # steps 6..12 only
    assert max_diff(resumed, reference) <= 1e-5
    # Ranks re-seed from (seed, step, rank) and the data order is global: the resumed steps see the
    # same losses as the uninterrupted run's (rank 0 there averaged half of each batch: compare means).
    ref_losses = (reference["losses"] + dict(np.load(ref_out / "rank1.npz"))["losses"]) / 2
    assert np.allclose(resumed["losses"], ref_losses[5:], atol=1e-5)


# ---------------------------------------------------------------- errors on every rank
def per_rank_errors(output, n):
    lines = dict(re.findall(r"^rank (\d+): (.*)$", output, flags=re.M))
    assert sorted(lines) == [str(r) for r in range(n)], output[-3000:]
    return set(lines.values())


@pytest.mark.parametrize("override, text", [
    ("train.bach_size=4", "unknown key train.bach_size; valid keys in [train]: epochs, max_steps, batch_size"),
    ("train.global_batch_size=15", "train.global_batch_size = 15 is not divisible by ranks x accumulation = 2 x 1"),
    ("comm.compression=fp8", "comm.compression = 'fp8' is not one of none, fp16"),
    ("train.precision=fp16", 'train.precision = "fp16" needs a GPU'),
])
def test_bad_configuration_fails_alike_on_every_rank(override, text):
    result = mpirun(2, [ERRORS, "comm.backend=mpi", override], timeout=90)
    errors = per_rank_errors(result.output, 2)
    assert len(errors) == 1, errors  # the same error on both ranks
    (error,) = errors
    assert error.startswith("ConfigError: ") and text in error and "HINT:" in error
    assert result.returncode != 0


def _horovod_blocker(directory):
    """A sitecustomize that makes `import horovod` fail, as on a machine without it."""
    (Path(directory) / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'horovod' or name.startswith('horovod.'):\n"
        "            raise ImportError('No module named ' + repr(name) + ' (blocked by the test)')\n"
        "sys.meta_path.insert(0, _Block())\n")
    return {"PYTHONPATH": f"{directory}{os.pathsep}{ROOT}"}


def test_missing_horovod_fails_alike_on_every_rank_with_a_hint(tmp_path):
    env = _horovod_blocker(tmp_path)
    result = mpirun(2, [ERRORS, "comm.backend=horovod"], env=env, timeout=90)
    (error,) = per_rank_errors(result.output, 2)
    assert error.startswith("BackendUnavailable: ") and "Horovod cannot be imported" in error
    assert "HINT: run `make setup`" in error and 'comm.backend = "mpi"' in error
    assert result.returncode != 0
    # The same through the command line, with the backend chosen by HPCTRAIN_BACKEND.
    cli = hpctrain(2, "train", "examples/digits.toml", f"run.root={tmp_path}/runs",
                   env={**env, "HPCTRAIN_BACKEND": "horovod"}, timeout=90)
    assert cli.returncode == 2, cli.output[-3000:]
    assert "hpctrain: error: the horovod backend was asked for" in cli.stderr and "HINT:" in cli.stderr
    assert "Traceback" not in cli.stderr


@pytest.mark.smoke
def test_cli_unknown_key_exits_2_with_the_message(tmp_path):
    result = hpctrain(2, "train", "examples/digits.toml", "train.bach_size=4", timeout=90)
    assert result.returncode == 2
    assert "unknown key train.bach_size" in result.stderr and "did you mean train.batch_size?" in result.stderr
    assert result.stderr.count("unknown key train.bach_size") == 1  # said once, not once per rank


# ---------------------------------------------------------------- the step budget
@pytest.mark.parametrize("epochs, max_steps, ends_by", [pytest.param(0, 50, "max_steps", marks=pytest.mark.smoke),
                                                     (2, 50, "epochs")])
def test_max_steps_alone_is_the_budget_and_with_epochs_the_first_ends_the_run(tmp_path, digits, epochs,
                                                                              max_steps, ends_by):
    result = hpctrain(2, "train", "examples/digits.toml", f"data.path={digits}", "comm.backend=mpi",
                      f"run.root={tmp_path}/runs", f"train.epochs={epochs}", f"train.max_steps={max_steps}",
                      "checkpoint.on_epoch_end=false", timeout=120).check()
    per_epoch = int(re.search(r"; (\d+) steps/epoch;", result.stdout).group(1))
    assert per_epoch < max_steps < 3 * per_epoch, result.stdout  # max_steps crosses epochs
    last = max_steps if ends_by == "max_steps" else epochs * per_epoch
    reason = f"train.max_steps = {max_steps}" if ends_by == "max_steps" else f"train.epochs = {epochs}"
    assert f"until step {last} ({reason})" in result.stdout, result.stdout
    assert f"done at step {last}, epoch {last // per_epoch}:" in result.stdout, result.stdout


# ---------------------------------------------------------------- the digits example
@needs_horovod
def test_digits_example_reaches_its_accuracy_with_fp16_compression(tmp_path):
    pytest.importorskip("sklearn")
    result = hpctrain(2, "train", "examples/digits.toml", "comm.compression=fp16",
                      f"run.root={tmp_path}/runs", f"data.path={tmp_path}/digits.h5", timeout=150)
    assert result.returncode == 0, result.output[-4000:]
    accuracy = float(re.findall(r"val_accuracy (\d\.\d+)", result.stdout)[-1])
    assert accuracy >= 0.90, result.stdout[-3000:]
    run_dir = Path(re.search(r"^run directory: (.+)$", result.stdout, flags=re.M).group(1))
    assert run_dir.parent == tmp_path / "runs" and re.fullmatch(r"digits-\d{8}-\d{6}", run_dir.name)
    config = (run_dir / "config.toml").read_text()
    assert 'compression = "fp16"' in config and "batch_size = 32" in config
