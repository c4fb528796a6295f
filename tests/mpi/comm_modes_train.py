"""Train with a ``comm.mode`` and record what every rank held after every step.

    mpirun -n 4 python tests/mpi/comm_modes_train.py OUT_DIR [--linear | --batchnorm] [--stop-at STEP]
        [--checkpoints] [section.key=value ...]

Writes OUT_DIR/rank<R>.npz: the final parameters (p0, p1, ...), ``prints`` (one CRC of all
bytes of ``state_dict()``, parameters and buffers, per step), ``steps``, and the mode's counters
(``applied``: averages the stale mode applied, ``syncs``: local_sgd averages, ``sent_bytes``).
``--linear``: a linear model whose
loss is the mean of its outputs, so every gradient is fixed by the data alone, not the
parameters: with plain SGD the final parameters are the initial ones minus lr x the sum of
the applied gradients, whichever step each was applied at. ``--batchnorm``: an MLP with a
batch-norm layer, whose running statistics are buffers that local SGD must average too.
"""
import os
import sys
import zlib

import numpy as np

from hpctrain import Trainer, load_config
from synthetic_data import synthetic


class Record:
    def __init__(self):
        self.prints = []

    def on_step(self, state, metrics, phase_times):
        crc = 0
        for t in state.model.state_dict().values():
            crc = zlib.crc32(t.detach().cpu().numpy().tobytes(), crc)
        self.prints.append(crc)


def mean_output(out, y):
    return out.mean()


def main(argv):
    import torch

    out, argv = argv[0], argv[1:]
    stop_at, checkpoints, linear, batchnorm = None, None, False, False
    while argv and argv[0].startswith("--"):
        flag, argv = argv[0], argv[1:]
        if flag == "--stop-at":
            stop_at, argv = int(argv[0]), argv[1:]
        elif flag == "--checkpoints":
            checkpoints = "auto"
        elif flag == "--linear":
            linear = True
        elif flag == "--batchnorm":
            batchnorm = True
        else:
            raise SystemExit(f"unknown option {flag}")
    cfg = load_config(None, ["model.in_features=8", "model.hidden=16", "model.depth=2", "model.num_classes=4",
                             "train.batch_size=8", "train.lr=0.3", "train.epochs=1", "train.max_steps=12",
                             "monitor.log_every=4", f"run.root={out}/runs", *argv])
    model = None
    if linear:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
    elif batchnorm:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
    record = Record()
    trainer = Trainer(cfg, model=model, train_data=synthetic(512, 1), val_data=synthetic(128, 2),
                      checkpoints=checkpoints, callbacks=[record], loss_fn=mean_output if linear else None)
    if stop_at is not None:
        trainer.stop_requested = lambda: trainer.state.progress.step >= stop_at
    result = trainer.fit()
    mode = trainer.state.comm_mode
    params = {f"p{i}": p.detach().cpu().numpy() for i, p in enumerate(trainer.state.model.parameters())}
    np.savez(os.path.join(out, f"rank{trainer.world.rank}.npz"), prints=np.array(record.prints, dtype=np.int64),
             steps=np.array(trainer.state.progress.step), applied=np.array(getattr(mode, "applied", -1)),
             syncs=np.array(getattr(mode, "syncs", -1)), sent_bytes=np.array(mode.sent_bytes), **params)
    return 3 if result.stopped else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
