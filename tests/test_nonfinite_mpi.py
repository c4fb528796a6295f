"""Non-finite gradients under a real ``mpirun -n 2``: the last rank's loss is NaN at chosen steps
(tests/mpi/nonfinite_train.py), the average makes every rank's gradients NaN, and every rank
takes the same action: skip the update, roll back to the newest checkpoint, or stop naming the
step and the tensor. ``metrics.jsonl`` holds the event and stays valid JSON."""
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from hpctrain.checkpoint.content.format import checkpoint_name
from mpi_harness import hpctrain, mpirun, needs_horovod

pytestmark = pytest.mark.mpi

SCRIPT = "tests/mpi/nonfinite_train.py"


def launch(bad, *overrides, checkpoints=False):
    out = Path(tempfile.mkdtemp(prefix="hpctrain-nonfinite-"))
    args = [SCRIPT, out, "--bad", ",".join(map(str, bad))] + (["--checkpoints"] if checkpoints else [])
    # per_rank: each rank's own output; mpirun's merged streams can splice two ranks' lines together.
    result = mpirun(2, args + list(overrides), timeout=120, per_rank=True)
    ranks = [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]
    info = json.loads((out / "result.json").read_text())
    return result, ranks, info


def strict_records(run_dir):
    """Every line of metrics.jsonl, refusing the bare NaN/Infinity that json.loads accepts."""
    def refuse(name):
        raise AssertionError(f"bare {name} in metrics.jsonl")

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


def events(info):
    return [r for r in strict_records(info["run_dir"]) if r["kind"] == "nonfinite"]


def after(rank, step):
    """The parameters after ``step`` (its last occurrence: a rollback replays steps)."""
    (where,) = np.nonzero(rank["steps"] == step)
    return rank["params"][where[-1]]


@pytest.mark.parametrize("backend, compression", [
    pytest.param("horovod", "none", marks=needs_horovod),
    pytest.param("horovod", "fp16", marks=needs_horovod),
    ("mpi", "none"),
    ("mpi", "fp16"),
])
def test_skip_leaves_the_bad_step_unapplied_on_every_rank(backend, compression):
    result, ranks, info = launch([5], "train.on_nonfinite=skip", f"comm.backend={backend}",
                                 f"comm.compression={compression}")
    assert result.returncode == 0, result.output[-4000:]
    assert info["result"]["steps"] == 12
    for rank in ranks:
        assert list(rank["steps"]) == list(range(1, 13))
        assert np.isfinite(rank["params"]).all()
        # step 5's update was not applied: the parameters after it are those after step 4, bit for bit
        assert after(rank, 5).tobytes() == after(rank, 4).tobytes()
        assert after(rank, 6).tobytes() != after(rank, 5).tobytes()
    # the same verdict on both ranks: their replicas never part
    assert ranks[0]["params"].tobytes() == ranks[1]["params"].tobytes()
    (event,) = events(info)
    assert (event["step"], event["action"], event["policy"]) == (5, "skip", "skip")
    assert event["tensor"].endswith("weight (NaN)")
    assert "step 5: non-finite gradients (first: " in result.stdout + result.stderr


def test_rollback_continues_from_the_newest_checkpoint_with_a_lower_learning_rate():
    result, ranks, info = launch([5], "train.on_nonfinite=rollback", checkpoints=True)
    assert result.returncode == 0, result.output[-4000:]
    assert info["result"]["steps"] == 12
    (event,) = events(info)
    assert (event["step"], event["action"], event["to_step"], event["rollbacks"]) == (5, "rollback", 4, 1)
    assert info["extra"] == {"nonfinite_rollbacks": 1, "lr_factor": 0.5}
    for rank in ranks:
        # steps 1-4, then (step 5 rolled back before its callbacks) 5-12 again from step 4
        assert list(rank["steps"]) == list(range(1, 13))
        assert list(rank["lrs"][:4]) == [0.3] * 4 and np.allclose(rank["lrs"][4:], 0.15)
        assert np.isfinite(rank["params"]).all()
    assert ranks[0]["params"].tobytes() == ranks[1]["params"].tobytes()
    ckpts = Path(info["run_dir"]) / "checkpoints"
    for step in (2, 4, 6, 12):
        assert (ckpts / checkpoint_name(step)).is_file(), sorted(p.name for p in ckpts.iterdir())


def test_stop_names_the_step_and_tensor_on_every_rank_and_keeps_the_good_checkpoint():
    result, ranks, info = launch([5], "train.on_nonfinite=stop", checkpoints=True)
    assert result.returncode == 5, result.output[-4000:]
    for r in range(2):
        line = next(l for l in result.ranks[r].splitlines() if l.startswith(f"RANK {r} NONFINITE"))
        assert "training stopped at step 5: the averaged gradients are not finite; first non-finite " \
               "gradient: " in line and "weight (NaN)" in line, line
    assert "HINT: lower train.lr" in result.stdout and checkpoint_name(4) in result.stdout
    ckpts = Path(info["run_dir"]) / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == checkpoint_name(4)
    assert not (ckpts / checkpoint_name(5)).exists()
    (event,) = events(info)
    assert (event["step"], event["action"]) == (5, "stop")
    for rank in ranks:
        assert list(rank["steps"]) == [1, 2, 3, 4]


def test_default_skips_a_few_steps_then_rolls_back_then_stops_when_rollbacks_run_out():
    result, ranks, info = launch([5, 6, 7, 8], checkpoints=True)
    assert result.returncode == 0, result.output[-4000:]
    assert [(e["step"], e["action"]) for e in events(info)] == [
        (5, "skip"), (6, "skip"), (7, "skip"), (8, "rollback")]
    assert events(info)[-1]["to_step"] == 6  # the checkpoint after two skipped steps: still good
    assert info["result"]["steps"] == 12 and np.isfinite(ranks[0]["params"]).all()

    result, ranks, info = launch([5, 6], "train.max_nonfinite_skips=1", "train.max_rollbacks=0",
                                 checkpoints=True)
    assert result.returncode == 5, result.output[-4000:]
    assert [(e["step"], e["action"]) for e in events(info)] == [(5, "skip"), (6, "stop")]
    assert "2 consecutive non-finite steps and 0 rollbacks (train.max_rollbacks = 0)" in result.stdout


def test_hpctrain_train_blown_up_by_a_huge_learning_rate_exits_5_naming_step_and_tensor(tmp_path):
    result = hpctrain(2, "train", "examples/digits.toml", f"data.path={tmp_path}/digits.h5",
                      f"run.root={tmp_path}/runs", "train.lr=1e12", "train.on_nonfinite=stop", "train.max_steps=20",
                      "comm.backend=mpi", "monitor.progress=log", timeout=120)
    assert result.returncode == 5, result.output[-4000:]
    said = re.search(r"hpctrain: error: training stopped at step (\d+): the averaged gradients are not finite; "
                     r"first non-finite gradient: \S+weight \((NaN|inf)\)", result.output)
    assert said, result.output[-4000:]
    assert "HINT: lower train.lr" in result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    (event,) = [r for r in strict_records(run_dir) if r["kind"] == "nonfinite"]
    assert (event["step"], event["action"]) == (int(said.group(1)), "stop")
