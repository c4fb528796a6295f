"""A Python training script as the job: `sbatch slurm/train.sbatch SCRIPT.py overrides` on a real
single-node Slurm cluster runs it with srun --mpi=pmix on every task, in the job's run directory."""
import re

import pytest

from mpi_harness import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_python_script_through_train_sbatch(slurm_cluster, tmp_path):
    env = slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs")})
    job = slurm_cluster.sbatch(ROOT / "slurm" / "train.sbatch", "examples/train_script.py", "train.epochs=1",
                               "monitor.log_every=10", env=env, options=[f"--output={tmp_path}/%x-%j.out"])
    (record,) = slurm_cluster.wait(job, 300)
    out = (tmp_path / f"hpctrain-{job}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out[-4000:]}"
    run_dir = tmp_path / "runs" / f"hpctrain-{job}"  # the job script's RUN_DIR, given to the script
    assert "2 ranks (srun)" in out and f"run directory: {run_dir}" in out, out
    assert "config examples/train_script.py" in out
    assert 'name = "spirals"' in (run_dir / "config.toml").read_text()  # the script's own defaults
    assert (run_dir / "checkpoints" / "latest").exists()


def test_user_model_config_through_preemptible_sbatch(slurm_cluster, tmp_path):
    """The README's first example: a TOML naming the user's model and data (here the byte GPT,
    tiny), run from slurm/preemptible.sbatch with a model.kwargs override; it trains, resumes
    nothing, checkpoints, and the resolved arguments are in the run's config.toml."""
    env = slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs")})
    job = slurm_cluster.sbatch(ROOT / "slurm" / "preemptible.sbatch", "examples/byte_gpt.toml",
                               f"data.kwargs.path={tmp_path}/bytes.h5", "data.kwargs.max_bytes=200000",
                               "model.kwargs.width=32", "model.kwargs.layers=1", "model.kwargs.heads=2",
                               "train.max_steps=10", "train.eval_every=10", "monitor.log_every=5",
                               env=env, options=[f"--output={tmp_path}/%x-%j.out"])
    (record,) = slurm_cluster.wait(job, 300)
    out = (tmp_path / f"hpctrain-preemptible-{job}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out[-4000:]}"
    assert "2 ranks (srun)" in out and "done at step 10" in out and "val_bits_per_byte" in out, out
    run_dir = tmp_path / "runs" / f"hpctrain-preemptible-{job}"
    assert '"width" = 32' in (run_dir / "config.toml").read_text()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "ckpt-00000010.h5"


def test_python_script_through_resilient_sbatch(slurm_cluster, tmp_path):
    """resilient.sbatch hands the script to `hpctrain launch`, which starts it with srun itself."""
    env = slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs")})
    job = slurm_cluster.sbatch(ROOT / "slurm" / "resilient.sbatch", "examples/train_script.py", "train.epochs=1",
                               env=env, options=[f"--output={tmp_path}/%x-%j.out"])
    (record,) = slurm_cluster.wait(job, 300)
    out = (tmp_path / f"hpctrain-resilient-{job}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", f"{record}\n{out[-4000:]}"
    run_dir = tmp_path / "runs" / f"hpctrain-resilient-{job}"
    assert re.search(r"starting 2 rank\(s\): srun --mpi=pmix .* examples/train_script.py checkpoint.resume=auto "
                     r"train.epochs=1 run.run_dir=", out), out
    assert f"run directory: {run_dir}" in out and (run_dir / "checkpoints" / "latest").exists(), out


def test_python_script_through_preemptible_sbatch_requeues_and_resumes(slurm_cluster, tmp_path):
    """The warning signal reaches the script's ranks; they save and exit 3; the job requeues
    itself and the script, started again with checkpoint.resume=auto, continues to the end."""
    env = slurm_cluster.env({"HPCTRAIN_RUN_ROOT": str(tmp_path / "runs")})
    job = slurm_cluster.sbatch(ROOT / "slurm" / "preemptible.sbatch", "examples/train_script.py", "train.epochs=20",
                               "monitor.progress=log", env=env, options=[f"--output={tmp_path}/%x-%j.out"])
    output = tmp_path / f"hpctrain-preemptible-{job}.out"
    slurm_cluster.wait_for(lambda: output.exists() and "step 20/" in output.read_text(), 300,
                           f"job {job} to reach step 20", poll=0.2)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
    (record,) = slurm_cluster.wait(job, 400)
    out = output.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", f"{record}\n{out[-4000:]}"
    stop = int(re.search(r"stop requested: saving at step (\d+)", out).group(1))
    assert "exit status 3" in out and f"requeueing Slurm job {job}" in out, out
    second = out.split("(start 2)")[1]
    assert f"at step {stop}" in second and "done at step 1120" in second, out  # 20 epochs x 56 steps
