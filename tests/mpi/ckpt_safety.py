"""Checkpoint safety scenarios under a real mpirun: roll back, non-finite state, metadata
damage, failed `latest`, one-rank HDF5 errors, a part written with O_DIRECT that reaches the disk wrong.

    mpirun -n 2 python tests/mpi/ckpt_safety.py DIR SCENARIO [SCENARIO ...]

Every scenario prints ``RANK r <scenario> OK ...`` on every rank when it behaved as expected,
and every expected error as ``RANK r <scenario> ERROR: <message>``.
"""
import errno
import json
import os
import resource
import signal
import sys
import threading
import time

import h5py
import numpy as np
import torch

import ckpt_common as cc
from ckpt_common import expect_error, flip_byte, fresh_dir, read_latest, root_only, say
from hpctrain.runtime import fsutil
from hpctrain.checkpoint import CheckpointManager, load_checkpoint, verify_checkpoint
from hpctrain.checkpoint.io import h5file, writer
from hpctrain.checkpoint.content import format as fmt
from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.state import Progress, TrainState

W = None  # the World (also cc.W, which the shared helpers read)
OPTS = cc.OPTS


def ckpts(d):
    return sorted(f for f in os.listdir(d) if f.startswith("ckpt-") and f.endswith(".h5"))


def train_and_save(mgr, state, steps):
    """One optimizer step and one save per step in ``steps`` (progress.step becomes each)."""
    for s in steps:
        cc.step_once(state, s - 1)
        mgr.save(state)


# ---------------------------------------------------------------- scenarios

def load_latest():
    """load_latest: the newest valid checkpoint whatever cfg.resume says; damaged ones
    skipped; None in an empty directory."""
    d = fresh_dir("load_latest")
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cc.config(resume="none"), None)
    assert mgr.load_latest(state) is None
    train_and_save(mgr, state, [1, 2])
    root_only(lambda: flip_byte(os.path.join(d, "ckpt-00000002.h5"), "model/fc1.weight"))
    other = cc.make_state(seed=9)
    path = mgr.load_latest(other)
    assert os.path.basename(path) == "ckpt-00000001.h5", path
    assert other.progress.step == 1
    say("load_latest", f"OK loaded {os.path.basename(path)}")


def with_causal_mask(state):
    """A float buffer of -inf, as a causal attention mask holds: must still save."""
    mask = torch.full((4, 4), float("-inf")).triu(1)
    state.model.register_buffer("causal", mask)
    return state


def nan_refused():
    """NaN in one parameter: the save is refused on every rank naming the tensor, and no
    file is left behind; the newest good checkpoint and `latest` are untouched. The same for a
    background save, raised by save() itself. A -inf buffer saves."""
    d = fresh_dir("nan")
    state = with_causal_mask(cc.make_state(seed=3))
    mgr = CheckpointManager(d, W, cc.config(), None)
    train_and_save(mgr, state, [1, 2])
    before = {n: os.stat(os.path.join(d, n)).st_mtime_ns for n in ckpts(d)}
    with torch.no_grad():
        state.model.fc1.weight[1, 2] = float("nan")
    state.progress.step = 3
    expect_error("nan_refused", lambda: mgr.save(state), "/model/fc1.weight", "NaN or infinite",
                 "ckpt-00000003.h5", "untouched")
    W.comm.Barrier()
    assert ckpts(d) == ["ckpt-00000001.h5", "ckpt-00000002.h5"], ckpts(d)
    assert sorted(os.listdir(d)) == ["ckpt-00000001.h5", "ckpt-00000002.h5", "latest"], os.listdir(d)
    assert read_latest(d) == "ckpt-00000002.h5"
    assert before == {n: os.stat(os.path.join(d, n)).st_mtime_ns for n in ckpts(d)}
    # optimizer state only (the parameter is fine again): still refused, in the background too
    with torch.no_grad():
        state.model.fc1.weight[1, 2] = 0.0
        state.optimizer.state[state.model.fc2.bias]["exp_avg_sq"][0] = float("inf")
    amgr = CheckpointManager(d, W, cc.config(async_save=True), None)
    expect_error("nan_refused", lambda: amgr.save(state), "/optimizer/state/fc2.bias/exp_avg_sq")
    amgr.close()
    assert read_latest(d) == "ckpt-00000002.h5" and ckpts(d) == ["ckpt-00000001.h5", "ckpt-00000002.h5"]
    with torch.no_grad():
        state.optimizer.state[state.model.fc2.bias]["exp_avg_sq"][0] = 0.0
    mgr.save(state)  # finite again (the -inf buffer included): saved
    assert read_latest(d) == "ckpt-00000003.h5" and not verify_checkpoint(os.path.join(d, "ckpt-00000003.h5"))
    say("nan_refused", "OK refused, nothing written, -inf buffer saved")


