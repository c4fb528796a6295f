"""Split models from ``hpctrain train`` under a real ``mpirun -n 4``: pipeline, tensor and
hybrid runs equal their Python-API twins (HybridParallel driven by hand), Horovod process
sets equal MPI sub-communicators, a split run stops on request (and on SIGUSR1 to mpirun) and
resumes in another layout, each rank builds only its stage, and bad ``[parallel]`` settings fail alike on every
rank.

Every run trains the built-in transformer (6 layers, width 16) on a tiny teacher corpus for
4 steps; the command's runs are cached and shared between tests.
"""
import json
import re
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from assertions import ranks_say
from mpi_harness import ROOT, hpctrain, mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SCRIPTS = ROOT / "tests" / "mpi"
TIMEOUT = 180
STEPS = 4
SCRATCH = Path(tempfile.mkdtemp(prefix="hpctrain-parallel-cli-"))

CONFIG = f"""
[run]
name = "split"
seed = 3

[model]
name = "transformer"
in_features = 16
hidden = 16
depth = 1
num_classes = 4

[data]
path = "{SCRATCH / 'teacher.h5'}"
generate = "teacher"
samples = 256
val_samples = 32

[train]
epochs = 1
max_steps = {STEPS}
batch_size = 8
lr = 0.05
momentum = 0.9

[parallel]
micro_batches = 2

[checkpoint]
on_epoch_end = false

[monitor]
log_every = 1
progress = "log"
"""

LAYOUTS = {
    "pipeline-4-stages": ["parallel.stages=4", "parallel.schedule=gpipe"],
    "2-stages-x-2-replicas": ["parallel.stages=2"],
    "2-tensor-x-2-replicas": ["parallel.tensor=2"],
}


@pytest.fixture(scope="module")
def config():
    from hpctrain.config import load_config
    from hpctrain.data import generate

    path = SCRATCH / "split.toml"
    path.write_text(CONFIG)
    cfg = load_config(path)
    if not Path(cfg.data.path).exists():  # once, before any run reads it
        generate(cfg.data, cfg.model, seed=cfg.run.seed)
    return path


_runs = {}


def cli(config, *overrides, expect=0):
    """``mpirun -n 4 hpctrain train CONFIG run.run_dir=... OVERRIDES`` (cached); its run directory."""
    if overrides not in _runs:
        run_dir = SCRATCH / f"run{len(_runs)}"
        result = hpctrain(4, "train", config, f"run.run_dir={run_dir}", *overrides, timeout=TIMEOUT)
        assert result.returncode == expect, result.output[-5000:]
        _runs[overrides] = (run_dir, result)
    return _runs[overrides]


def final_model(path):
    with h5py.File(path, "r") as f:
        return {name: f["model"][name][()] for name in f["model"]}


def checkpoint(run_dir, step=STEPS):
    path = run_dir / "checkpoints" / f"ckpt-{step:08d}.h5"
    assert path.exists(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    return path


def max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


@pytest.fixture(scope="module")
def api(config):
    """The Python-API runs of every layout (one launch each)."""
    out = {}
    for name, overrides in LAYOUTS.items():
        path = SCRATCH / f"api-{name}.h5"
        result = mpirun(4, [SCRIPTS / "parallel_cli_api.py", config, path, *overrides], timeout=TIMEOUT).check()
        ranks_say(result, "API SAVED", 4)
        out[name] = final_model(path)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cli_run_equals_the_python_api_run(config, api, layout):
    run_dir, result = cli(config, *LAYOUTS[layout])
    ours = final_model(checkpoint(run_dir))
    assert max_diff(ours, api[layout]) < 1e-5
    # The trainer's monitoring, as for data-parallel runs.
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["kind"] == "train"][-1] == STEPS
    assert "replicas average over Horovod process sets" in result.stdout or layout == "pipeline-4-stages"


def test_horovod_process_sets_equal_mpi_sub_communicators_with_fp16(config):
    hvd_dir, hvd = cli(config, "parallel.stages=2", "comm.compression=fp16")
    mpi_dir, mpi = cli(config, "parallel.stages=2", "comm.compression=fp16", "comm.backend=mpi")
    assert "replicas average over Horovod process sets, compression fp16" in hvd.stdout
    assert "replicas average over mpi sub-communicators, compression fp16" in mpi.stdout
    a, b = final_model(checkpoint(hvd_dir)), final_model(checkpoint(mpi_dir))
    assert max_diff(a, b) < 1e-3
    # fp16 rounding shows: the compressed run is close to, not equal to, the uncompressed one.
    full_dir, _ = cli(config, *LAYOUTS["2-stages-x-2-replicas"])
    assert 0 < max_diff(a, final_model(checkpoint(full_dir))) < 1e-2


