"""Checkpoint scenarios under a real mpirun: retention, failures, damaged files, async.

    mpirun -n 2 python tests/mpi/ckpt_scenarios.py DIR SCENARIO [SCENARIO ...] [--tmpfs PATH] [--ro PATH]

Every scenario prints ``RANK r <scenario> OK ...`` on every rank when it behaved as expected,
and every expected error as ``RANK r <scenario> ERROR: <message>``, so the test can check
each rank's output. ``exit_corrupt`` lets the error end the job (non-zero exit status).
"""
import errno
import glob
import os
import sys
import threading

import h5py
import numpy as np
import torch

import ckpt_common as cc
from ckpt_common import expect_error, fresh_dir, read_latest, root_only, say
from hpctrain.checkpoint import CheckpointManager, background, commit, load_checkpoint, verify_checkpoint
from hpctrain.checkpoint.io import reader, writer
from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.errors import CheckpointError

W = None  # the World (also cc.W, which the shared helpers read)
OPTS = cc.OPTS


def files(d):
    return sorted(os.listdir(d))


def saved_state(d, steps, cfg=None, **kw):
    """A manager in d with checkpoints at ``steps`` (saving the same state, step relabelled)."""
    state = cc.make_state(seed=3, **kw)
    cc.step_once(state, 0)
    mgr = CheckpointManager(d, W, cfg or cc.config(), {"scenario": d})
    for s in steps:
        state.progress.step = s
        mgr.save(state, metrics={"val_loss": float(s)})
    return mgr, state


# ---------------------------------------------------------------- scenarios

def retention():
    d = fresh_dir("retention")
    cfg = cc.config(every_steps=1, keep_last=2, keep_best=1, best_mode="min", milestone_every=4)
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cfg, None)
    metric = {1: 5.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 6.0, 6: 7.0, 7: 2.0, 8: 8.0, 9: 9.0}
    for step in range(9):
        cc.step_once(state, step)  # progress.step becomes step + 1
        assert mgr.maybe_save(state, metrics={"val_loss": metric[state.progress.step]})
    assert mgr.maybe_save(state) is None  # never twice for one step
    mgr.close()
    kept = [f for f in files(d) if f.startswith("ckpt-")]
    expected = [f"ckpt-{s:08d}.h5" for s in (3, 4, 8, 9)]  # best, milestones 4 and 8, last two
    assert kept == expected, kept
    assert read_latest(d) == "ckpt-00000009.h5"
    say("retention", f"OK kept {' '.join(kept)}")


def failing_write(rank, path):
    """``writer.region_to_write`` (the writer's seam) failing rank ``rank``'s write of dataset
    ``path`` as a full disk would, owner of a piece or not; the rank still takes part."""
    real = writer.region_to_write

    def region_to_write(d, r):
        if r == rank and d.path == path:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(d, r)
    return region_to_write


def latest_failure():
    d = fresh_dir("latest_failure")
    mgr, state = saved_state(d, [1])
    real, writer.region_to_write = writer.region_to_write, failing_write(1, "model/fc1.weight")
    state.progress.step = 2
    try:
        expect_error("latest_failure", lambda: mgr.save(state), "model/fc1.weight", "ckpt-00000002.h5.tmp-",
                     "rank 1")
    finally:
        writer.region_to_write = real
    W.comm.Barrier()
    assert read_latest(d) == "ckpt-00000001.h5"
    assert files(d) == ["ckpt-00000001.h5", "latest"], files(d)  # no temp file left behind
    state.progress.step = 3
    mgr.save(state)
    assert read_latest(d) == "ckpt-00000003.h5"
    say("latest_failure", "OK latest kept after the failure, moved after the next success")


