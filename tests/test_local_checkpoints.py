"""The node-local checkpoint level's pure logic: where copies go, which step a recovery takes, the part
files (complete, incomplete, damaged), and the configuration's refusals. Its runs with real MPI ranks are in
test_local_checkpoints_mpi.py and test_slurm_multinode.py."""
import os

import numpy as np
import pytest

from hpctrain.checkpoint.content import format as fmt
from hpctrain.checkpoint.local import files as localfiles
from hpctrain.checkpoint.local import level
from hpctrain.checkpoint.content.plan import DatasetPlan, WritePlan
from hpctrain.config import load_config, validate
from hpctrain.errors import ConfigError


@pytest.mark.parametrize("nodes, expected", [
    (["a", "a"], [None, None]),                      # one node: a copy there survives nothing more
    (["a", "b", "c"], [1, 2, 0]),                    # one rank per node: the next node's
    (["a", "a", "b", "b"], [2, 3, 0, 1]),            # same place among the next node's ranks
    (["a", "a", "a", "b"], [3, 3, 3, 0]),            # uneven: wraps round the smaller node
    (["b", "a", "b", "a"], [1, 0, 3, 2]),            # nodes in the order of their first rank
])
def test_partners_are_on_the_next_node(nodes, expected):
    dest = localfiles.partners(nodes)
    assert dest == expected
    for r, d in enumerate(dest):
        assert d is None or nodes[d] != nodes[r]


def part(step, owner, nranks=3, rank_copy=False):
    return (step, owner, nranks, f"/x/step-{step:08d}/part-{owner:05d}.bin", rank_copy)


def test_choose_takes_the_newest_complete_step_newer_than_the_hdf5_one():
    found = {0: [part(12, 0), part(12, 2, rank_copy=True), part(9, 0), part(9, 2, rank_copy=True)],
             1: [part(12, 1), part(9, 1), part(9, 0, rank_copy=True)], 2: []}
    step, chosen, skipped = localfiles.choose(found, newer_than=10)
    assert step == 12 and skipped == []
    assert {o: (r, c) for o, (r, _, c) in chosen.items()} == {0: (0, False), 1: (1, False), 2: (0, True)}
    assert localfiles.choose(found, newer_than=12)[0] is None  # the HDF5 file is as new: nothing to do


def test_choose_skips_an_incomplete_step_and_says_which_parts_are_missing():
    found = {0: [part(12, 0), part(9, 0), part(9, 2, rank_copy=True)], 1: [part(9, 1), part(12, 2)]}
    step, chosen, skipped = localfiles.choose(found, newer_than=0)
    assert step == 9 and skipped == [(12, [1])]
    assert sorted(chosen) == [0, 1, 2]
    step, _, skipped = localfiles.choose({0: [part(12, 0)]}, newer_than=5)
    assert step is None and skipped == [(12, [1, 2])]


def test_choose_passes_over_a_damaged_part_to_its_copy_then_to_an_older_step():
    own = (12, 1, 2, "/node-b/step-00000012/part-00001.bin", False)
    copy = (12, 1, 2, "/node-a/step-00000012/part-00001.bin", True)
    found = {0: [part(12, 0, 2), part(9, 0, 2), copy], 1: [own, part(9, 1, 2)]}
    step, chosen, _ = localfiles.choose(found, newer_than=0, damaged=[own[3]])
    assert step == 12 and chosen[1] == (0, copy[3], True)
    step, _, skipped = localfiles.choose(found, newer_than=0, damaged=[own[3], copy[3]])
    assert step == 9 and skipped == [(12, [1])]


def test_choose_spreads_the_reading_over_the_holders():
    everywhere = [part(4, o, nranks=4) for o in range(4)]
    step, chosen, _ = localfiles.choose({0: everywhere, 1: everywhere}, newer_than=0)
    assert step == 4 and sorted(r for r, _, _ in chosen.values()) == [0, 0, 1, 1]