def test_split_run_stops_on_request_and_resumes_in_another_layout(config):
    run_dir = SCRATCH / "stopped"
    result = mpirun(4, [SCRIPTS / "parallel_cli_stop.py", "2", config, f"run.run_dir={run_dir}",
                        "parallel.stages=2"], timeout=TIMEOUT)
    assert result.returncode == 3, result.output[-5000:]
    ranks_say(result, "STOPPED True AT 2", 4)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "ckpt-00000002.h5"
    with h5py.File(checkpoint(run_dir, 2), "r") as f:
        assert '"stages": 2' in f.attrs["parallel_layout"]
    # Resumed as 1 stage x 2 tensor ranks x 2 replicas (the same global batch of 2 x 8): the same
    # numbers as 2 stages x 2 replicas without a stop.
    resumed = hpctrain(4, "train", config, f"run.run_dir={run_dir}", "parallel.tensor=2", timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.output[-5000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    straight_dir, _ = cli(config, *LAYOUTS["2-stages-x-2-replicas"])
    assert max_diff(final_model(checkpoint(run_dir)), final_model(checkpoint(straight_dir))) < 1e-5


def test_cli_split_run_stops_on_a_signal_with_a_checkpoint(config):
    """The real path of a Slurm warning: SIGUSR1 to mpirun (forwarded to every rank)."""
    import signal
    import subprocess

    from mpi_harness import PYTHON, mpi_env

    run_dir = SCRATCH / "signalled"
    cmd = ["mpirun", "-n", "4", "--timeout", str(TIMEOUT), PYTHON, "-m", "hpctrain", "train", str(config),
           f"run.run_dir={run_dir}", "parallel.stages=2", "train.max_steps=400"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpi_env(),
                            cwd=ROOT)
    lines = []
    try:
        for line in proc.stdout:  # training has started once step lines appear
            lines.append(line)
            if line.startswith("step 2/"):
                proc.send_signal(signal.SIGUSR1)
                break
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 3, out[-5000:]
    # mpirun may cut another rank's line into it ("saving at step 3step 4/400 ..."): the digits only
    step = int(re.search(r"stop requested: saving at step (\d+)", out).group(1))
    assert 2 <= step < 400
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"ckpt-{step:08d}.h5"


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-sets", "no-dynamic-sets"])
def test_process_sets_when_horovod_is_already_running(dynamic):
    env = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"} if dynamic else {"HOROVOD_DYNAMIC_PROCESS_SETS": "0"}
    result = mpirun(4, [SCRIPTS / "parallel_cli_dynamic_sets.py"], timeout=TIMEOUT, env=env)
    if dynamic:
        result.check()
        ranks_say(result, "DYNAMIC SETS OK", 4)
    else:
        assert result.returncode != 0
        ranks_say(result, "ERROR BackendUnavailable", 4)
        assert result.stderr.count("Horovod is already initialised in this process") == 1, result.stderr[-3000:]
        assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in result.stderr


def test_each_rank_builds_only_its_stage():
    result = mpirun(4, [SCRIPTS / "parallel_cli_memory.py"], timeout=TIMEOUT).check()
    ranks_say(result, "UNDER LIMIT", 4)
    ranks_say(result, "WHOLE MODEL OVER LIMIT", 4)
    ranks_say(result, "TRAINED", 4)


@pytest.mark.parametrize("override,message", [
    ("parallel.stages=3", "4 ranks cannot be divided into replicas of 3 stage(s)"),
    ("parallel.schedule=1f2b", "parallel.schedule = '1f2b' is not one of 1f1b, gpipe"),
])
def test_bad_parallel_settings_fail_alike_on_every_rank(config, override, message):
    result = hpctrain(4, "train", config, f"run.run_dir={SCRATCH / 'bad'}", override, timeout=60)
    assert result.returncode == 2, result.output[-3000:]
    assert result.stderr.count(message) == 1, result.stderr[-3000:]  # said once, not once per rank
    assert "HINT:" in result.stderr
