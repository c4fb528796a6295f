"""slurm/resilient.sbatch on the real single-node Slurm cluster: a rank SIGKILLed mid-run is
relaunched by `hpctrain launch` inside the same allocation (no requeue, no resubmission) and
the job finishes; a warning signal still checkpoints and requeues, as preemptible.sbatch does; scancel saves
the step the ranks reached."""
import json
import re

import pytest

from mpi_harness import PYTHON, ROOT
from checkpoint_files import latest
from test_slurm_jobs import ckpt_verify, output_of, wait_for_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB_TIMEOUT = 300
STEPS = 40

# HPCTRAIN_VENV stand-in: the ranks (`-m hpctrain train`) run tests/mpi/supervised_rank.py,
# which kills one rank once at a chosen step; everything else (the supervisor, the requeue
# helper) runs the plain python.
VENV_PYTHON = f"""#!/bin/bash
if [ "$1 $2 $3" = "-m hpctrain train" ]; then exec {PYTHON} {ROOT}/tests/mpi/supervised_rank.py "$@"; fi
exec {PYTHON} "$@"
"""


def job_env(cluster, tmp_path, **extra):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(VENV_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    return cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs"), "HPCTRAIN_VENV": str(venv), **extra})


def submit(cluster, env, tmp_path, args):
    return cluster.sbatch(ROOT / "slurm" / "resilient.sbatch", "examples/digits.toml", *args, env=env,
                          options=[f"--output={tmp_path}/%x-%j.out"])


def test_killed_rank_is_relaunched_inside_the_allocation(slurm_cluster, tmp_path, digits):
    """With the defaults, warm spares: a step of the allocation beside the training one, up before the kill
    (the rank waits for their ready file), called for the relaunch on the same node. The killed rank's survivor
    (asked by hpctrain launch once srun reports the death) writes the state of the last step it finished: the
    relaunch resumes from it, no step lost."""
    marker = tmp_path / "killed"
    env = job_env(slurm_cluster, tmp_path, SUPERVISED_KILL_STEP="17", SUPERVISED_KILL_RANK="1",
                  SUPERVISED_MARKER=str(marker),
                  SUPERVISED_KILL_AFTER=str(tmp_path / "runs" / "*" / ".spares" / "*.ready"))
    job = submit(slurm_cluster, env, tmp_path, [f"data.path={digits}", f"train.max_steps={STEPS}",
                                                 "checkpoint.every_steps=5", "monitor.log_every=10"])
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out}"
    assert record["Restarts"] == "0", record  # never requeued: relaunched within the allocation
    killed = re.fullmatch(r"rank 1 killed at step 17; spare niceness (\d+)\n", marker.read_text())
    assert killed and killed.group(1) != "19", marker.read_text()  # under srun a set is not lowered (slurmd's tasks)
    assert "supervised_rank: rank 1: SIGKILL at step 17" in out
    assert re.search(r"hpctrain launch: warm spares ready: 2 rank\(s\) holding \d+ MiB resident", out), out
    assert "hpctrain launch: calling the warm spares 2 rank(s): srun --mpi=pmix --kill-on-bad-exit=1 -n 2 " \
           "--overlap" in out, out
    assert "a failed rank costs the step in flight: a rank that survives it writes the state of its last step to " \
           "the node-local level before the launch ends (hpctrain launch asks it once srun reports the failure)" in out
    # rank 1 died as step 17 began: rank 0 had finished step 16 (a checkpoint file every 5 steps: 15)
    assert re.search(r"hpctrain launch: rank 0, a survivor, wrote the state of step 16 to the node-local level", out), out
    assert "resuming from step 16 (a survivor's state), 0 step(s) lost" in out, out
    assert "recovered step 16 from the node-local checkpoints" in out and "at step 16" in out, out
    assert f"done at step {STEPS}" in out and "hpctrain launch: done after 1 restart(s)" in out, out
    assert "(start 2)" not in out and "requeued" not in out

    run_dir = tmp_path / "runs" / f"hpctrain-resilient-{job}"
    final = latest(run_dir)
    assert final.name == f"ckpt-{STEPS:08d}.h5"
    check = ckpt_verify(final)
    assert check.returncode == 0, check.stdout + check.stderr
    restarts = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if r.get("kind") == "restart"]
    assert len(restarts) == 1, restarts
    assert (restarts[0]["kept_step"], restarts[0]["resume_step"], restarts[0]["steps_lost"]) == (16, 16, 0), restarts
    starts = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "start"]
    assert [s["spare"] for s in starts] == [False, True], starts


