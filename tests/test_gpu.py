"""GPU paths, run for real where a GPU is (``scripts/gpu-check.sh``), and what a machine
without one can check of them: the check script stops at once with the fix, and the
benchmark refuses to run on CPUs. The GPU tests are skipped (not passed) elsewhere."""
import json
import os
import shutil
import subprocess

import pytest

from mpi_harness import PYTHON, ROOT, hpctrain, mpirun


def _cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


needs_gpu = pytest.mark.skipif(not _cuda(), reason="no CUDA GPU here (scripts/gpu-check.sh runs these on one)")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU driver is installed here")
def test_gpu_check_stops_where_there_is_no_gpu():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no NVIDIA GPU is visible here" in proc.stderr and "HINT: run it on a GPU node" in proc.stderr
    assert not (ROOT / ".venv-gpu").exists()  # nothing was built


@pytest.mark.skipif(_cuda(), reason="a GPU is here")
def test_gpu_benchmark_refuses_cpus(tmp_path):
    proc = subprocess.run([PYTHON, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(tmp_path / "g.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "no CUDA device here" in proc.stderr
    assert not (tmp_path / "g.json").exists()


# ---------------------------------------------------------------- on a GPU
PINNED = ("from hpctrain.runtime.world import init_world; import torch; w = init_world(); "
          "print('pinned', w.rank, w.local_size, w.device, torch.cuda.current_device(), flush=True)")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_ranks_are_pinned_to_gpus_also_when_they_outnumber_them(ranks):
    import torch

    gpus = torch.cuda.device_count()
    out = mpirun(ranks, ["-c", PINNED], timeout=120, check=True).stdout
    pinned = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("pinned"))
    assert len(pinned) == ranks
    for rank, local_size, device, current in pinned:
        index = int(rank) % gpus  # one node: local rank = rank
        assert device == f"cuda:{index}" and int(current) == index


def _gpus():
    import torch

    return torch.cuda.device_count()


def _horovod_nccl():
    try:
        import horovod.torch as hvd

        return bool(hvd.nccl_built())
    except Exception:
        return False


TRAIN = [str(ROOT / "examples" / "digits.toml"), "train.max_steps=6", "train.epochs=1"]


def _trains_six_steps(ranks, backend, tmp_path, digits):
    run_dir = tmp_path / "run"
    hpctrain(ranks, "train", *TRAIN, f"data.path={digits}", f"run.run_dir={run_dir}", f"comm.backend={backend}",
             timeout=300, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 6 for r in records)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["mpi", "horovod"])
def test_training_with_one_rank_per_gpu(tmp_path, digits, backend):
    _trains_six_steps(_gpus(), backend, tmp_path, digits)


@pytest.mark.gpu
@needs_gpu
def test_training_with_ranks_sharing_gpus_through_host_memory(tmp_path, digits):
    _trains_six_steps(2 * _gpus(), "mpi", tmp_path, digits)


@pytest.mark.gpu
@needs_gpu
def test_horovod_on_nccl_refuses_ranks_sharing_a_gpu_on_every_rank(tmp_path, digits):
    if not _horovod_nccl():
        pytest.skip("this Horovod was built without NCCL")
    ranks = 2 * _gpus()
    proc = hpctrain(ranks, "train", *TRAIN, f"data.path={digits}", f"run.run_dir={tmp_path / 'run'}",
                    "comm.backend=horovod", timeout=300)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert said.count("some ranks share a GPU") >= ranks, said[-3000:]
    assert 'comm.backend = "mpi"' in said and "one rank per GPU" in said


@pytest.mark.gpu
@needs_gpu
def test_fp16_with_a_grad_scaler_trains_saves_and_resumes(tmp_path, digits):
    import h5py

    run_dir = tmp_path / "run"
    common = [str(ROOT / "examples" / "digits.toml"), f"data.path={digits}", f"run.run_dir={run_dir}",
              "comm.backend=mpi", "train.precision=fp16", "train.epochs=1"]
    hpctrain(2, "train", *common, "train.max_steps=4", timeout=300, check=True)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    with h5py.File(run_dir / "checkpoints" / os.path.basename(latest), "r") as f:
        trainer = json.loads(f["trainer"].attrs["scaler"]) if "scaler" in f["trainer"].attrs else None
    assert trainer and trainer["scale"] > 0  # the GradScaler's state is in the checkpoint
    out = hpctrain(2, "train", *common, "train.max_steps=8", timeout=300, check=True).stdout
    assert "resumed" in out.lower() and "step 8" in out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_horovod_averages_cuda_tensors(compression):
    code = ("import torch; from hpctrain.runtime.world import init_world; from hpctrain.backends import get_backend; "
            "w = init_world(); b = get_backend('horovod', w, compression=%r); "
            "m = torch.nn.Linear(64, 64, bias=False).to(w.device); "
            "o = b.distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.0), m); "
            "m.weight.grad = torch.full_like(m.weight, float(w.rank + 1)); b.synchronize(o); "
            "print('mean', float(m.weight.grad.mean()), m.weight.grad.device.type, flush=True); b.close()"
            % compression)
    ranks = _gpus()  # NCCL: one rank per GPU
    out = mpirun(ranks, ["-c", code], timeout=180, check=True).stdout
    means = [line.split() for line in out.splitlines() if line.startswith("mean")]
    expected = (ranks + 1) / 2  # the mean of 1..ranks
    assert len(means) == ranks and all(float(v) == pytest.approx(expected) and dev == "cuda" for _, v, dev in means)