def async_failure():
    """A background save writes independently: one rank's failed write still ends as the
    same error on every rank (at wait()), with no temp file left and `latest` kept."""
    d = fresh_dir("async_failure")
    mgr, state = saved_state(d, [1], cfg=cc.config(async_save=True))
    mgr.wait()
    call_bytes, writer.CALL_BYTES = writer.CALL_BYTES, 64 << 10  # several calls per large dataset
    real, writer.region_to_write = writer.region_to_write, failing_write(1, "model/fc1.weight")
    state.progress.step = 2
    try:
        mgr.save(state)
        expect_error("async_failure", mgr.wait, "model/fc1.weight", "ckpt-00000002.h5.tmp-", "rank 1")
    finally:
        writer.region_to_write = real
        writer.CALL_BYTES = call_bytes
    W.comm.Barrier()
    assert read_latest(d) == "ckpt-00000001.h5"
    assert files(d) == ["ckpt-00000001.h5", "latest"], files(d)
    state.progress.step = 3
    mgr.save(state)
    mgr.close()
    assert read_latest(d) == "ckpt-00000003.h5" and not verify_checkpoint(os.path.join(d, "ckpt-00000003.h5"))
    say("async_failure", "OK")


def async_same():
    d_sync, d_async = fresh_dir("sync"), fresh_dir("async")
    state = cc.make_state(seed=4)
    cc.step_once(state, 0)
    state.progress.step = 5
    sync = CheckpointManager(d_sync, W, cc.config(), {"x": 1})
    sync.save(state, metrics={"val_loss": 1.0})
    backgr = CheckpointManager(d_async, W, cc.config(async_save=True), {"x": 1})
    call_bytes, writer.CALL_BYTES = writer.CALL_BYTES, 64 << 10  # many independent calls per large dataset
    real_write, niceness = commit.write_verified, []

    def write_verified(*args, **kwargs):  # the writer runs below the training's priority
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_write(*args, **kwargs)

    commit.write_verified = write_verified
    try:
        backgr.save(state, metrics={"val_loss": 1.0})
        cc.step_once(state, 5)  # training goes on (and changes every tensor) while it writes
        backgr.close()
    finally:
        writer.CALL_BYTES = call_bytes
        commit.write_verified = real_write
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert niceness == [mine + background.WRITER_NICE], (niceness, mine)
    if W.rank == 0:
        a, b = (h5py.File(os.path.join(x, "ckpt-00000005.h5"), "r") for x in (d_sync, d_async))
        volatile = {"created", "created_unix", "metadata_crc32"}  # the checksum covers the time
        assert {k: v for k, v in a.attrs.items() if k not in volatile} == \
            {k: v for k, v in b.attrs.items() if k not in volatile}

        def compare(name, obj):
            other = b[name]
            assert dict(obj.attrs) == dict(other.attrs), name
            if isinstance(obj, h5py.Dataset):
                assert obj[()].tobytes() == other[()].tobytes(), name

        a.visititems(compare)
        assert sorted(a) == sorted(b)
        a.close()
        b.close()
    W.comm.Barrier()
    say("async_same", "OK async file equals sync file")


def corrupt_fallback():
    d = fresh_dir("corrupt")
    _, saved = saved_state(d, [1, 2])
    bad = os.path.join(d, "ckpt-00000002.h5")
    root_only(lambda: cc.flip_byte(bad, "model/fc1.weight"))
    problems = verify_checkpoint(bad)
    assert problems and "/model/fc1.weight" in problems[0], problems
    state = cc.make_state(seed=8)
    expect_error("corrupt_fallback", lambda: load_checkpoint(bad, state, W.comm), "/model/fc1.weight",
                 "checksum mismatch")
    mgr = CheckpointManager(d, W, cc.config(resume="auto"), None)
    assert mgr.resume(state) and state.progress.step == 1
    # The failed load wrote part of the damaged file into the state; the fallback replaced all of it.
    ref = cc.reference(saved)
    cc._same(ref["model"], state.model.state_dict(), "model")
    cc._same(ref["optimizer"], state.optimizer.state_dict(), "optimizer")
    say("corrupt_fallback", "OK resumed from step 1")