def sample_plan(rank):
    """A two-rank plan: a matrix split by rows, a scalar on rank 0, a vector on rank 1."""
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    s = np.array(7, dtype=np.int64)
    v = np.arange(5, dtype=np.uint16)
    datasets = [
        DatasetPlan("model/w", w.shape, w.dtype, {fmt.DTYPE_ATTR: "float32"},
                    [(0, fmt.rows(w.shape, 0, 2)), (1, fmt.rows(w.shape, 2, 4))],
                    w[0:2] if rank == 0 else w[2:4], finite=True),
        DatasetPlan("trainer/s", s.shape, s.dtype, {fmt.DTYPE_ATTR: "int64"}, [(0, ())], s if rank == 0 else None),
        DatasetPlan("model/v", v.shape, v.dtype, {fmt.DTYPE_ATTR: "bfloat16"}, [(1, fmt.rows(v.shape, 0, 5))],
                    v if rank == 1 else None),
    ]
    return WritePlan(datasets, {"step": 3, "nranks": np.int64(2)}, {"trainer": {"epoch": 1}}), (w, s, v)


def test_a_part_file_round_trips_and_holds_only_its_rows(tmp_path):
    plan, (w, s, v) = sample_plan(1)
    path = localfiles.part_path(localfiles.node_dir(tmp_path, "n1"), 3, 1)
    size, bad = localfiles.write_part(path, plan, 1, 3, 2, tmp_path / "ckpt", "n1")
    assert bad == [] and size == (tmp_path / "n1" / "step-00000003" / "part-00001.bin").stat().st_size
    meta = localfiles.read_trailer(path)
    assert (meta["step"], meta["owner"], meta["nranks"], meta["node"]) == (3, 1, 2, "n1")
    assert meta["root_attrs"] == {"step": 3, "nranks": 2}
    pieces = localfiles.pieces(meta, localfiles.read_data(path, meta))
    assert [(i, region) for i, region, _ in pieces] == [(0, ((2, 4), (0, 3))), (2, ((0, 5),))]
    assert np.array_equal(pieces[0][2].view(np.float32).reshape(2, 3), w[2:4])
    assert np.array_equal(pieces[1][2].view(np.uint16), v)
    assert localfiles.scan_node(tmp_path / "n1", tmp_path / "ckpt") == [(3, 1, 2, path, False)]
    assert localfiles.scan_node(tmp_path / "n1", tmp_path / "other-run") == []  # another run's: not ours


def test_a_truncated_or_damaged_part_is_never_taken(tmp_path):
    plan, _ = sample_plan(0)
    ndir = localfiles.node_dir(tmp_path, "n1")
    path = localfiles.part_path(ndir, 3, 0)
    localfiles.write_part(path, plan, 0, 3, 2, tmp_path, "n1")
    data = bytearray(open(path, "rb").read())
    with open(path, "wb") as f:  # killed before the end mark
        f.write(data[:-5])
    with pytest.raises(localfiles.PartDamaged, match="incomplete"):
        localfiles.read_trailer(path)
    assert localfiles.scan_node(ndir, tmp_path) == []
    data[len(localfiles.MAGIC) + 3] ^= 0x40  # a flipped bit in the rows of model/w
    with open(path, "wb") as f:
        f.write(data)
    meta = localfiles.read_trailer(path)
    with pytest.raises(localfiles.PartDamaged, match="model/w do not match their checksum"):
        localfiles.read_data(path, meta)
    (tmp_path / "n1" / "step-00000003" / "part-00001.bin.tmp-99").write_bytes(b"half")  # a copy cut short
    assert [f[1] for f in localfiles.scan_node(ndir, tmp_path)] == [0]


def test_a_part_with_nan_is_reported_for_refusal(tmp_path):
    plan, _ = sample_plan(0)
    plan.datasets[0].mine = np.array([[1, np.nan, 3], [4, 5, 6]], dtype=np.float32)
    _, bad = localfiles.write_part(localfiles.part_path(tmp_path, 1, 0), plan, 0, 1, 2, tmp_path, "n1")
    assert bad == [0]


