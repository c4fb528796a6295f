"""A NaN in the gradient of one parameter only, on rank 0 only, at step 5: with comm.shard
only the rank whose slice holds that parameter sees it after the reduce-scatter, yet every
rank must skip the step (train.on_nonfinite=skip).

    mpirun -n 2 python tests/mpi/sharding_nonfinite.py OUT [section.key=value ...]

Writes OUT/rank<R>.npz: the flattened parameters after every step and the step numbers.
"""
import os
import sys

import numpy as np
import torch

from hpctrain import ArrayDataset, Trainer, load_config
from hpctrain.training import trainer as trainer_module

BAD_STEP = 5


class Record:
    def __init__(self):
        self.params, self.steps = [], []

    def on_step(self, state, metrics, phase_times):
        self.steps.append(state.progress.step)
        self.params.append(np.concatenate([p.detach().reshape(-1).numpy() for p in state.model.parameters()]))


def main(out, overrides):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((960, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    cfg = load_config(None, ["model.in_features=8", "model.hidden=24", "model.depth=2", "model.num_classes=4",
                             "train.global_batch_size=48", "train.max_steps=8", "train.optimizer=adamw",
                             "train.lr=0.01", "train.on_nonfinite=skip", "data.val=none", "monitor.progress=off",
                             "train.step_timeout=60",  # ranks that disagree would wait for each other
                             f"run.root={out}/runs", *overrides])
    record = Record()
    trainer = Trainer(cfg, train_data=ArrayDataset(x, y), checkpoints=None, callbacks=[record])
    torch.manual_seed(0)

    def poison(grad):
        # trainer.state exists once fit() has set up; step counts steps already taken
        if trainer.world.rank == 0 and trainer.state.progress.step + 1 == BAD_STEP:
            return grad * float("nan")
        return grad

    original = trainer_module.set_up

    def set_up(fitting, local):
        run = original(fitting, local)
        last_bias = list(run.state.model.parameters())[-1]  # in the last rank's slice
        last_bias.register_hook(poison)
        return run

    trainer_module.set_up = set_up
    trainer.fit()
    np.savez(os.path.join(out, f"rank{trainer.world.rank}.npz"), params=np.stack(record.params),
             steps=np.array(record.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
