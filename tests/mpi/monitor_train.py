"""Run under mpirun: the real Trainer with the Monitor as its callback, on a small synthetic
set, with evaluations; rank 0 writes RUN_DIR/metrics.jsonl.

    mpirun -n 2 python tests/mpi/monitor_train.py RUN_DIR [section.key=value ...]
"""
import sys

from mpi4py import MPI

from hpctrain.config import load_config
from hpctrain.monitoring.monitor import build_callbacks
from hpctrain.training.trainer import Trainer
from synthetic_data import synthetic


run_dir, overrides = sys.argv[1], sys.argv[2:]
cfg = load_config(None, ["model.in_features=8", "model.hidden=16", "model.num_classes=4", "train.batch_size=8",
                         "train.lr=0.2", "train.epochs=1", "train.max_steps=24", "train.eval_every=8",
                         "monitor.log_every=4", "monitor.consistency_every=8", "comm.backend=mpi",
                         f"run.run_dir={run_dir}", *overrides])
comm = MPI.COMM_WORLD
# The run directory is fixed here, so the callbacks can be built before fit() creates it.
callbacks = build_callbacks(cfg.monitor, run_dir, comm=comm, total_steps=cfg.train.max_steps,
                            samples_per_step=cfg.train.batch_size * comm.Get_size())
result = Trainer(cfg, train_data=synthetic(1024, 1), val_data=synthetic(128, 2), checkpoints=None,
                 callbacks=callbacks).fit()
print(f"rank {comm.Get_rank()}: trained {result.steps} steps", flush=True)
