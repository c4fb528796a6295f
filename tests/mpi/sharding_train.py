"""Train a tiny MLP with the Trainer (any comm.shard, backend, optimizer); every rank saves
its final parameters and per-step losses.

    mpirun -n 4 python tests/mpi/sharding_train.py OUT [section.key=value ...]

Writes OUT/rank<R>.npz. The data, the model and the global batch (48: the same samples make
each step on 1 to 4 ranks) do not depend on the rank count, so runs on different rank
counts, backends and comm.shard modes can be compared; checkpoints go to OUT/checkpoints.
"""
import os
import sys

import numpy as np

from hpctrain import Trainer, load_config
from train_tiny import synthetic  # the same data as the other tiny runs


class Record:
    def __init__(self):
        self.losses = []

    def on_step(self, state, metrics, phase_times):
        self.losses.append(metrics["loss"])


def main(argv):
    out, overrides = argv[0], argv[1:]
    cfg = load_config(None, ["model.in_features=8", "model.hidden=24", "model.depth=2", "model.num_classes=4",
                             "train.global_batch_size=48", "train.lr=0.05", "train.epochs=1", "train.max_steps=10",
                             "data.val=none", "monitor.log_every=100", "monitor.progress=off",
                             "checkpoint.on_epoch_end=false", f"checkpoint.directory={out}/checkpoints",
                             f"run.root={out}/runs", *overrides])
    record = Record()
    trainer = Trainer(cfg, train_data=synthetic(960, 1), callbacks=[record])
    trainer.fit()
    state = trainer.state
    params = {f"p{i}": p.detach().cpu().numpy().copy() for i, p in enumerate(state.model.parameters())}
    np.savez(os.path.join(out, f"rank{trainer.world.rank}.npz"), losses=np.array(record.losses),
             steps=np.array(state.progress.step), **params)
    if trainer.world.rank == 0:
        print(f"DONE step {state.progress.step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
