"""Train a tiny MLP whose loss is NaN on the last rank at chosen steps (once each), so that its
gradient, averaged over ranks, makes every rank's gradients non-finite at those steps.

    mpirun -n 2 python tests/mpi/nonfinite_train.py OUT_DIR --bad 5,6 [--checkpoints] [section.key=value ...]

Writes OUT_DIR/rank<R>.npz (the flattened parameters after every step, in callback order, with
their step numbers and learning rates) and, on rank 0, OUT_DIR/result.json (FitResult and
progress.extra). A NonFiniteError is printed as ``RANK <r> NONFINITE <message>`` on every rank
and ends the script with its exit code.
"""
import dataclasses
import json
import os
import sys

import numpy as np
import torch

from hpctrain import Trainer, load_config
from hpctrain.training.nonfinite import NonFiniteError
from synthetic_data import synthetic


class PoisonedLoss:
    """Cross-entropy, times NaN on the last rank in the training pass of each ``bad`` step
    (each only once: a step replayed after a rollback is clean)."""

    def __init__(self, bad):
        self.bad, self.fired, self.trainer = set(bad), set(), None
        self.ce = torch.nn.CrossEntropyLoss()

    def __call__(self, out, y):
        loss = self.ce(out, y)
        world, step = self.trainer.world, self.trainer.state.progress.step + 1
        if torch.is_grad_enabled() and world.rank == world.size - 1 and step in self.bad - self.fired:
            self.fired.add(step)
            return loss * float("nan")
        return loss


class Record:
    def __init__(self):
        self.steps, self.params, self.lrs = [], [], []

    def on_step(self, state, metrics, phase_times):
        self.steps.append(state.progress.step)
        self.lrs.append(metrics["lr"])
        self.params.append(torch.cat([p.detach().reshape(-1) for p in state.model.parameters()]).numpy().copy())


def main(argv):
    out, argv = argv[0], argv[1:]
    bad, checkpoints = [], None
    while argv and argv[0].startswith("--"):
        if argv[0] == "--bad":
            bad, argv = [int(s) for s in argv[1].split(",")], argv[2:]
        elif argv[0] == "--checkpoints":
            checkpoints, argv = "auto", argv[1:]
        else:
            raise SystemExit(f"unknown option {argv[0]}")
    cfg = load_config(None, ["model.in_features=8", "model.hidden=16", "model.depth=2", "model.num_classes=4",
                             "train.batch_size=8", "train.lr=0.3", "train.momentum=0.9", "train.epochs=1",
                             "train.max_steps=12", "monitor.log_every=4", "comm.backend=mpi",
                             "checkpoint.every_steps=2", "checkpoint.keep_last=0", f"run.root={out}/runs", *argv])
    record, loss = Record(), PoisonedLoss(bad)
    trainer = Trainer(cfg, train_data=synthetic(512, 1), val_data=synthetic(128, 2), checkpoints=checkpoints,
                      callbacks=[record], loss_fn=loss)
    loss.trainer = trainer
    code, result = 0, None
    try:
        result = trainer.fit()
    except NonFiniteError as exc:
        print(f"RANK {trainer.world.rank} NONFINITE {exc}", flush=True)
        code = exc.exit_code
    rank = trainer.world.rank
    np.savez(os.path.join(out, f"rank{rank}.npz"), steps=np.array(record.steps), lrs=np.array(record.lrs),
             params=np.array(record.params))
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"result": dataclasses.asdict(result) if result else None, "run_dir": trainer.run.run_dir,
                       "extra": trainer.state.progress.extra}, f)
    # A rank that exits non-zero makes mpirun end the others: every rank first says its part.
    trainer.world.comm.Barrier()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
