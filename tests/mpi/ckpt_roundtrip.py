"""Save a checkpoint on N ranks, load it on M ranks, compare with a torch.save reference.

    mpirun -n 2 python tests/mpi/ckpt_roundtrip.py save DIR [--tiny]
    mpirun -n 4 python tests/mpi/ckpt_roundtrip.py load DIR [--tiny]

``save`` trains two steps, saves through CheckpointManager and writes DIR/ref.pt (rank 0);
``load`` builds a differently initialised state, resumes with resume=auto, and checks every
model tensor, the optimizer state and the progress against ref.pt, bit for bit.
"""
import os
import sys

import torch

import ckpt_common as cc
from hpctrain.checkpoint import CheckpointManager
from hpctrain.runtime.coordination import abort_on_exception


def main(argv):
    mode, directory = argv[0], argv[1]
    tiny = "--tiny" in argv
    world = cc.world()
    with abort_on_exception(world.comm):
        ckdir = os.path.join(directory, "checkpoints")
        if mode == "save":
            state = cc.make_state(seed=1, tiny=tiny)
            for step in range(2):
                cc.step_once(state, step)
            state.progress.epoch, state.progress.samples_in_epoch = 3, 48
            state.progress.best_metric, state.progress.extra = 0.25, {"sampler": [1, 2]}
            mgr = CheckpointManager(ckdir, world, cc.config(), run_config={"model": "mixed", "lr": 0.01})
            path = mgr.save(state, reason="test", metrics={"val_loss": 0.25})
            mgr.close()
            if world.rank == 0:
                torch.save(cc.reference(state), os.path.join(directory, "ref.pt"))
            print(f"RANK {world.rank} SAVED {path}", flush=True)
        else:
            state = cc.make_state(seed=99, tiny=tiny)
            cc.step_once(state, 0)  # optimizer state exists and differs
            mgr = CheckpointManager(ckdir, world, cc.config(resume="auto"), None)
            assert mgr.resume(state)
            ref = torch.load(os.path.join(directory, "ref.pt"), weights_only=False)
            cc.assert_same_state(ref, state)
            # and training goes on from there
            cc.step_once(state, state.progress.step)
            print(f"RANK {world.rank} LOADED OK of {world.size}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
