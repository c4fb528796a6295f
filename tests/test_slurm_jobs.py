"""The shipped job scripts in slurm/, submitted with sbatch to a real single-node Slurm
cluster, training the digits example: outputs, run directories and checkpoints are checked,
not just exit codes. Preemption: a job warned with SIGUSR1 mid-run checkpoints, requeues
itself, resumes and ends with the same parameters, bit for bit, as an uninterrupted run."""
import os
import subprocess
import time

import numpy as np
import pytest

from checkpoint_files import latest, tensors
from mpi_harness import PYTHON, ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB_TIMEOUT = 300


@pytest.fixture
def job_env(slurm_cluster, tmp_path):
    """Submission environment: runs under tmp_path; the job scripts' defaults otherwise."""
    return slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs")})


def quick(digits, steps=30, every=10):
    return [f"data.path={digits}", f"train.max_steps={steps}", f"checkpoint.every_steps={every}",
            "monitor.log_every=10"]


def submit(cluster, script, args, env, tmp_path, options=(), output="%x-%j.out"):
    return cluster.sbatch(ROOT / "slurm" / script, "examples/digits.toml", *args, env=env,
                          options=[f"--output={tmp_path}/{output}", *options])


def output_of(tmp_path, job):
    (path,) = [p for p in tmp_path.glob(f"*-{job}.out")]
    return path.read_text()


def ckpt_verify(path):
    return subprocess.run([PYTHON, "-m", "hpctrain", "ckpt", "verify", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)



def assert_completed(record, out):
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out[-4000:]}"


@pytest.mark.parametrize("script,launcher", [("train.sbatch", "srun"), ("train-mpirun.sbatch", "mpirun")])
def test_train_job_runs_to_completion(slurm_cluster, job_env, tmp_path, digits, script, launcher):
    job = submit(slurm_cluster, script, quick(digits), job_env, tmp_path)
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    assert_completed(record, out)
    assert f"2 ranks ({launcher})" in out and "done at step 30" in out
    run_dir = tmp_path / "runs" / f"{record['JobName']}-{job}"
    assert f"run directory: {run_dir}" in out
    assert (run_dir / "config.toml").exists()
    final = latest(run_dir)
    assert final.name == "ckpt-00000030.h5"
    check = ckpt_verify(final)
    assert check.returncode == 0 and "ok" in check.stdout, check.stdout + check.stderr


def test_sweep_array_trains_one_run_per_learning_rate(slurm_cluster, job_env, tmp_path, digits):
    env = dict(job_env, LRS="0.1 0.05 0.01")
    job = submit(slurm_cluster, "sweep.sbatch", quick(digits, steps=20), env, tmp_path, output="%x-%A_%a.out")
    records = slurm_cluster.wait(job, JOB_TIMEOUT)
    assert sorted(r["ArrayTaskId"] for r in records) == ["0", "1", "2"]
    for record in records:
        out = (tmp_path / f"hpctrain-sweep-{job}_{record['ArrayTaskId']}.out").read_text()
        assert_completed(record, out)
    for lr in ("0.1", "0.05", "0.01"):
        run_dir = tmp_path / "runs" / f"hpctrain-sweep-{job}" / f"lr-{lr}"
        assert f"lr = {lr}\n" in (run_dir / "config.toml").read_text()
        assert latest(run_dir).name == "ckpt-00000020.h5"


def test_sweep_with_too_few_values_fails_clearly(slurm_cluster, job_env, tmp_path, digits):
    env = dict(job_env, LRS="0.1")
    job = submit(slurm_cluster, "sweep.sbatch", quick(digits), env, tmp_path, options=["--array=1"],
                 output="%x-%A_%a.out")
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0"
    assert "array task 1 but LRS has only 1 values" in (tmp_path / f"hpctrain-sweep-{job}_1.out").read_text()


# A longer run for the jobs that are interrupted: a checkpoint every other step (tens of
# ms each here), so that a signal sent at step 30 lands well inside it.
LONG_STEPS = 150


def long_run(digits):
    return [f"data.path={digits}", f"train.max_steps={LONG_STEPS}", "checkpoint.every_steps=2",
            "checkpoint.keep_last=2", "monitor.log_every=10"]


def wait_for_step(cluster, tmp_path, job, step, timeout=JOB_TIMEOUT):
    def reached():
        try:
            return f"step {step}/" in output_of(tmp_path, job)
        except ValueError:  # no output file yet
            return False
    cluster.wait_for(reached, timeout, f"job {job} to reach step {step}", poll=0.2)


