"""The node-local checkpoint level with real ranks (mpirun): random SIGKILLs resume bit for bit from it
(synchronous and background HDF5 saves); a part that is lost or damaged sends the run back to the snapshot
before, and with that one damaged too to the HDF5 file, saying the steps it costs; a sharded run's snapshot
becomes the very file an HDF5 save would have written, and resumes on fewer ranks; two ranks as two nodes, one
node's part recovered from its copy on the other (on real nodes under Slurm: test_slurm_multinode.py)."""
import random
import re
import shutil
import sys

import numpy as np
import pytest
import torch

from checkpoint_files import tensors
from mpi_harness import ROOT, mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SCRIPTS = ROOT / "tests" / "mpi"
STEPS = 30
RUN_TIMEOUT = 120
RECOVERED = re.compile(r"hpctrain: recovered step (\d+) from the node-local checkpoints on (\S+) "
                       r"\(the newest HDF5 checkpoint is of step (\d+)\)")


def run(directory, local_dir, env=None, async_save=False, ranks=2, nodes=None):
    """``nodes``: the node each rank stands on (``SLURMD_NODENAME``, through tests/mpi/as_node.py)."""
    env = dict(env or {}, **({"NODES": ",".join(nodes)} if nodes else {}))
    args = ([SCRIPTS / "as_node.py"] if nodes else []) + [
            SCRIPTS / "fail_inject.py", SCRIPTS / "ckpt_train.py", directory, STEPS, "every_steps=10",
            "local_every=3", f"local_dir={local_dir}", "resume=auto"] + (["async_save=1"] if async_save else [])
    return mpirun(ranks, args, timeout=RUN_TIMEOUT, env=env, fresh=True)