def test_remove_steps_keeps_what_it_is_told(tmp_path):
    for step in (3, 6, 9):
        (tmp_path / f"step-{step:08d}").mkdir()
    (tmp_path / "unrelated").mkdir()
    localfiles.remove_steps(tmp_path, lambda s: s >= 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000009", "unrelated"]


def test_clean_local_removes_this_nodes_snapshots_of_a_run_or_of_a_slurm_job(tmp_path, monkeypatch, capsys):
    """`hpctrain ckpt clean-local`: what a run killed for good leaves in /dev/shm, removed by run directory, or
    by Slurm job as an epilog would (on each node: SLURMD_NODENAME)."""
    from hpctrain.commands import ckpt

    local = tmp_path / "shm"
    local.mkdir()
    plan, _ = sample_plan(0)
    runs = {"a": "7", "b": "8", "c": None}  # run -> the Slurm job that wrote its snapshots (c: under mpirun)
    for name, job in runs.items():
        checkpoints = tmp_path / name / "checkpoints"
        checkpoints.mkdir(parents=True)
        for node in ("n1", "n2"):
            ndir = localfiles.node_dir(localfiles.base_dir(local, checkpoints), node)
            localfiles.write_part(localfiles.part_path(ndir, 3, 0), plan, 0, 3, 2, checkpoints, node)
            localfiles.mark_job(ndir, job)

    def left():
        return sorted(f"{name}/{node}" for name in runs for node in ("n1", "n2") if os.path.isdir(
            localfiles.node_dir(localfiles.base_dir(local, tmp_path / name / "checkpoints"), node)))

    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    assert ckpt.main(["clean-local", "--job", "7", "--local-dir", str(local)]) == 0
    assert "1 node-local snapshot directory of Slurm job 7 removed on n1" in capsys.readouterr().out
    assert left() == ["a/n2", "b/n1", "b/n2", "c/n1", "c/n2"]
    assert ckpt.main(["clean-local", str(tmp_path / "c"), "--local-dir", str(local)]) == 0
    assert left() == ["a/n2", "b/n1", "b/n2", "c/n2"]
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    assert ckpt.main(["clean-local", "--job", "7", "--local-dir", str(local)]) == 0
    assert left() == ["b/n1", "b/n2", "c/n2"]
    assert not os.path.exists(localfiles.base_dir(local, tmp_path / "a" / "checkpoints"))  # its last node gone
    capsys.readouterr()
    assert ckpt.main(["clean-local", "--local-dir", str(local)]) == 2
    assert "name a run directory or --job JOBID" in capsys.readouterr().err
    assert ckpt.main(["clean-local", "--job", "8", "--local-dir", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err and left() == ["b/n1", "b/n2", "c/n2"]


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.local=false", "checkpoint.local_every_steps=5"], "only used with checkpoint.local = true"),
    (["checkpoint.local=maybe"], 'checkpoint.local = .maybe. is not true, false or "auto"'),
    (["checkpoint.local=true", "checkpoint.local_every_steps=-1"], "local_every_steps"),
    (["checkpoint.local=true", "checkpoint.local_every_steps=5", "parallel.stages=2"], "not supported"),
])
def test_local_level_configuration_errors_name_the_fix(overrides, message):
    from mpi_harness import ROOT

    with pytest.raises(ConfigError, match=message):
        validate(load_config(ROOT / "examples" / "digits.toml", overrides, environ={}), world_size=4)


def test_the_local_level_is_auto_by_default_and_off_for_a_split_model_without_an_error():
    from mpi_harness import ROOT

    cfg = load_config(ROOT / "examples" / "digits.toml", ["parallel.stages=2", "parallel.micro_batches=2"],
                      environ={})
    assert cfg.checkpoint.local == "auto"
    validate(cfg, world_size=4)  # "auto" is off for a split model (training.setup says so), not an error
    assert load_config(ROOT / "examples" / "digits.toml", ["checkpoint.local=off"], environ={}).checkpoint.local is False


def test_auto_keeps_the_level_only_where_its_snapshots_fit_in_half_the_free_space():
    mib = 2**20
    nodes, dests = ["n1", "n1", "n2", "n2"], localfiles.partners(["n1", "n1", "n2", "n2"])
    # each node: 2 parts of its own and 2 copies, 3 snapshots of each: 12 MiB for 1-MiB parts
    assert level.short_of_room([(mib, 25 * mib)] * 4, nodes, dests, "/dev/shm") is None
    why = level.short_of_room([(mib, 25 * mib)] * 2 + [(mib, 23 * mib)] * 2, nodes, dests, "/dev/shm")
    assert why == "3 snapshots with their copies need 12.0 MiB of /dev/shm on n2, more than half of its 23.0 MiB free"
    # one node: no copies on another node, so only its own parts
    assert level.short_of_room([(mib, 13 * mib)] * 2, ["vm", "vm"], [None, None], "/tmp") is None


def _level_of(tmp_path, off=None):
    """What :func:`level.write_alone` reads of a level (pure logic: no MPI, no other rank)."""
    from types import SimpleNamespace

    return SimpleNamespace(off=off, ndir=str(tmp_path / "shm" / "n1"), checkpoint_dir=str(tmp_path / "ckpt"),
                           world=SimpleNamespace(node="n1"))


def test_a_survivor_writes_its_whole_state_alone_as_a_snapshot_of_one_part(tmp_path):
    import torch

    from hpctrain.state import Progress, TrainState

    model = torch.nn.Linear(4, 3)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), Progress(step=7))
    lv = _level_of(tmp_path)
    assert level.write_alone(lv, state) == (7, None)
    (found,) = localfiles.scan_node(lv.ndir, lv.checkpoint_dir)
    assert found[:3] == (7, 0, 1)  # step 7, owner 0 of 1 part: a recovery needs no other rank's
    step, chosen, _ = localfiles.choose({0: [found]}, 0)
    assert step == 7 and list(chosen) == [0]
    meta = localfiles.read_trailer(found[3])
    weight = next(d for d in meta["datasets"] if d["path"].endswith("weight"))
    assert weight["region"] == [[0, 3], [0, 4]]  # every row of it
    # a snapshot of that step there already (the ranks' own): left as it is
    assert level.write_alone(lv, state) == (7, "a snapshot of step 7 is there already")


