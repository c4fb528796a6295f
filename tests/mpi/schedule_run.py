"""Train a tiny MLP under a learning-rate schedule, every step's learning rate in RUN_DIR/metrics.jsonl
(monitor.log_every=1); stops after step STOP_AT (0: runs to its budget), resumes from RUN_DIR's checkpoints.

    mpirun -n R python tests/mpi/schedule_run.py RUN_DIR STOP_AT [section.key=value ...]
"""
import sys

from hpctrain import Trainer, load_config
from synthetic_data import synthetic


def main(argv):
    run_dir, stop_at, overrides = argv[0], int(argv[1]), argv[2:]
    cfg = load_config(None, ["model.in_features=8", "model.hidden=16", "model.depth=1", "model.num_classes=2",
                             "train.batch_size=8", "train.lr=0.2", "train.optimizer=adamw", "train.warmup_steps=4",
                             "train.lr_schedule=cosine", "train.lr_min_ratio=0.1", "monitor.log_every=1",
                             "monitor.progress=off", "checkpoint.every_steps=5", "checkpoint.resume=auto",
                             "comm.backend=mpi", f"run.run_dir={run_dir}", *overrides])
    stop = (lambda: trainer.state.progress.step >= stop_at) if stop_at else None
    trainer = Trainer(cfg, train_data=synthetic(256, 1, classes=2), stop_requested=stop)
    trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1:])
