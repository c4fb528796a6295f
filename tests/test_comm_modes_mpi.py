"""``comm.mode`` under a real ``mpirun``: local SGD and the one-step-stale average on both
backends, what each promises (equal replicas after every average, every gradient applied
once, bitwise resume), and bad combinations failing alike on every rank.

Each launch trains a tiny model for 12 steps (tests/mpi/comm_modes_train.py) and saves every
rank's parameters and a per-step fingerprint of them.
"""
import re

import numpy as np
import pytest

from mpi_harness import mpirun

pytestmark = pytest.mark.mpi

SCRIPT = "tests/mpi/comm_modes_train.py"
ERRORS = "tests/mpi/train_errors.py"


def launch(tmp_path, name, n, *args, code=0, timeout=150):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    result = mpirun(n, [SCRIPT, out, *args], timeout=timeout)
    assert result.returncode == code, result.output[-5000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(n)], result.output


def params(rank):
    return [rank[k] for k in sorted(rank) if re.fullmatch(r"p\d+", k)]


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(params(a), params(b)))


def bitwise_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(params(a), params(b)))


@pytest.mark.parametrize("backend", ["horovod", pytest.param("mpi", marks=pytest.mark.smoke)])
def test_local_sgd_averaging_every_step_equals_sync(tmp_path, backend):
    # Plain SGD: the mean of the ranks' locally updated parameters is the update by the mean gradient.
    common = [f"comm.backend={backend}", "train.momentum=0"]
    sync, _ = launch(tmp_path, "sync", 2, *common)
    local, _ = launch(tmp_path, "local", 2, *common, "comm.mode=local_sgd", "comm.sync_every=1")
    assert max_diff(sync[0], local[0]) < 1e-5
    assert int(local[0]["syncs"]) == 12


@pytest.mark.parametrize("backend, compression, model", [("horovod", "fp16", "--batchnorm"), ("mpi", "none", "--mlp")])
def test_local_sgd_replicas_are_bitwise_equal_after_every_average_and_only_then(tmp_path, backend, compression, model):
    # --batchnorm: its running statistics (buffers) are in the fingerprints and must be averaged too
    ranks, output = launch(tmp_path, "run", 4, *([model] if model != "--mlp" else []),
                           f"comm.backend={backend}", f"comm.compression={compression}",
                           "comm.mode=local_sgd", "comm.sync_every=4", "comm.sync_warmup=2",
                           "comm.outer_optimizer=nesterov", "comm.outer_lr=0.7", "comm.outer_momentum=0.5",
                           "train.momentum=0.9")
    prints = np.array([r["prints"] for r in ranks])  # ranks x steps
    for step in range(1, 13):
        same = len(set(prints[:, step - 1])) == 1
        # synchronisation points: the warm-up steps 1-2 and every 4th step
        assert same == (step <= 2 or step % 4 == 0), (step, prints[:, step - 1])
    assert all(bitwise_equal(ranks[0], r) for r in ranks[1:])
    assert int(ranks[0]["syncs"]) == 3
    assert "comm.mode local_sgd: parameters averaged every 4 steps after 2 synchronous steps" in output


@pytest.mark.slow
@pytest.mark.parametrize("backend, n", [("horovod", 4), ("mpi", 2)])
def test_stale_applies_every_gradient_exactly_once(tmp_path, backend, n):
    # --linear: the gradients do not depend on the parameters, so plain SGD ends at the initial
    # parameters minus lr x the sum of the applied gradients, in whatever order they came.
    common = ["--linear", f"comm.backend={backend}", "train.momentum=0", "train.accumulation=2", "train.epochs=2"]
    sync, _ = launch(tmp_path, "sync", n, *common)
    stale, _ = launch(tmp_path, "stale", n, *common, "comm.mode=stale")
    # steps 2..12 apply the averages of steps 1..11, the end applies step 12's
    assert int(stale[0]["steps"]) == 12 and int(stale[0]["applied"]) == 12
    assert max_diff(sync[0], stale[0]) < 1e-5
    # one gradient lost or applied twice would move the parameters by lr x |g|, far more
    short, _ = launch(tmp_path, "short", n, *common, "train.max_steps=11")
    assert max_diff(sync[0], short[0]) > 1e-3
    assert all(bitwise_equal(stale[0], r) for r in stale[1:])


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    ["train.momentum=0.9", "comm.backend=mpi"],
    ["comm.mode=local_sgd", "comm.sync_every=4", "comm.outer_optimizer=nesterov", "comm.outer_lr=0.7",
     "comm.outer_momentum=0.5", "train.momentum=0.9", "comm.backend=horovod"],
    ["comm.mode=stale", "train.momentum=0.9", "comm.backend=mpi", "comm.compression=fp16"],
], ids=["sync-mpi", "local_sgd-nesterov-horovod", "stale-mpi-fp16"])
def test_interrupted_and_resumed_equals_uninterrupted_bitwise(tmp_path, mode):
    pytest.importorskip("hpctrain.checkpoint")
    common = [*mode, "checkpoint.every_steps=4"]
    ref, _ = launch(tmp_path, "reference", 2, "--checkpoints", f"run.run_dir={tmp_path}/ref-run", *common)
    run = [f"run.run_dir={tmp_path}/run", *common]
    first, output = launch(tmp_path, "interrupted", 2, "--checkpoints", "--stop-at", "8", *run, code=3)
    assert "stop requested: saving at step 8" in output
    resumed, output = launch(tmp_path, "interrupted", 2, "--checkpoints", *run)
    assert "resumed from" in output and "at step 8" in output
    assert int(resumed[0]["steps"]) == 12 and len(resumed[0]["prints"]) == 4  # steps 9..12 only
    assert bitwise_equal(resumed[0], ref[0]) and bitwise_equal(resumed[1], ref[1])
    # the same checkpoint on another rank count trains on
    other, _ = launch(tmp_path, "other", 4, "--checkpoints", f"run.run_dir={tmp_path}/run", *common,
                      "checkpoint.resume=" + str(tmp_path / "run" / "checkpoints" / "ckpt-00000008.h5"))
    assert int(other[0]["steps"]) == 12


def per_rank_errors(output, n):
    lines = dict(re.findall(r"^rank (\d+): (.*)$", output, flags=re.M))
    assert sorted(lines) == [str(r) for r in range(n)], output[-3000:]
    return set(lines.values())


@pytest.mark.parametrize("overrides, text", [
    (["comm.mode=local_sgd", "comm.sync_every=0"], "comm.sync_every = 0 must be >= 1"),
    (["comm.outer_optimizer=nesterov"],
     'comm.outer_optimizer = \'nesterov\' is only used with comm.mode = "local_sgd"'),
    (["comm.mode=local_sgd", "comm.sync_every=4", "checkpoint.every_steps=6"],
     "checkpoint.every_steps = 6 is not a multiple of comm.sync_every = 4"),
])
def test_bad_combinations_fail_alike_on_every_rank(overrides, text):
    result = mpirun(2, [ERRORS, "comm.backend=mpi", *overrides], timeout=90)
    errors = per_rank_errors(result.output, 2)
    assert len(errors) == 1, errors
    (error,) = errors
    assert error.startswith("ConfigError: ") and text in error and "HINT:" in error
    assert result.returncode != 0