def nan_in_foreign_file():
    """A file that another writer gave NaN parameters (checksums right): verify flags the
    tensor, and resume=auto skips it for the previous one."""
    d = fresh_dir("foreign")
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cc.config(), None)
    train_and_save(mgr, state, [1, 2])
    path = os.path.join(d, "ckpt-00000002.h5")

    def poison():
        with h5py.File(path, "r+") as f:
            w = f["model/fc2.weight"]
            data = w[()]
            data[0, 0] = np.nan
            w[...] = data
            w.attrs["crc32"] = np.uint32(fmt.crc32_bytes(data))
        with h5py.File(path, "r") as f:  # the foreign writer also keeps the metadata checksum right
            root = {k: fmt.attr_value(v) for k, v in f.attrs.items()}
            groups, datasets = {}, {}
            f.visititems(lambda n, o: datasets.__setitem__(n, (o.shape, o.dtype.str, dict(o.attrs)))
                         if isinstance(o, h5py.Dataset) else groups.__setitem__(n, dict(o.attrs)))
        with h5py.File(path, "r+") as f:
            f.attrs[fmt.METADATA_CRC_ATTR] = np.uint32(fmt.metadata_crc(root, groups, datasets))

    root_only(poison)
    problems = verify_checkpoint(path)
    assert problems == ["/model/fc2.weight: non-finite values (NaN or Inf) in a parameter or optimizer state"], \
        problems
    other = cc.make_state(seed=9)
    assert CheckpointManager(d, W, cc.config(resume="auto"), None).resume(other)
    assert other.progress.step == 1
    say("nan_in_foreign_file", "OK flagged and skipped")


def _params(state):
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def rollback():
    """keep_last=3, saves 1..6 (4, 5, 6 kept); resume=PATH ckpt-4: 5 and 6 are moved to
    abandoned/; the new branch saves 5', 6' (ckpt-4 kept), 7' (now 3 of its own: ckpt-4
    goes). Damage to 7' falls back to 6', never to the abandoned 6."""
    d = fresh_dir("rollback")
    cfg = cc.config(keep_last=3)
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cfg, None)
    train_and_save(mgr, state, range(1, 7))
    old6 = _params(state)
    assert ckpts(d) == [f"ckpt-{s:08d}.h5" for s in (4, 5, 6)], ckpts(d)

    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cc.config(keep_last=3, resume=os.path.join(d, "ckpt-00000004.h5")), None)
    assert mgr.resume(state) and state.progress.step == 4
    assert ckpts(d) == ["ckpt-00000004.h5"] and read_latest(d) == "ckpt-00000004.h5", ckpts(d)
    branches = os.listdir(os.path.join(d, "abandoned"))
    assert len(branches) == 1 and branches[0].endswith("-from-00000004"), branches
    aside = os.path.join(d, "abandoned", branches[0])
    assert sorted(os.listdir(aside)) == ["branch.json", "ckpt-00000005.h5", "ckpt-00000006.h5"]
    record = json.load(open(os.path.join(aside, "branch.json")))
    assert record["resumed_step"] == 4 and record["files"] == ["ckpt-00000005.h5", "ckpt-00000006.h5"]
    for s in (5, 6):  # other data than the abandoned branch had
        cc.step_once(state, s + 99)
        state.progress.step = s
        mgr.save(state)
        assert "ckpt-00000004.h5" in ckpts(d), (s, ckpts(d))
    new6 = _params(state)
    assert not _same(new6, old6)
    cc.step_once(state, 7 + 99)
    state.progress.step = 7
    mgr.save(state)
    assert ckpts(d) == [f"ckpt-{s:08d}.h5" for s in (5, 6, 7)], ckpts(d)
    assert sorted(os.listdir(aside)) == ["branch.json", "ckpt-00000005.h5", "ckpt-00000006.h5"]

    root_only(lambda: flip_byte(os.path.join(d, "ckpt-00000007.h5"), "model/fc1.weight"))
    other = cc.make_state(seed=9)
    assert CheckpointManager(d, W, cc.config(keep_last=3, resume="auto"), None).resume(other)
    assert other.progress.step == 6 and _same(_params(other), new6) and not _same(_params(other), old6)
    # the damaged 7' is kept aside too, not deleted
    branches = sorted(os.listdir(os.path.join(d, "abandoned")))
    assert len(branches) == 2 and "ckpt-00000007.h5" in os.listdir(os.path.join(d, "abandoned", branches[1]))
    say("rollback", "OK resumed-from kept, abandoned kept aside, fell back within the new branch")


