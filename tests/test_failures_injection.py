"""SIGKILL of one rank at many points of a run under a real mpirun: during training and
during checkpoint writes (the ranks' collective HDF5 writes, and rank 0's renames of the
checkpoint and of ``latest``). After every kill, ``latest`` must name a complete checkpoint
that ``hpctrain ckpt verify`` accepts, and the next run must resume from it.

The trials are chained, as repeated failures of one long job would be: each run resumes
from what the previous kill left and is itself killed further on; a last run finishes. Its
final parameters must equal, bit for bit, those of a run that was never killed.
Kill points are counted in calls (tests/mpi/fail_inject.py), so they are reproducible.
The table of trials is printed (pytest -s) and written to failure-trials.json in tmp_path.
"""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from checkpoint_files import latest_step, tensors
from mpi_harness import command, mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 48
EVERY = 2
EPOCH_STEPS = 22  # digits: 22 steps of 64 samples per epoch; a checkpoint at each epoch end
TRIALS = 7  # kills per chain: each is a launch of its own (~9 s here); 7 still reach every kind of point
TRAINING_KILLS = 4  # in backward, one kind of point: each rank twice, spread over the run and its two epochs
RUN_TIMEOUT = 180


def config(run_dir, digits):
    return [f"run.run_dir={run_dir}", f"data.path={digits}", f"train.max_steps={STEPS}",
            f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=3", "monitor.log_every=1"]


def train(run_dir, digits, env=None):
    """One run; returns (result, {rank: step it resumed from}) as recorded by the ranks."""
    log = Path(run_dir).parent / "resumes.log"
    log.unlink(missing_ok=True)
    result = mpirun(2, ["tests/mpi/fail_inject.py", "-m", "hpctrain", "train", "examples/digits.toml",
                        *config(run_dir, digits)], timeout=RUN_TIMEOUT, env=dict(env or {}, FAIL_LOG=str(log)), fresh=True)
    resumed = {}
    if log.exists():
        resumed = {int(r): int(s) for r, s in re.findall(r"rank (\d+) resumed (\d+)", log.read_text())}
    return result, resumed


def checkpoint_steps():
    return sorted({s for s in range(EVERY, STEPS + 1, EVERY)} | {s for s in range(EPOCH_STEPS, STEPS + 1, EPOCH_STEPS)})


def verify(path):
    proc = command("ckpt", "verify", path)
    return proc.returncode == 0 and ": ok" in proc.stdout, proc.stdout + proc.stderr


def resumable(run_dir):
    """Step that resume=auto starts from: the newest checkpoint of the directory (newer than
    `latest` when a kill fell between a checkpoint's rename and `latest`'s), 0 if none."""
    d = Path(run_dir) / "checkpoints"
    steps = [int(m.group(1)) for p in (d.iterdir() if d.is_dir() else []) if (m := re.fullmatch(r"ckpt-(\d+)\.h5", p.name))]
    return max(steps, default=0)


def final_loss(output):
    m = re.search(r"done at step \d+, epoch \d+: train loss ([\d.]+) val_loss ([\d.]+)", output)
    return (float(m.group(1)), float(m.group(2))) if m else None



@pytest.fixture(scope="module")
def reference(tmp_path_factory, digits):
    """A run that is never killed; it also counts the calls at which kills can be placed."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result, _ = train(run_dir, digits, env={"FAIL_COUNT": "1"})
    result.check()
    counts = {int(r): dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", rest))
              # the ranks' lines may run together in mpirun's output: match the fields only
              for r, rest in re.findall(r"fail_inject: rank (\d+) calls ((?:[a-z0-9]+=\d+ ?)+)", result.stderr)}
    assert sorted(counts) == [0, 1], result.stderr[-2000:]
    step, path = latest_step(run_dir)
    assert step == STEPS
    saves = counts[0]["replace"] // 2  # rank 0 renames each checkpoint, then `latest`
    assert saves == len(checkpoint_steps()), counts
    per_save = {r: c["h5write"] // saves for r, c in counts.items()}
    assert min(per_save.values()) >= 1, f"a rank writes no dataset in a save, nowhere to kill it: {counts}"
    return {"path": path, "loss": final_loss(result.stdout), "counts": counts, "writes_per_save": per_save}


def kill_plan(scenario, reference):
    """[(rank, point, how far into the run)] for TRIALS kills spread over the run."""
    if scenario == "training":
        # global steps to die in, spread over the whole run; converted per run below
        targets = np.linspace(2, STEPS - 2, TRAINING_KILLS).round().astype(int)
        return [(i % 2, "backward", int(s)) for i, s in enumerate(targets)]
    plan = []
    for i in range(TRIALS - 3):  # inside the collective data writes, at each position of a save
        rank = i % 2
        per_save = reference["writes_per_save"][rank]
        plan.append((rank, "h5write", per_save + 1 + (i * per_save) // (TRIALS - 3)))
    # rank 0 at its renames: before the checkpoint's rename, between it and `latest`'s, and again
    plan += [(0, "replace", 3), (0, "replace", 4), (0, "replace", 6)]
    return plan


@pytest.mark.parametrize("scenario", ["training", "checkpoint"])
def test_kill_one_rank_repeatedly_then_resume(tmp_path, digits, reference, scenario):
    run_dir = tmp_path / "run"
    trials = []
    for rank, point, where in kill_plan(scenario, reference):
        before = resumable(run_dir)
        n = where - before if point == "backward" else where  # backward: one call per step
        result, resumed = train(run_dir, digits, env={"FAIL_RANK": str(rank), "FAIL_AT": f"{point}:{n}",
                                                      "FAIL_ACTION": "kill"})
        assert result.returncode != 0, f"the run was not killed at {point}:{n}\n{result.output[-3000:]}"
        assert f"fail_inject: rank {rank}: kill at {point} call {n}" in result.stderr
        # every rank resumed from what `latest` named when the run started
        assert resumed == {0: before, 1: before}, (resumed, before, result.output[-3000:])
        step, path = latest_step(run_dir)
        if point == "backward":
            # killed inside step `where`: every save before it was complete
            assert step == max([0] + [s for s in checkpoint_steps() if s < where])
        else:
            assert resumable(run_dir) >= before  # a save never goes back or leaves a broken file
        if path is not None:
            ok, text = verify(path)
            assert ok, f"`latest` names a checkpoint that does not verify after {point}:{n}:\n{text}"
        # the steps computed since `latest` that the next run does again: up to the step
        # being trained, or up to the save being written when the rank died
        upto = where - 1 if point == "backward" else min(s for s in checkpoint_steps() if s > step)
        trials.append({"rank": rank, "point": point, "call": n, "resumed_from": before,
                       "latest_after_kill": step, "resumable_after_kill": resumable(run_dir), "verified": path is not None, "steps_lost": upto - step})

    result, resumed = train(run_dir, digits)  # the last run: no kill
    result.check()
    last_before = trials[-1]["resumable_after_kill"]
    assert resumed == {0: last_before, 1: last_before}
    step, path = latest_step(run_dir)
    assert step == STEPS and verify(path)[0]
    got, want = tensors(path), tensors(reference["path"])
    assert sorted(got) == sorted(want)
    identical = all(got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in want)
    leftovers = sorted(p.name for p in path.parent.iterdir() if ".tmp" in p.name)
    assert leftovers == [], leftovers  # each resume removed what the killed saves left
    summary = {"scenario": scenario, "kills": len(trials), "trials": trials,
               "final_loss": final_loss(result.stdout), "reference_loss": reference["loss"],
               "bitwise_identical_to_reference": identical, "temp_files_left": leftovers}
    (tmp_path / "failure-trials.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{scenario}: {len(trials)} kills; final (train loss, val loss) {summary['final_loss']} "
          f"vs never killed {reference['loss']}; parameters identical: {identical}; "
          f"temp files left: {len(leftovers)}")
    for t in trials:
        print(f"  rank {t['rank']} {t['point']}:{t['call']:<3} resumed from {t['resumed_from']:>2} "
              f"-> latest {t['latest_after_kill']:>2} verified {t['verified']} steps lost {t['steps_lost']}")
    assert identical, "parameters after the killed and resumed runs differ from the reference"
    assert summary["final_loss"] == reference["loss"]
