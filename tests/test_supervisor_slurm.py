"""``hpctrain launch`` inside a real Slurm allocation (the single-node test cluster): the ranks
are started with ``srun --mpi=pmix``, one is SIGKILLed at a random step, srun's report names
the task and node, the supervisor relaunches with srun on the same allocation, and the run
trains the same samples to the same parameters as an uninterrupted one."""
import re

import pytest

from mpi_harness import PYTHON, ROOT
from test_supervisor_mpi import (RNG, STEPS, assert_same_training, metrics, overrides,  # noqa: F401
                                 reference, wrapper)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB_TIMEOUT = 300


def test_killed_task_is_relaunched_with_srun(slurm_cluster, tmp_path, digits, wrapper, reference):  # noqa: F811
    kill_step, kill_rank = RNG.randint(2, STEPS - 1), RNG.randrange(2)
    print(f"SIGKILL of task {kill_rank} at step {kill_step}")
    (tmp_path / "order").mkdir()
    script = tmp_path / "launch.sbatch"
    # --spares 0: the relaunch starts cold (the spares' srun step: test_slurm_resilient.py)
    args = " ".join(["--spares", "0", "--python", str(wrapper), "examples/digits.toml",
                     *overrides(tmp_path / "run", digits)])
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --ntasks=2\n#SBATCH --cpus-per-task=1\n"
                      f"cd {ROOT}\nexec {PYTHON} -m hpctrain launch {args}\n")
    env = slurm_cluster.env({"SUPERVISED_KILL_STEP": str(kill_step), "SUPERVISED_KILL_RANK": str(kill_rank),
                             "SUPERVISED_MARKER": str(tmp_path / "killed"),
                             "SUPERVISED_ORDER": str(tmp_path / "order")})
    job = slurm_cluster.sbatch(script, env=env, options=[f"--output={tmp_path}/job.out"])
    (record,) = slurm_cluster.wait(job, JOB_TIMEOUT)
    out = (tmp_path / "job.out").read_text()
    print(out[-4000:])
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out[-4000:]}"
    assert "starting 2 rank(s): srun --mpi=pmix --kill-on-bad-exit=1 -n 2" in out
    assert "relaunching 2 rank(s): srun --mpi=pmix" in out and "done after 1 restart(s)" in out
    (restart,) = metrics(tmp_path / "run", "restart")
    assert (restart["cause"], restart["rank"], restart["signal"], restart["source"]) == ("signal", kill_rank, 9, "srun")
    assert (restart["ranks_before"], restart["ranks_after"]) == (2, 2)
    assert restart["host"] and f"task {kill_rank}: Killed" in out
    # the other task, waiting in a collective for the dead one, ended at once, not after Slurm's KillWait
    assert re.search(rf"task {kill_rank} of step {job}\.\d+ died of signal 9: the step's other tasks on this node "
                     rf"are ended now", out), out[-4000:]
    assert_same_training(tmp_path, reference)
