"""Train a tiny MLP on a fixed synthetic set; every rank saves its final parameters.

    mpirun -n 2 python tests/mpi/train_tiny.py OUT_DIR [--stop-at STEP] [--checkpoints] [section.key=value ...]

Writes OUT_DIR/rank<R>.npz (parameters, this rank's per-step losses) and, on rank 0,
OUT_DIR/result.json (FitResult, and ``horovod_at_resume``: whether Horovod ran while the checkpoint
manager resumed, None where it was not asked to). The data and the model are the same on every launch, so
runs with different rank counts, backends or compression can be compared.
"""
import dataclasses
import json
import os
import sys

import numpy as np

from hpctrain import Trainer, load_config
from synthetic_data import synthetic


class Record:
    def __init__(self):
        self.losses, self.phases = [], []

    def on_step(self, state, metrics, phase_times):
        self.losses.append(metrics["loss"])
        self.phases.append(phase_times)


def watch_resume():
    """``{"horovod": ...}``, filled when the checkpoint manager resumes: whether Horovod runs then (observed only)."""
    from hpctrain.checkpoint import CheckpointManager

    seen, resume = {"horovod": None}, CheckpointManager.resume

    def watched(self, state):
        import horovod.torch as hvd

        seen["horovod"] = bool(hvd.is_initialized())
        return resume(self, state)

    CheckpointManager.resume = watched
    return seen


def main(argv):
    out, argv = argv[0], argv[1:]
    stop_at, checkpoints = None, None
    while argv and argv[0].startswith("--"):
        if argv[0] == "--stop-at":
            stop_at, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--checkpoints":  # hpctrain.checkpoint's manager, in <run.run_dir>/checkpoints
            checkpoints, argv = "auto", argv[1:]
        else:
            raise SystemExit(f"unknown option {argv[0]}")
    cfg = load_config(None, ["model.in_features=8", "model.hidden=16", "model.depth=2", "model.num_classes=4",
                             "train.batch_size=8", "train.lr=0.3", "train.momentum=0.9", "train.epochs=1",
                             "train.max_steps=12", "monitor.log_every=4", f"run.root={out}/runs", *argv])
    record, seen = Record(), watch_resume()
    trainer = Trainer(cfg, train_data=synthetic(512, 1), val_data=synthetic(128, 2), checkpoints=checkpoints,
                      callbacks=[record])
    if stop_at is not None:
        # Only the last rank asks to stop: every rank must still stop after the same step.
        trainer.stop_requested = lambda: (trainer.world.rank == trainer.world.size - 1
                                          and trainer.state.progress.step >= stop_at)
    result = trainer.fit()
    rank = trainer.world.rank
    params = {f"p{i}": p.detach().cpu().numpy() for i, p in enumerate(trainer.state.model.parameters())}
    assert set(record.phases[0]) >= {"data", "forward_backward", "allreduce_wait", "optimizer", "checkpoint"}
    np.savez(os.path.join(out, f"rank{rank}.npz"), losses=np.array(record.losses),
             steps=np.array(trainer.state.progress.step), **params)
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(dataclasses.asdict(result) | {"horovod_at_resume": seen["horovod"]}, f)
    return 3 if result.stopped else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
