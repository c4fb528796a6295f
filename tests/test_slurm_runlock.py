"""The run directory lock (pure file logic, real processes), and two steps of one real Slurm
allocation on one run directory; the same between two real Slurm jobs is in test_slurm.py."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from hpctrain.errors import HpctrainError
from hpctrain.job import runlock
from hpctrain.runtime import slurm
from mpi_harness import ROOT


def _holder(run_dir, seconds):
    """Another live process that takes the lock and keeps it."""
    code = ("import sys, time; from hpctrain.job import runlock; runlock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(float(sys.argv[2]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir), str(seconds)],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, SLURM_JOB_ID=""))
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_acquire_release(tmp_path):
    run_dir = tmp_path / "run"
    path = runlock.acquire(str(run_dir))
    holder = json.loads(open(path).read())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    runlock.release(path)
    assert not os.path.exists(path)
    runlock.acquire(str(run_dir))
    runlock.release(str(run_dir))  # the run directory will do too
    assert not os.path.exists(path)


def test_live_holder_refuses_a_second_run(tmp_path):
    proc = _holder(tmp_path, 30)
    try:
        with pytest.raises(runlock.RunDirBusy) as info:
            runlock.acquire(str(tmp_path), environ={})
        text = str(info.value)
        assert f"run directory {tmp_path} is in use by pid {proc.pid} on {socket.gethostname()}" in text
        assert "HINT: give this run its own directory" in text
        assert isinstance(info.value, HpctrainError)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    proc = _holder(tmp_path, 30)
    proc.kill()  # as a job killed with SIGKILL leaves its lock behind
    proc.wait(timeout=10)
    path = runlock.acquire(str(tmp_path), environ={})
    assert json.loads(open(path).read())["pid"] == os.getpid()


def test_lock_of_an_exited_unreaped_process_is_taken_over(tmp_path):
    # A crashed rank that has exited but is not yet reaped still answers kill(pid, 0).
    proc = _holder(tmp_path, 0)
    for _ in range(100):
        if runlock.proc_state(proc.pid)[0] == "Z":
            break
        time.sleep(0.05)
    assert runlock.proc_state(proc.pid)[0] == "Z"
    path = runlock.acquire(str(tmp_path), environ={})
    assert json.loads(open(path).read())["pid"] == os.getpid()
    proc.wait(timeout=10)


def test_lock_of_a_reused_pid_is_taken_over(tmp_path):
    # The pid in the lock now belongs to another process (here: pid 1), started at another time.
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(
        {"slurm_job": None, "host": socket.gethostname(), "pid": 1, "proc_start": -1, "started": "then"}))
    path = runlock.acquire(str(tmp_path), environ={})
    assert json.loads(open(path).read())["pid"] == os.getpid()


def test_same_slurm_job_takes_over_its_own_lock(tmp_path):
    # a requeued job restarts on another node, under the same job id
    lock = tmp_path / runlock.LOCK_NAME
    lock.write_text(json.dumps({"slurm_job": "41_2", "host": "othernode", "pid": 1, "started": "x"}))
    env = {"SLURM_JOB_ID": "99", "SLURM_ARRAY_JOB_ID": "41", "SLURM_ARRAY_TASK_ID": "2"}
    runlock.acquire(str(tmp_path), environ=env)
    assert json.loads(lock.read_text())["slurm_job"] == "41_2"
    # a different job, on a host where the pid cannot be checked: refused
    lock.write_text(json.dumps({"slurm_job": "41_3", "host": "othernode", "pid": 1, "started": "x"}))
    with pytest.raises(runlock.RunDirBusy, match="Slurm job 41_3, pid 1 on othernode"):
        runlock.acquire(str(tmp_path), environ=env)


def _slurm_holder(step, restart):
    return json.dumps({"slurm_job": "77", "slurm_step": step, "slurm_restart": restart,
                       "host": "othernode", "pid": 1, "started": "x", "token": os.urandom(4).hex()})


def test_requeued_job_takes_over_but_a_second_live_step_is_refused(tmp_path, monkeypatch):
    lock = tmp_path / runlock.LOCK_NAME
    # the same job, run again after a requeue (SLURM_RESTART_COUNT went up): the old run is gone
    lock.write_text(_slurm_holder("77.0", 0))
    runlock.acquire(str(tmp_path), environ={"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
                                            "SLURM_RESTART_COUNT": "1"})
    assert json.loads(lock.read_text())["slurm_restart"] == 1
    # the same run of the job, another step that squeue still lists: a second live step, refused
    monkeypatch.setattr(slurm, "squeue", lambda args: "77.0\n77.batch\n")
    lock.write_text(_slurm_holder("77.0", 0))
    with pytest.raises(runlock.RunDirBusy) as info:
        runlock.acquire(str(tmp_path), environ={"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"})
    text = str(info.value)
    assert "in use by Slurm job 77 step 77.0, pid 1 on othernode" in text
    assert "another step of this job, still running" in text and "scancel 77.0" in text
    # ... and once squeue no longer lists that step, it is taken over
    monkeypatch.setattr(slurm, "squeue", lambda args: "77.batch\n")
    runlock.acquire(str(tmp_path), environ={"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"})
    assert json.loads(lock.read_text())["slurm_step"] == "77.1"
    # the batch step (mpirun in the job script) on another node lives as long as the job
    lock.write_text(_slurm_holder("77.batch", 0))
    with pytest.raises(runlock.RunDirBusy, match="in use by Slurm job 77 step 77.batch, pid 1 on othernode"):
        runlock.acquire(str(tmp_path), environ={"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1"})


STEP = textwrap.dedent("""
    import os, sys, time
    from hpctrain.job import runlock
    from hpctrain.errors import HpctrainError
    run_dir, name = sys.argv[1:3]
    try:
        path = runlock.acquire(run_dir)
    except HpctrainError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    open(os.path.join(run_dir, "owner-" + name), "w").write(os.environ["SLURM_STEP_ID"])
    for _ in range(300):  # hold it until the batch script says the other step is done
        if os.path.exists(os.path.join(run_dir, "go")):
            break
        time.sleep(0.1)
    runlock.release(path)