def test_preempted_job_requeues_resumes_and_matches_an_uninterrupted_run(slurm_cluster, job_env, tmp_path, digits):
    reference_dir = tmp_path / "reference"
    ref = submit(slurm_cluster, "train.sbatch", long_run(digits), dict(job_env, RUN_DIR=str(reference_dir)),
                 tmp_path)
    (ref_record,) = slurm_cluster.wait(ref, JOB_TIMEOUT)
    assert_completed(ref_record, output_of(tmp_path, ref))

    job = submit(slurm_cluster, "preemptible.sbatch", long_run(digits), job_env, tmp_path)
    wait_for_step(slurm_cluster, tmp_path, job, 30)
    # the warning Slurm sends before a time limit (--signal=B:USR1@...), sent now
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    assert_completed(record, out)
    assert record["Restarts"] == "1", record
    assert "SIGUSR1: asking the ranks to checkpoint and stop" in out
    stop = int(out.split("stop requested: saving at step ")[1].split()[0])
    assert 30 <= stop < LONG_STEPS, out
    assert "exit status 3" in out and f"requeueing Slurm job {job}" in out
    assert "(start 2)" in out and f"done at step {LONG_STEPS}" in out
    second_start = out.split("(start 2)")[1]
    assert "step 10/" not in second_start and f"step {stop // 10 * 10 + 10}/" in second_start  # resumed

    run_dir = tmp_path / "runs" / f"hpctrain-preemptible-{job}"
    final, expected = latest(run_dir), latest(reference_dir)
    assert final.name == expected.name == f"ckpt-{LONG_STEPS:08d}.h5"
    got, want = tensors(final), tensors(expected)
    assert sorted(got) == sorted(want) and len(got) >= 4
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), \
            f"{name} differs after preemption at step {stop}"


def _injecting_venv(tmp_path):
    """A stand-in for HPCTRAIN_VENV whose python runs tests/mpi/fail_inject.py first."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python"
    wrapper.write_text(f"#!/bin/bash\nexec {PYTHON} {ROOT}/tests/mpi/fail_inject.py \"$@\"\n")
    wrapper.chmod(0o755)
    return venv


def _seconds(record, start="StartTime", end="EndTime"):
    fmt = "%Y-%m-%dT%H:%M:%S"
    return time.mktime(time.strptime(record[end], fmt)) - time.mktime(time.strptime(record[start], fmt))


def test_exception_on_one_rank_ends_the_job(slurm_cluster, job_env, tmp_path, digits):
    env = dict(job_env, HPCTRAIN_VENV=str(_injecting_venv(tmp_path)), PYTHONPATH=str(ROOT),
               FAIL_RANK="1", FAIL_AT="backward:15", FAIL_ACTION="raise")
    job = submit(slurm_cluster, "train.sbatch", long_run(digits), env, tmp_path)
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] != "0:0", f"{record}\n{out}"
    assert f"unhandled exception on rank 1 ({os.uname().nodename}); aborting all 2 ranks" in out
    assert "RuntimeError: injected failure at backward call 15" in out
    assert "done at step" not in out
    # the whole job, Python start-up included; without the abort it would run to the time limit
    assert _seconds(record) < 60, record


def test_hung_rank_is_ended_by_the_watchdog(slurm_cluster, job_env, tmp_path, digits):
    env = dict(job_env, HPCTRAIN_VENV=str(_injecting_venv(tmp_path)), PYTHONPATH=str(ROOT),
               FAIL_RANK="0", FAIL_AT="backward:15", FAIL_ACTION="sleep", HPCTRAIN_WATCHDOG_TIMEOUT="5")
    job = submit(slurm_cluster, "train.sbatch", long_run(digits), env, tmp_path)
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    assert record["JobState"] == "FAILED", f"{record}\n{out}"
    assert f"hpctrain: watchdog: rank 0 on {os.uname().nodename}" in out and "in _act" in out
    assert _seconds(record) < 60, record


def test_second_job_on_the_same_run_dir_fails_and_overwrites_nothing(slurm_cluster, job_env, tmp_path, digits):
    run_dir = tmp_path / "shared-run"
    env = dict(job_env, RUN_DIR=str(run_dir))
    # The first job must still hold the directory when the second starts, however fast the
    # machine: its rank 0 stops in step 25 until the job is cancelled.
    holder = dict(env, HPCTRAIN_VENV=str(_injecting_venv(tmp_path)), PYTHONPATH=str(ROOT),
                  FAIL_RANK="0", FAIL_AT="backward:25", FAIL_ACTION="sleep")
    first = submit(slurm_cluster, "train.sbatch", long_run(digits) + ["monitor.log_every=1"], holder, tmp_path)
    try:
        wait_for_step(slurm_cluster, tmp_path, first, 24)  # its last save is done: it only waits now
        config_before = (run_dir / "config.toml").read_bytes()
        checkpoints_before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        second = submit(slurm_cluster, "train.sbatch", quick(digits), env, tmp_path)
        (rec2,) = slurm_cluster.wait(second, JOB_TIMEOUT)
        out2 = output_of(tmp_path, second)
        assert rec2["JobState"] == "FAILED", f"{rec2}\n{out2}"
        assert f"run directory {run_dir} is in use by Slurm job {first}" in out2 and "HINT:" in out2
        assert (run_dir / "config.toml").read_bytes() == config_before
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints_before
    finally:
        # SIGKILL: its rank 0 sleeps and would hold the job for KillWait after a SIGTERM
        slurm_cluster.run(["scancel", "--full", "--signal=KILL", first], check=False)
        slurm_cluster.run(["scancel", first], check=False)
    slurm_cluster.wait(first, JOB_TIMEOUT)


def test_train_cli_under_srun_without_pmix_names_the_fix(slurm_cluster, tmp_path, digits):
    proc = slurm_cluster.run(["srun", "--mpi=none", "-n", "2", PYTHON, "-m", "hpctrain", "train",
                              "examples/digits.toml", *quick(digits), f"run.run_dir={tmp_path}/run"],
                             timeout=120, check=False)
    assert proc.returncode != 0
    assert "HINT: launch with `srun --mpi=pmix ...`" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()  # stopped before anything was written
