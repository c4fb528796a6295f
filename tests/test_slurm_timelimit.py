"""slurm/preemptible.sbatch under a real time limit (``sbatch --time=1 --signal=B:USR1@5``):
the warning comes from slurmctld, not from scancel. A start warned with time to spare saves and
requeues; a start warned while its ranks are still starting is named as such, with the numbers,
and the job stops requeueing instead of burning its requeues one step at a time. A rank that
dies of the forwarded signal (status 138) is requeued all the same.

Slurm checks time limits every 30 s and sends the warning up to 30 s (sbatch(1): 60 s) before
the lead asks: with a lead of 5 s it comes 25-55 s into a start, after start-up here."""
import re
import textwrap

import pytest

from mpi_harness import PYTHON, ROOT
from checkpoint_files import latest
from test_slurm_jobs import ckpt_verify, output_of

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB_TIMEOUT = 300

# Stands in for the venv's python. `-m hpctrain ...` runs the real command; on the starts from
# SLOW_START_FROM on, the import of the training module (torch, mpi4py, MPI start: the slow part
# of start-up, after hpctrain.cli.main installed the stop handler) is held until this rank got
# the warning, as on a cluster whose start-up outlasts the time before the warning. SLOW_STEP
# seconds are added to every backward pass, so that a run lasts past the warning.
WRAPPER = textwrap.dedent('''
    import importlib.abc, os, runpy, sys, time

    SLOW_FROM = int(os.environ.get("SLOW_START_FROM", "0"))
    STEP_SLEEP = float(os.environ.get("SLOW_STEP", "0"))
    START = int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "hpctrain.commands.train":
                return None
            sys.meta_path.remove(self)
            from hpctrain.job import preemption
            if SLOW_FROM and START >= SLOW_FROM:
                t0 = time.monotonic()
                while not preemption.stop_requested() and time.monotonic() - t0 < 200:
                    time.sleep(0.1)
                time.sleep(2)
                print(f"slow start: held {time.monotonic() - t0:.0f} s, warned: {preemption.stop_requested()}",
                      flush=True)
            if STEP_SLEEP:
                import torch
                backward = torch.Tensor.backward
                def slow_backward(self, *args, **kwargs):
                    time.sleep(STEP_SLEEP)
                    return backward(self, *args, **kwargs)
                torch.Tensor.backward = slow_backward
            return None

    if sys.argv[1:2] == ["-m"]:
        module = sys.argv[2]
        sys.argv = [module] + sys.argv[3:]
        if module == "hpctrain":
            sys.meta_path.insert(0, Hook())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(sys.argv[1], run_name="__main__")
''')


def make_venv(tmp_path, body):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(body)
    python.chmod(0o755)
    return venv


def slow_venv(tmp_path):
    wrapper = tmp_path / "slow_start.py"
    wrapper.write_text(WRAPPER)
    return make_venv(tmp_path, f"#!/bin/bash\nexec {PYTHON} {wrapper} \"$@\"\n")


def stopped_saved(text):
    """The ranks ended as a saved stop does: status 3, or 143 where srun's --kill-on-bad-exit ended a rank that
    was still exiting after another rank's 3 (seen under load; the save had been made, as checked beside)."""
    return "exit status 3" in text or ("exit status 143" in text and "Exited with exit code 3" in text)