def latest_write_fails():
    """The failure is in the `latest` write itself (its rename): the new checkpoint exists,
    `latest` still names the previous one, the error says so, resume=auto takes the new one."""
    d = fresh_dir("latest_fails")
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cc.config(keep_last=1), None)
    train_and_save(mgr, state, [1])
    real = fsutil.durable_rename

    def failing(tmp, final):
        if os.path.basename(final) == "latest":
            raise OSError(errno.EIO, "Input/output error (injected into the rename of latest)")
        return real(tmp, final)

    fsutil.durable_rename = failing
    try:
        cc.step_once(state, 1)
        expect_error("latest_write_fails", lambda: mgr.save(state), "ckpt-00000002.h5 was written and verified",
                     "still names ckpt-00000001.h5", "resume=auto takes the newest valid checkpoint in the "
                     "directory, ckpt-00000002.h5", "Input/output error")
    finally:
        fsutil.durable_rename = real
    W.comm.Barrier()
    assert read_latest(d) == "ckpt-00000001.h5"
    assert sorted(os.listdir(d)) == ["ckpt-00000001.h5", "ckpt-00000002.h5", "latest"], os.listdir(d)
    assert not verify_checkpoint(os.path.join(d, "ckpt-00000002.h5"))
    ref = _params(state)
    other = cc.make_state(seed=9)
    assert CheckpointManager(d, W, cc.config(resume="auto"), None).resume(other)
    assert other.progress.step == 2 and _same(_params(other), ref)
    assert read_latest(d) == "ckpt-00000002.h5"  # the resume repaired it
    say("latest_write_fails", "OK new file kept, latest untouched, resumed from step 2")


def fsync_fails_on_one_rank():
    """Every rank fsyncs the temp file (while the file is re-read): when rank 1's fsync fails,
    every rank raises the same error naming it, no temp file is left, `latest` stays."""
    d = fresh_dir("fsync_fails")
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cc.config(keep_last=1), None)
    train_and_save(mgr, state, [1])
    real = fsutil.fsync_path

    def failing(path, directory=False):
        if W.rank == 1 and ".tmp-" in os.path.basename(path):
            raise OSError(errno.EIO, "Input/output error (injected into the fsync of the temp file)")
        return real(path, directory)

    fsutil.fsync_path = failing
    try:
        cc.step_once(state, 1)
        expect_error("fsync_fails_on_one_rank", lambda: mgr.save(state), "syncing", "ckpt-00000002.h5.tmp-",
                     "rank 1", "Input/output error")
    finally:
        fsutil.fsync_path = real
    W.comm.Barrier()
    assert read_latest(d) == "ckpt-00000001.h5"
    assert sorted(os.listdir(d)) == ["ckpt-00000001.h5", "latest"], os.listdir(d)
    cc.step_once(state, 2)
    mgr.save(state)
    mgr.close()
    assert read_latest(d) == "ckpt-00000003.h5"
    say("fsync_fails_on_one_rank", "OK")


