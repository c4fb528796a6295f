"""A tiny data-parallel training loop (mpi4py Allreduce of gradients) with checkpoints.

    mpirun -n 2 python tests/mpi/ckpt_train.py DIR STEPS [every_steps=K] [resume=auto|none] [async_save=1]
        [local_every=K] [local_dir=PATH]

Each rank draws its batch from (seed, step, rank), so a run stopped after k steps and
resumed must end bit for bit where an uninterrupted run ends. Rank 0 writes DIR/final.pt.
"""
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

import ckpt_common as cc
from hpctrain.checkpoint import CheckpointManager
from hpctrain.runtime.coordination import abort_on_exception


def train_step(state, world):
    step = state.progress.step
    g = torch.Generator().manual_seed(state.progress.seed * 1_000_003 + step * 101 + world.rank)
    idx = torch.randint(0, 320, (4,), generator=g)
    x = torch.randn(4, 8, generator=g)
    loss = state.model(idx, x).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    for p in state.model.parameters():  # average gradients across ranks
        grad = np.ascontiguousarray(p.grad.float().numpy())  # MPI has no fp16/bf16 type
        world.comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
        p.grad.copy_(torch.from_numpy(grad / world.size).to(p.grad.dtype))
    state.optimizer.step()
    state.progress.step = step + 1
    state.progress.samples_in_epoch += 4 * world.size
    return loss.item()


def main(argv):
    directory, steps = argv[0], int(argv[1])
    opts = dict(a.split("=", 1) for a in argv[2:])
    world = cc.world()
    with abort_on_exception(world.comm):
        cfg = cc.config(every_steps=int(opts.get("every_steps", 0)), resume=opts.get("resume", "none"),
                        async_save=opts.get("async_save") == "1", keep_last=2,
                        local="local_every" in opts, local_every_steps=int(opts.get("local_every", 0)),
                        local_dir=opts.get("local_dir", "/dev/shm"))
        state = cc.make_state(seed=5)
        mgr = CheckpointManager(os.path.join(directory, "checkpoints"), world, cfg, {"steps": steps})
        resumed = mgr.resume(state)
        print(f"RANK {world.rank} resumed={resumed} at step {state.progress.step}", flush=True)
        while state.progress.step < steps:
            loss = train_step(state, world)
            saved = mgr.maybe_save(state, metrics={"val_loss": loss})
            if saved:
                print(f"RANK {world.rank} saved {os.path.basename(saved)}", flush=True)
        mgr.close()
        if world.rank == 0:
            os.makedirs(directory, exist_ok=True)
            torch.save(cc.reference(state), os.path.join(directory, "final.pt"))
        print(f"RANK {world.rank} DONE step {state.progress.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