def test_real_time_limit_requeues_then_stops_on_a_start_warned_while_starting(slurm_cluster, tmp_path, digits):
    env = slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs"), "HPCTRAIN_VENV": str(slow_venv(tmp_path)),
                             "SLOW_STEP": "0.05", "SLOW_START_FROM": "2", "HPCTRAIN_MAX_STALLED_STARTS": "1"})
    args = [f"data.path={digits}", "train.epochs=100000", "train.max_steps=1000000",
            "checkpoint.every_steps=100000", "checkpoint.keep_last=2", "monitor.log_every=100"]
    job = slurm_cluster.sbatch(ROOT / "slurm" / "preemptible.sbatch", "examples/digits.toml", *args, env=env,
                               options=[f"--output={tmp_path}/%x-%j.out", "--time=1", "--signal=B:USR1@5"])
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    first, second = out.split("(start 2)")

    # start 1: warned by the time limit with the ranks well under way: saved, requeued
    assert "SIGUSR1: asking the ranks to checkpoint and stop" in first, out
    saved = int(re.search(r"stop requested: saving at step (\d+)", first).group(1))
    assert saved > 20, out  # many steps ran before the warning
    assert stopped_saved(first) and f"requeueing Slurm job {job}" in first, out
    assert "before it could make progress" not in first, out

    # start 2: start-up outlasted the time to the warning; the ranks kept the early flag
    # (no status 138), resumed, saved after one step, and the job named the problem and stopped
    assert f"resumed from" in second and "slow start: held" in second and "warned: True" in second, out
    assert f"stop requested: saving at step {saved + 1}" in second, out
    assert stopped_saved(second) and "requeueing Slurm job" not in second, out
    m = re.search(r"start 2 was warned before it could make progress: SIGUSR1 came (\d+) s after the launch, "
                  r"(-?\d+) s before the time limit \(--time 1:00\); start-up \(launch to run directory set up\) "
                  r"took (\d+) s; steps (\d+) -> (\d+)", second)
    assert m, out
    came, lead, startup, before, after = map(int, m.groups())
    assert came < startup and 0 < lead <= 5 + 60 and (before, after) == (saved, saved + 1), out
    assert "HINT: each start needs more time than its start-up plus the warning's lead: give it a longer --time " \
        "(now 1:00; Slurm may send the warning up to 60 s earlier" in second
    assert "not requeued again: 1 starts in a row" in second and "the run continues from step" in second, out
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "3:0" and record["Restarts"] == "1", record

    run_dir = tmp_path / "runs" / f"hpctrain-preemptible-{job}"
    final = latest(run_dir)
    assert final.name == f"ckpt-{saved + 1:08d}.h5"
    check = ckpt_verify(final)
    assert check.returncode == 0, check.stdout + check.stderr
    assert not (run_dir / ".hpctrain-stalled-starts").exists()  # a resubmission counts afresh


# A rank that dies of SIGUSR1 (no handler yet: the signal's default action), then one that finishes.
DIES_OF_THE_SIGNAL = """#!/bin/bash
if [ "$1 $2" = "-m hpctrain" ]; then
  if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then echo "fake rank $SLURM_PROCID starting"; exec sleep 120; fi
  echo "fake rank $SLURM_PROCID done"; exit 0
fi
exec %s "$@"
"""


def test_ranks_killed_by_the_forwarded_signal_are_requeued(slurm_cluster, tmp_path):
    venv = make_venv(tmp_path, DIES_OF_THE_SIGNAL % PYTHON)
    env = slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs"), "HPCTRAIN_VENV": str(venv)})
    job = slurm_cluster.sbatch(ROOT / "slurm" / "preemptible.sbatch", "examples/digits.toml", env=env,
                               options=[f"--output={tmp_path}/%x-%j.out"])

    def started():
        try:
            return output_of(tmp_path, job).count("starting") == 2
        except ValueError:
            return False
    slurm_cluster.wait_for(started, 120, "the fake ranks to start", poll=0.3)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = output_of(tmp_path, job)
    first, second = out.split("(start 2)")
    status = int(re.search(r"exit status (\d+)", first).group(1))
    assert status > 128, out  # the ranks died of the signal
    assert f"the ranks ended with status {status} after the stop was asked; requeueing all the same" in first
    assert "start 1 was warned before it could make progress" in first and "steps 0 -> 0" in first, out
    assert "the ranks never set up the run" in first and f"requeueing Slurm job {job}" in first, out
    assert second.count("done") == 2 and "exit status 0" in second, out
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", record
    assert not (tmp_path / "runs" / f"hpctrain-preemptible-{job}" / ".hpctrain-stalled-starts").exists()