def in_place():
    """A load reads straight into the state's own tensors: the parameters keep their memory,
    the optimizer keeps its moment tensors, and the values are the file's (split datasets,
    bf16, fp16, integer and bool buffers)."""
    d = fresh_dir("in_place")
    _, saved = saved_state(d, [1])
    ref = cc.reference(saved)
    state = cc.make_state(seed=8)
    cc.step_once(state, 5)  # other values, and optimizer state to be overwritten
    params = {f"model/{n}": t for n, t in state.model.state_dict().items()}
    moments = {id(p): dict(s) for p, s in state.optimizer.state.items()}
    calls = []
    real = reader.read_arrays

    def recording(header, comm, parallel, keep=None, verify=True, into=None):
        arrays = real(header, comm, parallel, keep, verify, into)
        calls.append((dict(into or {}), arrays))
        return arrays

    reader.read_arrays = recording
    try:
        load_checkpoint(os.path.join(d, "ckpt-00000001.h5"), state, W.comm)
    finally:
        reader.read_arrays = real
    cc.assert_same_state(ref, state)
    (into, arrays), = calls
    # Every model tensor but the bool buffer (stored as uint8) is read into the parameter's memory.
    expected = {p for p, t in params.items() if t.dtype != torch.bool}
    assert set(p for p in into if p.startswith("model/")) == expected, sorted(into)
    for p in expected:
        assert arrays[p] is into[p] and into[p].ctypes.data == params[p].data_ptr(), p
    for p, s in state.optimizer.state.items():
        for key, value in s.items():
            if torch.is_tensor(value):
                assert value is moments[id(p)][key], (key, tuple(value.shape), value.dtype)  # the same tensor, overwritten
    say("in_place", f"OK {len(expected)} model tensors and every optimizer tensor read in place")


def groups_mismatch():
    """A file whose optimizer groups do not fit is refused before anything is read."""
    d = fresh_dir("groups")
    saved_state(d, [1])
    state = cc.make_state(seed=8)
    state.optimizer = torch.optim.Adam(state.model.parameters(), lr=0.01)  # one group, not two
    before = {n: t.clone() for n, t in state.model.state_dict().items()}
    expect_error("groups_mismatch", lambda: load_checkpoint(os.path.join(d, "ckpt-00000001.h5"), state, W.comm),
                 "parameter groups differ")
    cc._same(before, state.model.state_dict(), "model")  # nothing changed
    say("groups_mismatch", "OK")