def assert_same_final(a_dir, b_dir):
    sys.path.insert(0, str(SCRIPTS))
    import ckpt_common as cc

    a = torch.load(a_dir / "final.pt", weights_only=False)
    b = torch.load(b_dir / "final.pt", weights_only=False)
    cc._same(a["model"], b["model"], "model")
    cc._same(a["optimizer"], b["optimizer"], "optimizer")
    assert a["progress"] == b["progress"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_random_sigkills_resume_bit_for_bit_from_the_local_level(tmp_path, async_save):
    """Kills at random steps (and at renames: the parts' and the checkpoints'), each run resuming from what
    the last left; the chain ends where an uninterrupted run ends, and resumes came from the local level."""
    local = tmp_path / "local"
    local.mkdir()
    whole = tmp_path / "whole"
    run(whole, local, async_save=async_save).check()
    assert not any(local.iterdir()), "the snapshots outlived a run that ended with a checkpoint"
    rng = random.Random(26 + async_save)
    plan = [(rng.randrange(2), "backward", rng.randrange(2, 9)) for _ in range(3)]  # a launch each
    plan.insert(2, (1, "replace", rng.randrange(1, 4)))  # a part's rename (rank 1 renames nothing else)
    parts, recovered = tmp_path / "parts", []
    for rank, point, n in plan:
        result = run(parts, local, env={"FAIL_RANK": str(rank), "FAIL_AT": f"{point}:{n}", "FAIL_ACTION": "kill"},
                     async_save=async_save)
        assert result.returncode != 0, f"not killed at {point}:{n}\n{result.output[-3000:]}"
        recovered += RECOVERED.findall(result.stdout)
    final = run(parts, local, async_save=async_save).check()
    recovered += RECOVERED.findall(final.stdout)
    print(f"kills {plan}; recovered (step, nodes, hdf5 step): {recovered}")
    assert "DONE step 30" in final.stdout
    assert recovered and all(int(s) > int(h) for s, _, h in recovered), (recovered, final.stdout[-3000:])
    assert_same_final(whole, parts)
    assert not any(local.iterdir())
    assert not [p.name for p in (parts / "checkpoints").iterdir() if ".tmp" in p.name]


def killed_after_a_snapshot(tmp_path, local):
    """A run killed in step 18: HDF5 checkpoint of step 10, local snapshots 3 steps after either level's
    save: steps 13 and 16, both kept (the one before the newest stays)."""
    parts = tmp_path / "parts"
    result = run(parts, local, env={"FAIL_RANK": "1", "FAIL_AT": "backward:18", "FAIL_ACTION": "kill"})
    assert result.returncode != 0, result.output[-3000:]
    (node,) = [p for p in next(local.iterdir()).iterdir()]
    assert sorted(p.name for p in node.iterdir()) == ["step-00000013", "step-00000016"]
    assert sorted(p.name for p in (node / "step-00000016").iterdir()) == ["part-00000.bin", "part-00001.bin"]
    return parts, node


def test_a_lost_nodes_part_comes_from_its_copy_on_the_next_node(tmp_path):
    """Two ranks on two nodes (as slurmd names them): each snapshot's part is also copied to the next node, so
    with rank 1's node gone (its directory removed after a kill) the resume takes that part from the copy and
    ends where an uninterrupted run ends. (On real nodes under Slurm: test_slurm_multinode.py.)"""
    local, nodes = tmp_path / "local", ("nodeA", "nodeB")
    local.mkdir()
    parts = tmp_path / "parts"
    killed = run(parts, local, env={"FAIL_RANK": "1", "FAIL_AT": "backward:18", "FAIL_ACTION": "kill"}, nodes=nodes)
    assert killed.returncode != 0, killed.output[-3000:]
    (key,) = local.iterdir()
    assert sorted(p.name for p in key.iterdir()) == list(nodes)
    on_a = key / "nodeA" / "step-00000016"
    assert sorted(p.name for p in on_a.iterdir()) == ["part-00000.bin", "part-00001.bin"]  # its own, B's copy
    shutil.rmtree(key / "nodeB")
    resumed = run(parts, local, nodes=nodes).check()
    assert re.search(r"hpctrain: recovered step 16 from the node-local checkpoints on nodeA \(the newest HDF5 "
                     r"checkpoint is of step 10\), .*; the part\(s\) of rank\(s\) 1 from their copies",
                     resumed.stdout), resumed.output[-3000:]
    assert "DONE step 30" in resumed.stdout
    whole = tmp_path / "whole"
    run(whole, tmp_path / "local", nodes=nodes).check()
    assert_same_final(whole, parts)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run of run() that nothing stops (its final state)."""
    base = tmp_path_factory.mktemp("uninterrupted")
    (base / "local").mkdir()
    run(base / "run", base / "local").check()
    return base / "run"


def flip_a_bit(part):
    """A flipped bit in a part's rows: its end mark is in place, its checksum fails."""
    data = bytearray(part.read_bytes())
    data[40] ^= 0x01
    part.write_bytes(bytes(data))


@pytest.mark.parametrize("loss", ["deleted", "damaged", "both damaged"])
def test_a_lost_part_falls_back_to_the_snapshot_before_then_to_the_hdf5_file(tmp_path, loss, uninterrupted):
    """Rank 1's part of the newest snapshot (16) deleted or damaged (one node: no copy elsewhere): the run
    resumes from the snapshot before (13); with that one damaged too, from the HDF5 file (10), saying the cost."""
    local = tmp_path / "local"
    local.mkdir()
    parts, node = killed_after_a_snapshot(tmp_path, local)
    newest = node / "step-00000016" / "part-00001.bin"
    if loss == "deleted":  # both copies gone: on one node there is only the one
        newest.unlink()
    else:
        flip_a_bit(newest)
    if loss == "both damaged":
        flip_a_bit(node / "step-00000013" / "part-00001.bin")
    resumed = run(parts, local).check()
    print(resumed.stdout[-2000:], resumed.stderr[-2000:])
    if loss != "deleted":
        assert re.search(r"the node-local part \S+step-00000016/part-00001.bin of step 16 is damaged \(.*the bytes "
                         r"of /\S+ do not match their checksum\); looking for its copy or an older snapshot",
                         resumed.output), resumed.output[-3000:]
    if loss == "both damaged":
        assert ("hpctrain: the node-local checkpoint of step 16 is incomplete: the parts of rank(s) 1 survive intact "
                "on no node of the job (nor any copy of them); resuming from the HDF5 checkpoint of step 10 "
                "instead: 6 steps to compute again") in resumed.stdout
        assert "ckpt-00000010.h5 at step 10" in resumed.stdout and not RECOVERED.search(resumed.stdout)
    else:
        assert [(s, h) for s, _, h in RECOVERED.findall(resumed.stdout)] == [("13", "10")], resumed.stdout[-3000:]
        assert ("step 16 passed over: the part(s) of rank(s) 1 survive intact nowhere") in resumed.stdout
    assert "DONE step 30" in resumed.stdout
    assert_same_final(uninterrupted, parts)


def test_sharded_snapshot_is_the_file_an_hdf5_save_writes_and_resumes_on_fewer_ranks(tmp_path, digits):
    """4 ranks with comm.shard=optimizer killed after the snapshot of step 25: it is promoted to
    ckpt-00000025.h5, equal in every tensor to the checkpoint an uninterrupted run saved at step 25, and the
    run resumes from it on 2 ranks."""
    common = ["examples/digits.toml", f"data.path={digits}", "data.val=none", "monitor.progress=log",
              "comm.backend=mpi", "comm.shard=optimizer", "train.optimizer=adamw", "train.lr=0.01",
              "train.global_batch_size=64", "train.max_steps=40", "checkpoint.on_epoch_end=false"]
    reference = tmp_path / "reference"
    mpirun(4, ["-m", "hpctrain", "train", *common, f"run.run_dir={reference}", "checkpoint.every_steps=25"],
           timeout=RUN_TIMEOUT).check()
    local, run_dir = tmp_path / "local", tmp_path / "run"
    local.mkdir()
    args = [*common, f"run.run_dir={run_dir}", "checkpoint.every_steps=20", "checkpoint.local=true",
            "checkpoint.local_every_steps=5", f"checkpoint.local_dir={local}"]
    killed = mpirun(4, [SCRIPTS / "fail_inject.py", "-m", "hpctrain", "train", *args], timeout=RUN_TIMEOUT,
                    env={"FAIL_RANK": "2", "FAIL_AT": "backward:27", "FAIL_ACTION": "kill"}, fresh=True)
    assert killed.returncode != 0 and "node-local checkpoints in" in killed.stdout, killed.output[-3000:]
    resumed = mpirun(2, ["-m", "hpctrain", "train", *args], timeout=RUN_TIMEOUT).check()
    found = RECOVERED.search(resumed.stdout)
    assert found and found.groups()[0::2] == ("25", "20"), resumed.stdout[-3000:]
    assert "ckpt-00000025.h5 at step 25" in resumed.stdout
    ours = tensors(run_dir / "checkpoints" / "ckpt-00000025.h5")
    theirs = tensors(reference / "checkpoints" / "ckpt-00000025.h5")
    assert sorted(ours) == sorted(theirs) and any("exp_avg" in k for k in ours)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and np.array_equal(ours[name], theirs[name]), name
    assert "done at step 40" in resumed.stdout


def test_the_defaults_take_node_local_snapshots_where_they_can_and_say_so(tmp_path, digits):
    """No checkpoint.local set ("auto"): the first lines say the level is on, a snapshot is taken and removed
    at the end; with a local_dir that is no directory the run says the level is off and trains all the same;
    checkpoint.local = true with it is bad input, on every rank."""
    common = ["examples/digits.toml", f"data.path={digits}", "data.val=none", "monitor.progress=log",
              "train.max_steps=12", "checkpoint.local_every_steps=4"]
    local = tmp_path / "local"
    local.mkdir()
    on = mpirun(2, ["-m", "hpctrain", "train", *common, f"run.run_dir={tmp_path / 'on'}",
                    f"checkpoint.local_dir={local}"], timeout=RUN_TIMEOUT).check()
    assert f"hpctrain: node-local checkpoints: on, in {local} while their snapshots fit in half" in on.stdout
    assert f"hpctrain: node-local checkpoints in {local}/hpctrain-" in on.stdout, on.stdout[-3000:]
    assert "done at step 12" in on.stdout and not any(local.iterdir())
    nowhere = tmp_path / "nowhere"
    off = mpirun(2, ["-m", "hpctrain", "train", *common, f"run.run_dir={tmp_path / 'off'}",
                     f"checkpoint.local_dir={nowhere}"], timeout=RUN_TIMEOUT).check()
    assert (f"hpctrain: node-local checkpoints: off (checkpoint.local = \"auto\"): checkpoint.local_dir = "
            f"'{nowhere}' is not a writable directory on") in off.stdout, off.stdout[-3000:]
    assert "done at step 12" in off.stdout and "node-local checkpoints in" not in off.stdout
    bad = mpirun(2, ["-m", "hpctrain", "train", *common, f"run.run_dir={tmp_path / 'bad'}", "checkpoint.local=true",
                     f"checkpoint.local_dir={nowhere}"], timeout=RUN_TIMEOUT)
    assert bad.returncode == 2 and "is not a writable directory on" in bad.stderr, bad.output[-3000:]
    assert "Traceback" not in bad.output and "MPI_ABORT" not in bad.output  # every rank ended alike
    assert not nowhere.exists()
