"""comm.shard under a real mpirun: sharded training equals replicated training (both
backends, SGD with momentum and AdamW, accumulation, clipping, bf16, fp16 on the wire);
checkpoints of sharded runs are ordinary files that resume on other rank counts with or
without sharding; a rank killed during a sharded save leaves `latest` valid; bad settings
fail on every rank."""
import json
import re

import h5py
import numpy as np
import pytest

from mpi_harness import ROOT, have_horovod, mpirun

pytestmark = [pytest.mark.mpi]

SCRIPTS = ROOT / "tests" / "mpi"
TRAIN = SCRIPTS / "sharding_train.py"
RESAVE = SCRIPTS / "sharding_resave.py"
TIMEOUT = 240
ADAMW = ["train.optimizer=adamw", "train.lr=0.01", "train.weight_decay=0.05"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["horovod", "mpi"])
def test_sharded_equals_replicated_on_4_ranks(tmp_path, backend):
    if backend == "horovod" and not have_horovod():
        pytest.skip("Horovod is not installed (make setup)")
    result = mpirun(4, [SCRIPTS / "sharding_equivalence.py", tmp_path, backend], timeout=TIMEOUT).check()
    same = re.findall(r"^SAME (.+) max\|diff\|", result.stdout, re.M)
    modes = ["optimizer", "gradients", "optimizer reduce_scatter", "gradients reduce_scatter"]
    assert same == [f"{o} {m}" for o in ("sgd", "adamw") for m in modes] + [
        "adamw bf16 gradients", "adamw fp16-wire gradients", "adamw fp16-wire reduce_scatter gradients"] + [
        f"{o} {m}" for o in ("adamw-matrices", "grouped") for m in ("optimizer", "gradients reduce_scatter")], \
        result.stdout[-3000:]
    assert "EQUIVALENCE OK" in result.stdout


def _params(directory, ranks):
    found = [np.load(directory / f"rank{r}.npz") for r in range(ranks)]
    return [[f[k] for k in sorted(f.files) if k.startswith("p")] for f in found]


def _assert_same_params(a, b, ranks):
    """Every rank of run ``a`` ends with the parameters of run ``b``'s, bit for bit."""
    for pa, pb in zip(_params(a, ranks), _params(b, ranks)):
        for x, y in zip(pa, pb):
            np.testing.assert_array_equal(x, y)