def truncated():
    d = fresh_dir("truncated")
    saved_state(d, [1, 2])
    bad = os.path.join(d, "ckpt-00000002.h5")
    root_only(lambda: os.truncate(bad, os.path.getsize(bad) // 2))
    state = cc.make_state(seed=8)
    expect_error("truncated", lambda: load_checkpoint(bad, state, W.comm), bad)
    mgr = CheckpointManager(d, W, cc.config(resume="auto"), None)
    assert mgr.resume(state) and state.progress.step == 1
    say("truncated", "OK resumed from step 1")


def missing_dataset():
    d = fresh_dir("missing")
    saved_state(d, [1])
    path = os.path.join(d, "ckpt-00000001.h5")

    def remove():
        with h5py.File(path, "r+") as f:
            del f["optimizer/state/fc1.weight/exp_avg"]

    root_only(remove)
    state = cc.make_state(seed=8)
    expect_error("missing_dataset", lambda: load_checkpoint(path, state, W.comm),
                 "/optimizer/state/fc1.weight/exp_avg", "missing")
    say("missing_dataset", "OK")


def wrong_version():
    d = fresh_dir("version")
    saved_state(d, [1])
    path = os.path.join(d, "ckpt-00000001.h5")

    def bump():
        with h5py.File(path, "r+") as f:
            f.attrs["format_version"] = 99

    root_only(bump)
    state = cc.make_state(seed=8)
    expect_error("wrong_version", lambda: load_checkpoint(path, state, W.comm), "format version 99")
    say("wrong_version", "OK")


def shape_mismatch():
    d = fresh_dir("shape")
    saved_state(d, [1])
    state = cc.make_state(seed=8, hidden=12)
    before = state.model.fc1.weight.clone()
    mgr = CheckpointManager(d, W, cc.config(resume="auto"), None)
    expect_error("shape_mismatch", lambda: mgr.resume(state), "fc1.weight", "(12, 8)", "(16, 8)")
    assert torch.equal(before, state.model.fc1.weight)  # nothing changed
    say("shape_mismatch", "OK")


def unwritable():
    blocker = os.path.join(OPTS["dir"], "a-file")
    root_only(lambda: open(blocker, "w").close())
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(os.path.join(blocker, "checkpoints"), W, cc.config(), None)
    expect_error("unwritable", lambda: mgr.save(state), "not writable")
    if OPTS.get("ro"):
        mgr = CheckpointManager(OPTS["ro"], W, cc.config(), None)
        expect_error("unwritable", lambda: mgr.save(state), "not writable", "Read-only")
    say("unwritable", "OK")


def disk_full(name="disk_full", *needles, cfg=None):
    d = os.path.join(OPTS["tmpfs"], "ckpts")
    mgr, state = saved_state(d, [1], cfg)
    state.progress.step = 2
    expect_error(name, lambda: mgr.save(state), "ckpt-00000002.h5.tmp-", "No space left", *needles)
    W.comm.Barrier()
    assert read_latest(d) == "ckpt-00000001.h5"
    assert files(d) == ["ckpt-00000001.h5", "latest"], files(d)
    assert not verify_checkpoint(os.path.join(d, "ckpt-00000001.h5"))
    say(name, "OK")


def disk_full_mapped():
    """disk_full on ext4, aligned on 64 KiB so that the embedding and its moments are split into parts, which
    each rank copies into a shared mapping of the file: the disk fills while a part's space is allocated, an
    OSError (errno 28) on that rank, not a SIGBUS, and the same error on every rank."""
    disk_full("disk_full_mapped", "[Errno 28]", cfg=cc.config(alignment=64 << 10))


def consistency():
    d = fresh_dir("consistency")
    state = cc.make_state(seed=3)
    if W.rank == 1:
        with torch.no_grad():
            state.model.fc2.bias.add_(1e-3)
    mgr = CheckpointManager(d, W, cc.config(), None)
    expect_error("consistency", lambda: mgr.save(state), "ranks 1 ", "fc2.bias")
    assert not glob.glob(os.path.join(d, "ckpt-*"))
    mgr = CheckpointManager(d, W, cc.config(consistency="repair"), None)
    mgr.save(state)
    mine = state.model.fc2.bias.detach().numpy().copy()
    assert all(np.array_equal(mine, other) for other in W.comm.allgather(mine))
    say("consistency", "OK repaired")


def exit_corrupt():
    d = fresh_dir("exit")
    saved_state(d, [1])
    bad = os.path.join(d, "ckpt-00000001.h5")
    root_only(lambda: cc.flip_byte(bad, "optimizer/state/embed.weight/exp_avg", where=4000))
    state = cc.make_state(seed=8)
    try:
        load_checkpoint(bad, state, W.comm)
    except CheckpointError as exc:
        say("exit_corrupt", "ERROR: " + str(exc).replace("\n", " | "))
        raise
    say("exit_corrupt", "NO ERROR")


def main(argv):
    global W
    OPTS["dir"] = argv[0]
    names = []
    args = iter(argv[1:])
    for a in args:
        if a in ("--tmpfs", "--ro"):
            OPTS[a[2:]] = next(args)
        else:
            names.append(a)
    W = cc.W = cc.world()
    with abort_on_exception(W.comm):
        for name in names:
            globals()[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
