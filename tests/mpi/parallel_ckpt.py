"""Checkpoints of split models across layouts.

    mpirun -n 4 python tests/mpi/parallel_ckpt.py save DIR --stages 2          # 2 stages x 2 replicas
    mpirun -n 4 python tests/mpi/parallel_ckpt.py load DIR --stages 4          # 4 x 1, or --stages 1 (1 x 4)
    python tests/mpi/parallel_ckpt.py plain DIR                                 # dense model, load_checkpoint
    mpirun -n 4 python tests/mpi/parallel_ckpt.py load DIR --width 24           # a model that does not fit
    mpirun -n 4 python tests/mpi/parallel_ckpt.py diverged DIR --stages 2       # replicas that differ

``save`` trains 3 steps, writes DIR/ckpt-00000003.h5 and (rank 0) DIR/ref.pt with the full
model and optimizer state, trains 2 more steps and records their losses in DIR/after.json.
``load`` builds the model from another seed, loads the file, checks that model and optimizer
equal ref.pt bitwise, then trains the same 2 steps and compares the losses.
``diverged`` changes one parameter on the last rank (a replica of the last stage): the save
fails on every rank, naming it, and writes nothing; with ``consistency="repair"`` it copies
the other replica's parameters and saves.
"""
import argparse
import json
import os

import torch
from torch import nn

from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.parallel import HybridParallel, Layout, gather_state
from hpctrain.state import Progress

from parallel_common import batch, build_model, optimizer

SAVED_STEP = 3
NAME = "ckpt-00000003.h5"


def train(hp, steps, first):
    return [hp.train_step(*batch(step)) for step in range(first, first + steps)]


def equal(a, b, what):
    assert a.keys() == b.keys(), f"{what}: {sorted(a)} != {sorted(b)}"
    for k in a:
        if isinstance(a[k], dict):
            equal(a[k], b[k], f"{what}/{k}")
        else:
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), f"{what}/{k} differs"


def parallel(args):
    hp = HybridParallel(build_model(seed=0 if args.mode == "save" else 7, width=args.width),
                        Layout(args.stages, None, args.tensor), nn.MSELoss(), optimizer,
                        micro_batches=2, schedule="1f1b")
    rank = hp.grid.rank
    path = os.path.join(args.dir, NAME)
    if args.mode == "save":
        train(hp, SAVED_STEP, 0)
        hp.save(path, Progress(step=SAVED_STEP, epoch=1))
        state = gather_state(hp.module, hp.optimizer, hp.grid)
        after = train(hp, 2, SAVED_STEP)
        if rank == 0:
            torch.save(state, os.path.join(args.dir, "ref.pt"))
            with open(os.path.join(args.dir, "after.json"), "w") as f:
                json.dump(after, f)
        print(f"RANK {rank} SAVED", flush=True)
    else:
        progress = Progress()
        try:
            hp.load(path, progress)
        except Exception as exc:
            print(f"RANK {rank} LOAD FAILED {type(exc).__name__}", flush=True)
            raise
        assert progress.step == SAVED_STEP and progress.epoch == 1, progress
        state = gather_state(hp.module, hp.optimizer, hp.grid)
        if rank == 0:
            equal(state, torch.load(os.path.join(args.dir, "ref.pt")), "state")
        after = train(hp, 2, SAVED_STEP)
        with open(os.path.join(args.dir, "after.json")) as f:
            expected = json.load(f)
        assert all(abs(a - b) <= 1e-5 for a, b in zip(after, expected)), (after, expected)
        print(f"RANK {rank} LOADED SAME in {hp.layout.describe()}", flush=True)
    hp.close()


def diverged(args):
    from hpctrain.errors import CheckpointError

    hp = HybridParallel(build_model(seed=0), Layout(args.stages, None, args.tensor), nn.MSELoss(), optimizer,
                        micro_batches=2)
    rank, last = hp.grid.rank, hp.grid.comm.Get_size() - 1
    train(hp, 1, 0)
    if rank == last:
        with torch.no_grad():
            next(hp.module.parameters()).add_(1e-3)
    path = os.path.join(args.dir, NAME)
    try:
        hp.save(path, Progress(step=1))
        raise AssertionError("a save of diverged replicas did not fail")
    except CheckpointError as exc:
        assert f"ranks {last} hold model tensors" in str(exc), str(exc)
        print(f"RANK {rank} SAVE FAILED {str(exc).splitlines()[0]}", flush=True)
    assert not os.listdir(args.dir), os.listdir(args.dir)
    hp.save(path, Progress(step=1), consistency="repair")
    mine = [p.detach().clone() for p in hp.module.parameters()]
    theirs = hp.grid.dp_comm.allgather(mine)
    assert all(torch.equal(a, b) for other in theirs for a, b in zip(mine, other))
    print(f"RANK {rank} REPAIRED", flush=True)
    hp.close()


def plain(args):
    """The file in the ordinary loader, into the dense model in one process."""
    from hpctrain.checkpoint import load_checkpoint
    from hpctrain.state import TrainState

    model = build_model(seed=7)
    opt = optimizer(model.parameters())
    state = TrainState(model, opt)
    load_checkpoint(os.path.join(args.dir, NAME), state)
    ref = torch.load(os.path.join(args.dir, "ref.pt"))
    equal({k: v for k, v in model.state_dict().items()}, ref["model"], "model")
    names = [n for n, _ in model.named_parameters()]
    got = {names[i]: s for i, s in opt.state_dict()["state"].items()}
    equal(got, ref["optimizer"], "optimizer")
    assert state.progress.step == SAVED_STEP
    print("PLAIN LOADED SAME", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load", "plain", "diverged"])
    ap.add_argument("dir")
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--width", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        {"plain": plain, "diverged": diverged}.get(args.mode, parallel)(args)
