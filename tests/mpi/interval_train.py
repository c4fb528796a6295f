"""A tiny training run with checkpoint.auto_interval and a save and a step of known cost.

    mpirun -n 2 python tests/mpi/interval_train.py OUT_DIR SAVE_SLEEP STEP_SLEEP [section.key=value ...]

SAVE_SLEEP: seconds every rank sleeps inside each checkpoint write (in ``write_verified``,
so a synchronous save blocks for it and an asynchronous one does not); STEP_SLEEP: seconds
every rank sleeps in each step (a callback), so that the step time is known. Each rank
writes OUT_DIR/rank<R>.json: the end time of every step (``time.monotonic``) and each
checkpoint's step and the seconds ``maybe_save`` took, as the trainer's callbacks see them.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from synthetic_data import synthetic  # noqa: E402

from hpctrain import Trainer, load_config  # noqa: E402
from hpctrain.checkpoint import commit  # noqa: E402


class Record:
    def __init__(self, step_sleep):
        self.step_sleep, self.steps, self.saves = step_sleep, [], []

    def on_step(self, state, metrics, phase_times):
        time.sleep(self.step_sleep)
        self.steps.append((state.progress.step, time.monotonic()))

    def on_checkpoint(self, state, path, seconds):
        self.saves.append((state.progress.step, seconds, path))


def slow(function, seconds):
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)
    return wrapper


def main(argv):
    out, save_sleep, step_sleep, argv = argv[0], float(argv[1]), float(argv[2]), argv[3:]
    commit.write_verified = slow(commit.write_verified, save_sleep)
    cfg = load_config(None, ["model.in_features=8", "model.hidden=16", "model.depth=2", "model.num_classes=4",
                             "train.batch_size=8", "train.lr=0.05", "train.epochs=1000", "monitor.log_every=100",
                             "monitor.progress=log", "checkpoint.on_epoch_end=false", "checkpoint.on_finish=false",
                             "checkpoint.keep_last=0", "checkpoint.auto_interval=true", f"run.root={out}/runs",
                             *argv])
    record = Record(step_sleep)
    trainer = Trainer(cfg, train_data=synthetic(512, 1), callbacks=[record])
    trainer.fit()
    with open(os.path.join(out, f"rank{trainer.world.rank}.json"), "w") as f:
        json.dump({"steps": record.steps, "saves": record.saves}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