def test_warning_signal_checkpoints_and_requeues_through_the_supervisor(slurm_cluster, tmp_path, digits):
    env = job_env(slurm_cluster, tmp_path)
    steps = 150
    job = submit(slurm_cluster, env, tmp_path, [f"data.path={digits}", f"train.max_steps={steps}",
                                                 "checkpoint.every_steps=2", "checkpoint.keep_last=2",
                                                 "monitor.log_every=10"])
    wait_for_step(slurm_cluster, tmp_path, job, 30)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", f"{record}\n{out}"
    first, second = out.split("(start 2)")
    stop = int(re.search(r"stop requested: saving at step (\d+)", first).group(1))
    assert "exit status 3" in first and f"requeueing Slurm job {job}" in first, out
    assert "relaunching" not in first, out  # a requested stop is passed on, not relaunched
    assert f"resumed from" in second and f"done at step {steps}" in second, out
    assert latest(tmp_path / "runs" / f"hpctrain-resilient-{job}").name == f"ckpt-{steps:08d}.h5"
    assert stop < steps


def test_scancel_saves_the_step_reached_and_ends_the_job(slurm_cluster, tmp_path, digits):
    """scancel (SIGTERM to the job script, the supervisor and every rank; SIGKILL KillWait seconds later): the
    ranks save the step they reached, in a run that saves nowhere else, and the job ends without a requeue."""
    env = job_env(slurm_cluster, tmp_path)
    job = submit(slurm_cluster, env, tmp_path, [f"data.path={digits}", "train.epochs=100000", "train.max_steps=100000",
                                                 "checkpoint.on_epoch_end=false", "monitor.log_every=10"])
    wait_for_step(slurm_cluster, tmp_path, job, 20)
    slurm_cluster.run(["scancel", job])
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", f"{record}\n{out}"
    stop = int(re.search(r"stop requested: saving at step (\d+)", out).group(1))
    assert stop >= 20 and "relaunching" not in out and "requeueing" not in out, out
    final = latest(tmp_path / "runs" / f"hpctrain-resilient-{job}")
    assert final.name == f"ckpt-{stop:08d}.h5", final
    check = ckpt_verify(final)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("status, state", [(0, "COMPLETED"), (3, "FAILED")])
def test_a_job_ended_on_its_scripts_behalf_shows_the_status_given(slurm_cluster, tmp_path, status, state):
    """slurm.complete_job, as the standby ends a job whose script died with the first node: the job ends as
    its script would have with that status (sacct, afterok), not CANCELLED as scancel would leave it."""
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    job = slurm_cluster.sbatch(script, options=[f"--output={tmp_path}/%j.out"])
    slurm_cluster.wait_for(lambda: any(r.get("JobState") == "RUNNING" for r in slurm_cluster.jobs(job)),
                           JOB_TIMEOUT, f"job {job} to start")
    done = slurm_cluster.run([PYTHON, "-c", f"from hpctrain.runtime import slurm; print(slurm.complete_job({job!r}, "
                                            f"{status}))"], timeout=60)
    assert done.stdout.strip() == "True", done.stdout + done.stderr
    (record,) = slurm_cluster.wait_for(lambda: slurm_cluster.completions(job), JOB_TIMEOUT, f"job {job} to end")
    assert (record["JobState"], record["ExitCode"]) == (state, f"{status}:0"), record  # as Slurm logs the end
