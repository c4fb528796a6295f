"""Pipeline, tensor and hybrid parallelism under a real ``mpirun -n 4``: the same numbers
as one process, bitwise-equal replicas, checkpoints across layouts, clear failures."""
import pytest

from assertions import ranks_say
from mpi_harness import PYTHON, ROOT, command, mpi_env, mpirun

pytestmark = pytest.mark.mpi

SCRIPTS = ROOT / "tests" / "mpi"
TIMEOUT = 150


@pytest.mark.parametrize("args", [
    ["--stages", "4", "--schedule", "gpipe"],
    ["--stages", "4", "--schedule", "1f1b"],
    ["--stages", "2", "--tensor", "2", "--schedule", "gpipe", "--balance", "time"],
], ids=["pipeline-gpipe", "pipeline-1f1b", "pipeline-x-tensor-time-balanced"])
def test_pipeline_matches_single_process(args):
    result = mpirun(4, [SCRIPTS / "parallel_train.py", *args, "--tol", "1e-5"], timeout=TIMEOUT).check()
    ranks_say(result, "MATCH", 4)


@pytest.mark.smoke  # (on 4 ranks, as every test of split models)
def test_tensor_parallel_matches_single_process():
    result = mpirun(4, [SCRIPTS / "parallel_train.py", "--tensor", "4", "--tol", "1e-5"], timeout=TIMEOUT).check()
    ranks_say(result, "MATCH", 4)


@pytest.mark.parametrize("args,tol", [
    (["--stages", "2", "--schedule", "1f1b"], "1e-5"),
    (["--stages", "2", "--compression", "fp16"], "1e-2"),
    (["--tensor", "2", "--schedule", "gpipe", "--micro", "3"], "1e-5"),
], ids=["2stages-x-2replicas", "2stages-x-2replicas-fp16", "2tensor-x-2replicas"])
def test_hybrid_replicas_stay_identical(args, tol):
    result = mpirun(4, [SCRIPTS / "parallel_train.py", *args, "--tol", tol], timeout=TIMEOUT).check()
    ranks_say(result, "MATCH", 4)
    ranks_say(result, "REPLICAS IDENTICAL", 4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoint written by 2 stages x 2 replicas after 3 SGD (momentum) steps."""
    d = tmp_path_factory.mktemp("parallel-ckpt")
    result = mpirun(4, [SCRIPTS / "parallel_ckpt.py", "save", d, "--stages", "2"], timeout=TIMEOUT).check()
    ranks_say(result, "SAVED", 4)
    return d


@pytest.mark.parametrize("args", [["--stages", "4"], ["--stages", "1"], ["--stages", "2", "--tensor", "2"],
                                  ["--tensor", "4"]],
                         ids=["4x1", "1x4-data-parallel", "2x1-tensor2", "1x1-tensor4"])
def test_checkpoint_loads_in_another_layout(saved, args):
    result = mpirun(4, [SCRIPTS / "parallel_ckpt.py", "load", saved, *args], timeout=TIMEOUT).check()
    ranks_say(result, "LOADED SAME", 4)


def test_checkpoint_is_the_ordinary_format(saved):
    import subprocess

    path = saved / "ckpt-00000003.h5"
    env = mpi_env()
    out = subprocess.run([PYTHON, SCRIPTS / "parallel_ckpt.py", "plain", saved], capture_output=True, text=True,
                         timeout=TIMEOUT, env=env, cwd=ROOT)
    assert out.returncode == 0 and "PLAIN LOADED SAME" in out.stdout, out.stdout + out.stderr
    out = command("ckpt", "verify", path)
    assert out.returncode == 0, out.stdout + out.stderr
    # Global shapes, whatever the layout: attention projections are [16, 16], the MLP's fc1 [32, 16].
    import h5py

    with h5py.File(path, "r") as f:
        assert f["model/2.q_proj.weight"].shape == (16, 16)
        assert f["model/3.fc1.weight"].shape == (32, 16)
        assert f["optimizer/state/3.fc2.weight/momentum_buffer"].shape == (16, 32)
        assert '"stages": 2' in f.attrs["parallel_layout"]


def test_checkpoint_into_a_different_model_fails_clearly(saved):
    result = mpirun(4, [SCRIPTS / "parallel_ckpt.py", "load", saved, "--stages", "2", "--width", "24"],
                    timeout=TIMEOUT)
    assert result.returncode != 0
    ranks_say(result, "LOAD FAILED CheckpointError", 4)
    assert "does not fit this model" in result.stderr
    assert "/model/0.weight: this layout needs a tensor of shape [24, 8], the file has [16, 8]" in result.stderr


def test_checkpoint_of_diverged_replicas_fails_or_repairs(tmp_path):
    result = mpirun(4, [SCRIPTS / "parallel_ckpt.py", "diverged", tmp_path, "--stages", "2"], timeout=TIMEOUT).check()
    ranks_say(result, "SAVE FAILED ranks 3 hold model tensors that differ from rank 1's", 4)
    ranks_say(result, "REPAIRED", 4)
    assert "copying rank 1's to every rank" in result.stderr


@pytest.mark.parametrize("case,message", [
    ("indivisible", "4 ranks cannot be divided into replicas of 3 stage(s)"),
    ("replicas", "needs 6 ranks, but the job has 4"),
    ("layers", "cannot split a model of 3 layer(s) into 4 pipeline stages"),
    ("width", "is 6, which does not split evenly over 4 tensor-parallel ranks"),
    ("balance", "pipeline balance [5, 2] does not give every stage"),
])
def test_misconfigured_layout_fails_on_every_rank(case, message):
    result = mpirun(4, [SCRIPTS / "parallel_misconfig.py", case], timeout=60)
    assert result.returncode != 0
    ranks_say(result, "ERROR ConfigError", 4)
    assert message in result.stderr
    assert "HINT:" in result.stderr
