"""SIGKILL of one rank while a background (async) save is being written, at many points:
after every kill ``latest`` names a checkpoint that verifies, and the chained runs, each
resuming from what the previous kill left, end bit for bit where a run that was never
killed ends. Kill points are counted in calls (tests/mpi/fail_inject.py); the kill must
happen in the checkpoint writer thread, i.e. during the asynchronous save itself."""
import re

import pytest
import torch

from checkpoint_files import latest_step
from mpi_harness import ROOT, mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SCRIPTS = ROOT / "tests" / "mpi"
STEPS = 12
RUN_TIMEOUT = 120
WRITER_THREAD = "hpctrain-checkpoint-writer"


def run(directory, env=None):
    args = [SCRIPTS / "fail_inject.py", SCRIPTS / "ckpt_train.py", directory, STEPS, "every_steps=2",
            "async_save=1", "resume=auto"]
    return mpirun(2, args, timeout=RUN_TIMEOUT, env=env, fresh=True)


def test_sigkill_during_async_saves_then_resume_bitwise(tmp_path):
    from hpctrain.checkpoint import verify_checkpoint

    whole = tmp_path / "whole"
    ref = run(whole, env={"FAIL_COUNT": "1"}).check()
    counts = {int(r): int(n) for r, n in re.findall(r"fail_inject: rank (\d+) calls .*?h5write=(\d+)", ref.stderr)}
    assert sorted(counts) == [0, 1], ref.stderr[-2000:]
    per_save = {r: n // (STEPS // 2) for r, n in counts.items()}
    # 6 kills inside the data writes (each rank, spread over two saves' writes; each kill is a launch of
    # its own), then rank 0 at its renames of the checkpoint and of `latest` (in the writer thread as well)
    plan = [(i % 2, "h5write", 1 + (i * 2 * per_save[i % 2]) // 6) for i in range(6)]
    plan += [(0, "replace", 1), (0, "replace", 2)]
    parts, table = tmp_path / "parts", []
    for rank, point, n in plan:
        before, _ = latest_step(parts)
        result = run(parts, env={"FAIL_RANK": str(rank), "FAIL_AT": f"{point}:{n}", "FAIL_ACTION": "kill"})
        assert result.returncode != 0, f"not killed at {point}:{n}\n{result.output[-3000:]}"
        said = f"fail_inject: rank {rank}: kill at {point} call {n} (thread {WRITER_THREAD})"
        assert said in result.stderr, result.stderr[-3000:]
        step, path = latest_step(parts)
        assert step >= before, (before, step)
        if path is not None:
            assert not verify_checkpoint(str(path)), f"`latest` does not verify after {point}:{n}"
        table.append((rank, point, n, before, step))
    final = run(parts).check()
    assert "DONE step 12" in final.stdout
    a = torch.load(whole / "final.pt", weights_only=False)
    b = torch.load(parts / "final.pt", weights_only=False)
    import sys

    sys.path.insert(0, str(SCRIPTS))
    import ckpt_common as cc

    cc._same(a["model"], b["model"], "model")
    cc._same(a["optimizer"], b["optimizer"], "optimizer")
    assert a["progress"] == b["progress"]
    leftovers = sorted(p.name for p in (parts / "checkpoints").iterdir() if ".tmp" in p.name)
    assert leftovers == []
    print("\n".join(f"rank {r} {p}:{n} latest {b_} -> {s}" for r, p, n, b_, s in table))