def direct_write_damaged():
    """A part written with O_DIRECT that reaches the disk wrong (here rank 1 overwrites one byte of its first
    direct write right after it): the verification re-reads the file's bytes, not the buffer that was written
    (tests/test_io_pattern.py: through O_DIRECT too); every rank raises the same checksum error, no temp file
    is left, `latest` stays."""
    from hpctrain.checkpoint.io import directio

    d = fresh_dir("direct_damaged")
    torch.manual_seed(3)
    model = torch.nn.Linear(1024, 1024)  # a 4 MiB weight: split among the ranks, each part written direct
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), Progress(step=1, seed=3))
    mgr = CheckpointManager(d, W, cc.config(keep_last=1, direct_io=True), None)
    mgr.save(state)
    real, damaged = directio.DirectWriter.write, []

    def damaging(self, offset, data):
        real(self, offset, data)
        data = memoryview(data).cast("B")
        if W.rank == 1 and not damaged and len(data) > 1:
            mid = len(data) // 2
            os.pwrite(self._plain, bytes([data[mid] ^ 0xFF]), offset + mid)
            damaged.append(offset + mid)

    directio.DirectWriter.write = damaging
    try:
        state.progress.step = 2
        expect_error("direct_write_damaged", lambda: mgr.save(state), "checksum mismatch in 1 dataset",
                     "ckpt-00000002.h5.tmp-")
    finally:
        directio.DirectWriter.write = real
    assert W.rank != 1 or damaged, "rank 1 wrote nothing with O_DIRECT: the scenario tested nothing"
    W.comm.Barrier()
    assert read_latest(d) == "ckpt-00000001.h5"
    assert sorted(os.listdir(d)) == ["ckpt-00000001.h5", "latest"], os.listdir(d)
    state.progress.step = 3
    mgr.save(state)
    mgr.close()
    assert read_latest(d) == "ckpt-00000003.h5" and not verify_checkpoint(os.path.join(d, "ckpt-00000003.h5"))
    say("direct_write_damaged", "OK")


def one_rank_cannot_extend():
    """Rank 1 alone may not grow files past 64 KiB (RLIMIT_FSIZE: its writes fail with
    EFBIG inside HDF5's own calls). Either every rank raises the same CheckpointError naming
    rank 1, or (when the failure is inside HDF5's collective metadata write, which the other
    rank never leaves) the job aborts naming the file; never a silent wait. Runs last: the
    test checks the directory after the job ended."""
    d = fresh_dir("one_rank")
    h5file.FAILED_CLOSE_TIMEOUT = 10.0  # the default 60 s, shortened for the test
    state = cc.make_state(seed=3)
    mgr = CheckpointManager(d, W, cc.config(), None)
    train_and_save(mgr, state, [1])
    if W.rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cc.step_once(state, 1)
    exc = expect_error("one_rank_cannot_extend", lambda: mgr.save(state), "rank 1 on", "ckpt-00000002.h5.tmp-")
    assert "rank 0 on" not in str(exc).split("HINT:")[0], str(exc)
    W.comm.Barrier()
    assert sorted(os.listdir(d)) == ["ckpt-00000001.h5", "latest"], os.listdir(d)
    say("one_rank_cannot_extend", "OK same error on every rank, nothing left behind")


def async_overlaps():
    """A background save returns to training before its writer has written anything: the
    writer waits for a signal that the training thread gives only after save() returned
    (a save in the foreground would wait for it in vain and fail)."""
    d = fresh_dir("overlap")
    state = cc.make_state(seed=4)
    cc.step_once(state, 0)
    mgr = CheckpointManager(d, W, cc.config(async_save=True), None)
    returned, wrote = threading.Event(), threading.Event()
    real = writer.write_parallel

    def gated(*args, **kwargs):
        if not returned.wait(20):
            raise AssertionError("the writer ran before save() returned: the save is not in the background")
        out = real(*args, **kwargs)
        wrote.set()
        return out

    writer.write_parallel = gated
    try:
        ref = _params(state)
        t0 = time.monotonic()
        mgr.save(state)
        assert not wrote.is_set() and time.monotonic() - t0 < 15
        returned.set()
        cc.step_once(state, 1)  # training goes on while the writer writes
        mgr.close()
    finally:
        writer.write_parallel = real
    assert wrote.is_set() and read_latest(d) == "ckpt-00000001.h5"
    other = cc.make_state(seed=9)
    load_checkpoint(os.path.join(d, "ckpt-00000001.h5"), other, W.comm)
    assert _same(_params(other), ref)
    say("async_overlaps", "OK save() returned before the writer started")


def for_flips():
    """One checkpoint written by every rank, with non-default progress, for the bit-flip test."""
    d = fresh_dir("flips")
    state = cc.make_state(seed=5)
    mgr = CheckpointManager(d, W, cc.config(), {"model": "Mixed"})
    cc.step_once(state, 0)
    cc.step_once(state, 1)
    p = state.progress
    p.epoch, p.samples_in_epoch, p.best_metric, p.extra = 3, 96, 0.25, {"phase": "warmup", "n": 7}
    mgr.save(state, metrics={"val_loss": 0.25})
    say("for_flips", "OK saved")


def main(argv):
    global W
    OPTS["dir"] = argv[0]
    W = cc.W = cc.world()
    with abort_on_exception(W.comm):
        for name in argv[1:]:
            globals()[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