def _content(path):
    """Every dataset (bytes, shape, dtype, attributes) and group's attributes, but rank 0's
    generator states, which differ from launch to launch."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if name.startswith("trainer/rng"):
                return
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj[()].tobytes(), obj.shape, obj.dtype.str, dict(obj.attrs))
            else:
                out[name] = dict(obj.attrs)
        f.visititems(visit)
    return out


def _tensors(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset)
                     and n.split("/")[0] in ("model", "optimizer") else None)
    return out


@pytest.mark.slow
def test_sharded_checkpoints_resume_on_any_rank_count_with_or_without_sharding(tmp_path):
    # 4 ranks sharded, checkpoints at steps 5 and 10, written in the background
    u = tmp_path / "u"
    mpirun(4, [TRAIN, u, "comm.shard=optimizer", "checkpoint.every_steps=5", "checkpoint.keep_last=0",
               "checkpoint.async_save=true", *ADAMW], timeout=TIMEOUT).check()
    at5, at10 = u / "checkpoints" / "ckpt-00000005.h5", u / "checkpoints" / "ckpt-00000010.h5"
    # the same rank count and mode, resumed at step 5: bit for bit where the run went on
    a = tmp_path / "a"
    mpirun(4, [TRAIN, a, "comm.shard=optimizer", f"checkpoint.resume={at5}", *ADAMW], timeout=TIMEOUT).check()
    _assert_same_params(a, u, 4)
    # ... and its final checkpoint, saved in the foreground, holds the same bytes as the background one
    assert _content(a / "checkpoints" / "ckpt-00000010.h5") == _content(at10)
    # replicated on 2 ranks (mpi backend), resumed from the sharded file: the same within
    # float tolerance (a different order of the sums), and its file holds the same tensors
    b = tmp_path / "b"
    mpirun(2, [TRAIN, b, "comm.backend=mpi", f"checkpoint.resume={at5}", *ADAMW], timeout=TIMEOUT).check()
    for x, y in zip(_params(b, 2)[0], _params(u, 4)[0]):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    replicated = b / "checkpoints" / "ckpt-00000010.h5"
    tu, tb = _tensors(at10), _tensors(replicated)
    assert sorted(tu) == sorted(tb)
    for name in tu:
        assert tu[name].shape == tb[name].shape and tu[name].dtype == tb[name].dtype, name
        np.testing.assert_allclose(tu[name], tb[name], rtol=1e-3, atol=1e-6, err_msg=name)
    # loaded and saved again at once: the same bytes, whatever wrote and whatever reads
    mpirun(1, [RESAVE, at10, tmp_path / "one.h5", "none"], timeout=TIMEOUT).check()
    mpirun(2, [RESAVE, at10, tmp_path / "two.h5", "optimizer", "mpi"], timeout=TIMEOUT).check()
    mpirun(4, [RESAVE, replicated, tmp_path / "four.h5", "gradients"], timeout=TIMEOUT).check()
    sharded_content, replicated_content = _content(at10), _content(replicated)
    assert _content(tmp_path / "one.h5") == sharded_content
    assert _content(tmp_path / "two.h5") == sharded_content
    assert _content(tmp_path / "four.h5") == replicated_content
    # hpctrain ckpt export gives the plain state dict of the sharded run's model
    import subprocess
    import sys

    import torch

    subprocess.run([sys.executable, "-m", "hpctrain", "ckpt", "export", str(at10), "--to", str(tmp_path / "sd.pt")],
                   check=True, timeout=120, cwd=ROOT, capture_output=True)
    exported = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert sorted(f"model/{k}" for k in exported) == sorted(k for k in tu if k.startswith("model/"))
    for key, tensor in exported.items():
        np.testing.assert_array_equal(tensor.numpy(), tu[f"model/{key}"])


def test_parameter_groups_shard_checkpoint_and_resume_as_replicated_ones(tmp_path):
    """Two groups (weights decayed, biases not) over 4 ranks: rank 3's slice holds the end of the
    weights and the whole of the second group, the other ranks none of it. A resume on the same ranks is bit
    for bit; the file is the replicated format (resaved replicated on 1 rank: the same bytes; resumed
    replicated on 2 ranks: the same training)."""
    groups = [*ADAMW, "train.weight_decay_on=matrices"]
    u = tmp_path / "u"
    mpirun(4, [TRAIN, u, "comm.shard=gradients", "checkpoint.every_steps=5", "checkpoint.keep_last=0", *groups],
           timeout=TIMEOUT).check()
    at5, at10 = u / "checkpoints" / "ckpt-00000005.h5", u / "checkpoints" / "ckpt-00000010.h5"
    with h5py.File(at10, "r") as f:
        saved = json.loads(f["optimizer"].attrs["param_groups"])
        steps = {name: int(f["optimizer/state"][name]["step"][()]) for name in f["optimizer/state"]}
    assert [(g["weight_decay"], g["params"]) for g in saved] == [
        (0.05, ["1.weight", "3.weight", "5.weight"]), (0.0, ["1.bias", "3.bias", "5.bias"])], saved
    assert set(steps.values()) == {10} and len(steps) == 6, steps  # every parameter's state, each group's step
    a = tmp_path / "a"
    mpirun(4, [TRAIN, a, "comm.shard=gradients", f"checkpoint.resume={at5}", *groups], timeout=TIMEOUT).check()
    _assert_same_params(a, u, 4)
    assert _content(a / "checkpoints" / "ckpt-00000010.h5") == _content(at10)
    mpirun(1, [RESAVE, at10, tmp_path / "one.h5", "none", "mpi", "train.weight_decay_on=matrices"],
           timeout=TIMEOUT).check()
    assert _content(tmp_path / "one.h5") == _content(at10)
    b = tmp_path / "b"
    mpirun(2, [TRAIN, b, "comm.backend=mpi", f"checkpoint.resume={at5}", *groups], timeout=TIMEOUT).check()
    for x, y in zip(_params(b, 2)[0], _params(u, 4)[0]):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    # a replicated file of two groups read into 3 sharded ranks and saved again: the same bytes
    replicated = b / "checkpoints" / "ckpt-00000010.h5"
    mpirun(3, [RESAVE, replicated, tmp_path / "three.h5", "optimizer", "mpi", "train.weight_decay_on=matrices"],
           timeout=TIMEOUT).check()
    assert _content(tmp_path / "three.h5") == _content(replicated)
    # the groups are part of what a resume checks: one group where the file has two is refused, with the fix
    refused = mpirun(2, [TRAIN, tmp_path / "c", "comm.shard=optimizer", f"checkpoint.resume={at5}", *ADAMW],
                     timeout=TIMEOUT)
    assert refused.returncode != 0
    assert "parameter groups differ from the checkpoint's (file: [3, 3] parameters per group, now: [6])" in \
        refused.output, refused.output[-3000:]


@pytest.mark.slow
def test_rank_killed_during_sharded_save_leaves_latest_valid(tmp_path):
    from hpctrain.checkpoint import verify_checkpoint

    args = [SCRIPTS / "fail_inject.py", TRAIN, tmp_path, "comm.shard=gradients", "checkpoint.every_steps=2",
            "train.max_steps=6", *ADAMW]
    # 14 dataset writes per save on rank 1 (counted with FAIL_COUNT=1): kill it half-way
    # through the save of step 4
    killed = mpirun(2, args, timeout=TIMEOUT, env={"FAIL_RANK": "1", "FAIL_AT": "h5write:21", "FAIL_ACTION": "kill"}, fresh=True)
    assert killed.returncode != 0
    assert "fail_inject: rank 1: kill at h5write call 21" in killed.stderr, killed.stderr[-3000:]
    directory = tmp_path / "checkpoints"
    assert (directory / "latest").read_text().strip() == "ckpt-00000002.h5"
    assert not (directory / "ckpt-00000004.h5").exists()
    assert not verify_checkpoint(str(directory / "ckpt-00000002.h5"))
    resumed = mpirun(2, args, timeout=TIMEOUT).check()
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert "DONE step 6" in resumed.stdout
    assert (directory / "latest").read_text().strip() == "ckpt-00000006.h5"
    assert not verify_checkpoint(str(directory / "ckpt-00000006.h5"))
    assert not [p.name for p in directory.iterdir() if ".tmp" in p.name]


def test_bad_shard_settings_fail_on_every_rank():
    result = mpirun(2, [SCRIPTS / "train_errors.py", "comm.shard=zero3"], timeout=120)
    assert result.returncode != 0
    lines = re.findall(r"^rank (\d): ConfigError: (.*)$", result.stdout, re.M)
    assert sorted(r for r, _ in lines) == ["0", "1"], result.output[-3000:]
    assert all("comm.shard = 'zero3' is not one of none, optimizer, gradients" in m for _, m in lines)


def test_nonfinite_verdict_is_shared_by_every_slice_and_rollback_reloads_the_slices(tmp_path):
    """The last rank's NaN loss at step 5 poisons every slice's averaged gradients: every rank
    agrees (one all-reduced flag), names the first tensor, rolls back to step 4's checkpoint
    (each rank re-reading its slice) and finishes with identical parameters."""
    import json

    args = [SCRIPTS / "nonfinite_train.py", tmp_path, "--bad", "5", "--checkpoints", "train.on_nonfinite=rollback",
            "comm.shard=gradients", "train.optimizer=adamw", "train.lr=0.01"]
    result = mpirun(2, args, timeout=TIMEOUT)
    assert result.returncode == 0, result.output[-4000:]
    info = json.loads((tmp_path / "result.json").read_text())
    assert info["result"]["steps"] == 12
    assert info["extra"] == {"nonfinite_rollbacks": 1, "lr_factor": 0.5}
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for rank in ranks:
        assert list(rank["steps"]) == list(range(1, 13))
        assert np.isfinite(rank["params"]).all()
    assert ranks[0]["params"].tobytes() == ranks[1]["params"].tobytes()
    assert re.search(r"step 5: non-finite gradients \(first: \S*weight \(NaN\)", result.output), result.output[-3000:]


@pytest.mark.parametrize("backend", ["horovod", "mpi"])
def test_nonfinite_in_one_slice_only_is_skipped_by_every_rank(tmp_path, backend):
    if backend == "horovod" and not have_horovod():
        pytest.skip("Horovod is not installed (make setup)")
    result = mpirun(2, [SCRIPTS / "sharding_nonfinite.py", tmp_path, "comm.shard=optimizer",
                        f"comm.backend={backend}"], timeout=TIMEOUT)
    assert result.returncode == 0, result.output[-4000:]
    assert re.search(r"step 5: non-finite gradients \(first: 5\.bias \(NaN\)", result.output), result.output[-3000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for rank in ranks:
        assert list(rank["steps"]) == list(range(1, 9))
        params = dict(zip(rank["steps"], rank["params"]))
        assert params[5].tobytes() == params[4].tobytes()  # step 5 not applied, on either rank
        assert params[6].tobytes() != params[5].tobytes()
    assert ranks[0]["params"].tobytes() == ranks[1]["params"].tobytes()


def test_sharded_save_without_parallel_hdf5_fails_on_every_rank(tmp_path):
    result = mpirun(2, [TRAIN, tmp_path, "comm.shard=optimizer", "train.max_steps=2", "comm.backend=mpi"],
                    timeout=TIMEOUT, env={"HPCTRAIN_CKPT_SERIAL": "1"}, per_rank=True)
    assert result.returncode != 0
    for rank, output in enumerate(result.ranks):
        said = output.count("CheckpointError: comm.shard needs parallel HDF5 to save")
        assert said == 1, f"rank {rank}:\n{output[-3000:]}"
    assert not (tmp_path / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_example_trains_sharded_and_resumes_on_other_rank_counts(tmp_path):
    """examples/large_mlp.toml (shrunk) through `hpctrain train`: sharded on 4 ranks, then the
    same run directory resumed on 2 ranks sharded the other way, then on 1 rank replicated."""
    from hpctrain.checkpoint import verify_checkpoint
    from mpi_harness import hpctrain

    small = ["model.hidden=32", "model.depth=2", f"data.path={tmp_path}/teacher.h5", "data.samples=1024",
             "data.val_samples=128", "train.batch_size=16", "train.eval_every=0", "monitor.progress=log",
             f"run.run_dir={tmp_path}/run", "train.warmup_steps=0"]
    first = hpctrain(4, "train", "examples/large_mlp.toml", "comm.shard=optimizer", "train.max_steps=3", *small,
                     timeout=TIMEOUT).check()
    assert "done at step 3" in first.stdout
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not verify_checkpoint(str(checkpoints / "ckpt-00000003.h5"))
    second = hpctrain(2, "train", "examples/large_mlp.toml", "comm.shard=gradients", "comm.backend=mpi",
                      "train.max_steps=5", *small, timeout=TIMEOUT).check()
    assert "resumed from" in second.stdout and "at step 3" in second.stdout and "done at step 5" in second.stdout
    third = hpctrain(1, "train", "examples/large_mlp.toml", "train.max_steps=6", *small, timeout=TIMEOUT).check()
    assert "at step 5" in third.stdout and "done at step 6" in third.stdout
    assert (checkpoints / "latest").read_text().strip() == "ckpt-00000006.h5"


@pytest.mark.parametrize("backend", ["horovod", "mpi"])
def test_flat_collectives_on_uneven_parts_including_an_empty_one(backend):
    if backend == "horovod" and not have_horovod():
        pytest.skip("Horovod is not installed (make setup)")
    result = mpirun(3, [SCRIPTS / "flat_collectives.py", backend], timeout=120).check()
    assert f"FLAT OK {backend}" in result.stdout
    if backend == "horovod":  # the GPU path's broadcasts, run on CPU tensors
        assert "allgather_by_broadcasts" in result.stdout