def test_a_survivor_with_a_non_finite_parameter_or_no_level_keeps_nothing(tmp_path):
    import torch

    from hpctrain.state import Progress, TrainState

    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.bias[1] = float("nan")
    state = TrainState(model, None, Progress(step=5))
    lv = _level_of(tmp_path)
    step, why = level.write_alone(lv, state)
    assert step == 5 and "holds NaN or infinity" in why and "bias" in why
    assert localfiles.steps_on_node(lv.ndir) == []
    assert level.write_alone(_level_of(tmp_path, off="no room"), state) == (5, "the node-local level is off (no room)")


def test_survivors_keep_their_state_only_where_one_rank_holds_the_runs():
    import torch

    from hpctrain.job.survivor import unsuited

    cfg = load_config("examples/digits.toml", [])
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 3))
    assert unsuited(cfg, mlp, whole=True) is None
    assert "no rank holds the whole state" in unsuited(cfg, mlp, whole=False)
    assert "running_mean" in unsuited(cfg, torch.nn.Sequential(torch.nn.BatchNorm1d(3)), whole=True)
    local_sgd = load_config("examples/local_sgd.toml", [])
    assert unsuited(local_sgd, mlp, whole=True).startswith('comm.mode = "local_sgd"')


def test_a_task_of_an_srun_step_answers_the_supervisors_question_on_its_own_socket(tmp_path, monkeypatch):
    """Under srun (no warm pool): the task listens on its step's socket once hpctrain launch says it will ask
    (HPCTRAIN_SURVIVOR=srun); asked, it writes its state; the asking side passes over a task that does not listen."""
    import threading

    import torch

    from hpctrain.job import survivor
    from hpctrain.state import Progress, TrainState

    model = torch.nn.Linear(4, 3)
    state, lv = TrainState(model, None, Progress(step=9)), _level_of(tmp_path)
    job = f"t{os.getpid()}"
    for name, value in {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("HPCTRAIN_WARM_POOL", raising=False)
    monkeypatch.delenv("HPCTRAIN_SURVIVOR", raising=False)
    assert survivor.offer(lv, state, threading.Lock()) is None  # a bare srun: no one asks
    assert survivor.ask_step(job, "3", {0, 1}) == ([], None)
    monkeypatch.setenv("HPCTRAIN_SURVIVOR", "srun")
    assert survivor.offer(lv, state, threading.Lock()) == "hpctrain launch asks it once srun reports the failure"
    said, kept = survivor.ask_step(job, "3", {0, 1})  # task 0 does not listen: task 1 is asked
    assert kept == 9 and said[0].startswith("rank 1, a survivor, wrote the state of step 9"), said
    assert [found[0] for found in localfiles.scan_node(lv.ndir, lv.checkpoint_dir)] == [9]
