"""Slurm without training: the job scripts' guard, launch detection under a real srun,
requeue (plain job, array task, scontrol missing), and the run directory lock between jobs.
The end-to-end training jobs are in test_slurm_jobs.py."""
import json
import os
import subprocess
import textwrap

import pytest

from mpi_harness import PYTHON, ROOT

SCRIPTS = sorted((ROOT / "slurm").glob("*.sbatch"))


def test_every_job_script_refuses_to_run_outside_slurm():
    assert {p.name for p in SCRIPTS} >= {"train.sbatch", "train-mpirun.sbatch",
                                         "preemptible.sbatch", "sweep.sbatch"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for script in SCRIPTS:
        proc = subprocess.run(["bash", str(script), "examples/digits.toml"], capture_output=True,
                              text=True, timeout=30, env=env, cwd=ROOT)
        assert proc.returncode == 2, (script.name, proc.stdout, proc.stderr)
        assert "must run inside a job" in proc.stderr and f"sbatch {script}" in proc.stderr
        assert proc.stdout == ""  # nothing started


def test_job_scripts_document_themselves_and_keep_site_lines_commented():
    for script in SCRIPTS:
        text = script.read_text()
        header = text.split("#SBATCH", 1)[0]
        assert "sbatch slurm/" in header, f"{script.name}: no usage line at the top"
        for site in ("--account", "--partition", "--gres=gpu"):
            assert f"##SBATCH {site}" in text, f"{script.name}: {site} line missing or active"
        assert "module load" in text


PROBE = textwrap.dedent("""
    import json, os, sys
    from hpctrain.errors import LaunchError
    from hpctrain.runtime.world import init_world, launch_info
    before = launch_info()
    env = sorted(k for k in os.environ if k.startswith("OMPI_COMM_WORLD"))
    try:
        world = init_world(pin=False)
    except LaunchError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    print(json.dumps({"launcher": before.launcher, "rank": world.rank, "size": world.size,
                      "ompi_vars_before_init": env,
                      "launch_info_after_init": launch_info().launcher}), flush=True)
""")


@pytest.mark.slurm
def test_srun_with_pmix_is_detected_as_srun(slurm_cluster):
    """Open MPI under `srun --mpi=pmix` sets no OMPI_COMM_WORLD_* before or after MPI_Init,
    so world.launch_info() says srun, and the world has the ranks srun started."""
    proc = slurm_cluster.run(["srun", "--mpi=pmix", "-n", "2", PYTHON, "-c", PROBE], timeout=120)
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        assert row["size"] == 2 and row["launcher"] == "srun"
        assert row["ompi_vars_before_init"] == [] and row["launch_info_after_init"] == "srun"


@pytest.mark.slurm
@pytest.mark.parametrize("n", [1, 2])
def test_srun_without_pmix_gets_the_fix_before_mpi_init(slurm_cluster, n):
    """Plain srun (no MPI plug-in): Open MPI's MPI_Init would die with its own message; hpctrain
    stops first and names the flag."""
    proc = slurm_cluster.run(["srun", "--mpi=none", "-n", str(n), PYTHON, "-c", PROBE],
                             timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("HINT: launch with `srun --mpi=pmix ...`") == n, proc.stderr
    assert f"{n} task(s)" in proc.stderr
    assert "OMPI was not built with SLURM's PMI support" not in proc.stderr  # MPI never started


@pytest.mark.slurm
def test_requeue_without_scontrol_fails_clearly(slurm_cluster, tmp_path):
    # PATH with python but without Slurm's commands, inside a real job step
    (tmp_path / "bin").mkdir()
    os.symlink(PYTHON, tmp_path / "bin" / "python")
    proc = slurm_cluster.run(["srun", "-n", "1", "env", f"PATH={tmp_path / 'bin'}", f"PYTHONPATH={ROOT}",
                              "python", "-m", "hpctrain.job.preemption", "requeue"], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "cannot requeue Slurm job" in proc.stderr and "`scontrol` is not on PATH" in proc.stderr
    assert "HINT:" in proc.stderr


REQUEUE_ONCE = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
# first start: ask hpctrain to requeue this job; second start: finish
echo "start ${SLURM_RESTART_COUNT:-0} of ${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID:-}"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
  "$PY" -m hpctrain.job.preemption requeue || exit 9
  sleep 30
  exit 8   # not reached: requeueing ends the job
fi
echo done
"""


@pytest.mark.slurm
@pytest.mark.parametrize("array", [False, True])
def test_requeue_helper_puts_the_job_back(slurm_cluster, tmp_path, array):
    script = tmp_path / "requeue_once.sbatch"
    script.write_text(REQUEUE_ONCE)
    options = [f"--output={tmp_path}/%j.out" if not array else f"--output={tmp_path}/%A_%a.out",
               "--ntasks=1"] + (["--array=0-1"] if array else [])
    env = slurm_cluster.env({"PY": PYTHON, "PYTHONPATH": str(ROOT)})
    job = slurm_cluster.sbatch(script, options=options, env=env)
    records = slurm_cluster.wait(job, timeout=180)
    assert len(records) == (2 if array else 1)
    for record in records:
        assert record["JobState"] == "COMPLETED", record
        assert record["Restarts"] == "1", record
    outputs = sorted(tmp_path.glob("*.out"))
    assert len(outputs) == len(records)
    for out in outputs:
        text = out.read_text()
        # each task requeued itself (the array task by its <array>_<task> name), not the array
        assert text.count("requeueing Slurm job") == 1 and text.count("done") == 1, text
        if array:
            assert f"requeueing Slurm job {out.stem}" in text, text


HOLD = textwrap.dedent("""
    import sys, time
    from hpctrain.job import runlock
    from hpctrain.errors import HpctrainError
    try:
        runlock.acquire(sys.argv[1])
        print("holding", flush=True)
        open(sys.argv[1] + "/owner", "w").write(sys.argv[2])
        time.sleep(float(sys.argv[3]))
        runlock.release(sys.argv[1])
    except HpctrainError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
""")


@pytest.mark.slurm
def test_second_job_on_a_busy_run_dir_fails_clearly(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    hold = tmp_path / "hold.py"
    hold.write_text(HOLD)
    env = slurm_cluster.env({"PYTHONPATH": str(ROOT)})
    first = slurm_cluster.run(["sbatch", "--parsable", "-n1", f"--output={tmp_path}/first.out",
                               "--wrap", f"{PYTHON} {hold} {run_dir} first 8"], env=env).stdout.strip()
    slurm_cluster.wait_for(lambda: (run_dir / "owner").exists(), 60, "the first job to take the lock")
    second = slurm_cluster.run(["sbatch", "--parsable", "-n1", f"--output={tmp_path}/second.out",
                                "--wrap", f"{PYTHON} {hold} {run_dir} second 0"], env=env).stdout.strip()
    (rec2,) = slurm_cluster.wait(second, timeout=60)
    assert rec2["JobState"] == "FAILED" and rec2["ExitCode"].startswith("2:"), rec2
    err = (tmp_path / "second.out").read_text()
    assert f"run directory {run_dir} is in use by Slurm job {first}" in err
    assert "HINT: give this run its own directory" in err
    assert (run_dir / "owner").read_text() == "first"  # nothing overwritten
    (rec1,) = slurm_cluster.wait(first, timeout=60)
    assert rec1["JobState"] == "COMPLETED"
    assert not (run_dir / ".hpctrain.lock").exists()  # released at the end
