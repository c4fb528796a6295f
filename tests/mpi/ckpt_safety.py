"""Checkpoint safety scenarios under a real mpirun: roll back, non-finite state, metadata
damage, failed `latest`, one-rank HDF5 errors.

    mpirun -n 2 python tests/mpi/ckpt_safety.py DIR SCENARIO [SCENARIO ...]

Every scenario prints ``RANK r <scenario> OK ...`` on every rank when it behaved as expected,
and every expected error as ``RANK r <scenario> ERROR: <message>``.
"""
import os
import sys

import h5py
import torch

import ckpt_common as cc
from hpctrain.checkpoint import CheckpointManager
from hpctrain.coordination import abort_on_exception
from hpctrain.errors import CheckpointError

W = None  # the World
OPTS = {}


def say(name, text):
    print(f"RANK {W.rank} {name} {text}", flush=True)


def expect_error(name, fn, *needles):
    """Run fn (collective); it must raise CheckpointError containing every needle."""
    try:
        fn()
    except CheckpointError as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{name}: {needle!r} not in error:\n{text}"
        say(name, "ERROR: " + text.replace("\n", " | "))
        return exc
    raise AssertionError(f"{name}: no CheckpointError raised")


def root_only(fn):
    if W.rank == 0:
        fn()
    W.comm.Barrier()


def fresh_dir(name):
    path = os.path.join(OPTS["dir"], name)
    root_only(lambda: os.makedirs(path, exist_ok=True))
    return path


def read_latest(d):
    with open(os.path.join(d, "latest")) as f:
        return f.read().strip()


def ckpts(d):
    return sorted(f for f in os.listdir(d) if f.startswith("ckpt-") and f.endswith(".h5"))


def flip_byte(path, dataset, where=10):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + where)
        byte = f.read(1)
        f.seek(offset + where)
        f.write(bytes([byte[0] ^ 0xFF]))


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


def main(argv):
    global W
    OPTS["dir"] = argv[0]
    W = cc.world()
    with abort_on_exception(W.comm):
        for name in argv[1:]:
            globals()[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
