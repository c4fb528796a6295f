"""A split model from the shipped job script: ``sbatch slurm/train.sbatch
examples/pipeline_mlp.toml`` on a real single-node Slurm cluster, 4 tasks as 2 pipeline
stages x 2 replicas averaging over Horovod process sets; the checkpoints are the split
model's (global tensors, the layout recorded) and verify."""
import subprocess
from pathlib import Path

import h5py
import pytest

from mpi_harness import PYTHON, ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_pipeline_config_runs_as_a_slurm_job(slurm_cluster, tmp_path, digits):
    # A step that hangs dumps every rank's stack into the job's output and ends the job,
    # which the failure then shows (steps here take well under a second).
    env = slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs"), "HPCTRAIN_WATCHDOG_TIMEOUT": "90"})
    job = slurm_cluster.sbatch(ROOT / "slurm" / "train.sbatch", "examples/pipeline_mlp.toml",
                               f"data.path={digits}", "train.max_steps=6", "checkpoint.every_steps=3",
                               "monitor.log_every=3", env=env,
                               options=[f"--output={tmp_path}/%x-%j.out", "--ntasks-per-node=4"])
    (record,) = slurm_cluster.wait(job, 300)
    (out_file,) = tmp_path.glob(f"*-{job}.out")
    out = out_file.read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out[-4000:]}"
    assert "4 ranks (srun)" in out and "2 stage(s) x 2 replica(s) x 1 tensor-parallel" in out
    assert "replicas average over Horovod process sets, compression fp16" in out
    assert "done at step 6" in out
    run_dir = tmp_path / "runs" / f"{record['JobName']}-{job}"
    directory = Path(run_dir) / "checkpoints"
    final = directory / (directory / "latest").read_text().strip()
    assert final.name == "ckpt-00000006.h5"
    with h5py.File(final, "r") as f:
        assert '"stages": 2' in f.attrs["parallel_layout"]
        assert f["model/1.q_proj.weight"].shape == (32, 32)  # the whole model, whatever the layout
    check = subprocess.run([PYTHON, "-m", "hpctrain", "ckpt", "verify", str(final)], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert check.returncode == 0 and "ok" in check.stdout, check.stdout + check.stderr