""")

BATCH = """#!/bin/bash
{python} {step} {run_dir} first &
for i in $(seq 300); do [ -e {run_dir}/owner-first ] && break; sleep 0.1; done
{python} {step} {run_dir} second
echo "second step exited $?"
touch {run_dir}/go
wait
"""


@pytest.mark.slurm
def test_second_step_of_one_allocation_on_the_same_run_dir_is_refused(slurm_cluster, tmp_path):
    # Two `srun` steps of one job: the same SLURM_JOB_ID, so not a requeued job, but a second
    # live step; it must stop before it touches the run directory.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    step = tmp_path / "step.py"
    step.write_text(STEP)
    srun = "srun --overlap -n1 -N1"
    batch = tmp_path / "two_steps.sh"
    batch.write_text(BATCH.format(python=f"{srun} {sys.executable}", step=step, run_dir=run_dir))
    env = slurm_cluster.env({"PYTHONPATH": str(ROOT)})
    job = slurm_cluster.run(["sbatch", "--parsable", "-n2", f"--output={tmp_path}/job.out", str(batch)],
                            env=env).stdout.strip()
    (record,) = slurm_cluster.wait(job, timeout=90)
    out = (tmp_path / "job.out").read_text()
    assert record["JobState"] == "COMPLETED", out
    assert "second step exited 2" in out, out
    assert (f"run directory {run_dir} is in use by Slurm job {job} step {job}.0, pid " in out
            and f" on {socket.gethostname()} since " in out), out
    assert "(another step of this job, still running)" in out and f"scancel {job}.0" in out, out
    assert (run_dir / "owner-first").read_text() == "0" and not (run_dir / "owner-second").exists()
    assert not (run_dir / runlock.LOCK_NAME).exists()  # the first step released it
