"""A training job as a Python script: your own model and data, hpctrain's loop, launcher,
checkpoints, job scripts and requeue. It takes ``section.key=value`` overrides like
``hpctrain train`` does, and stops with a checkpoint (exit status 3) on Slurm's warning signal.

    mpirun -n 2 python examples/train_script.py
    mpirun -n 2 python examples/train_script.py train.lr=0.05 train.epochs=4 comm.compression=fp16
    sbatch slurm/train.sbatch examples/train_script.py train.epochs=4
    sbatch slurm/preemptible.sbatch examples/train_script.py         # checkpoints, requeues, resumes

The job scripts run it as ``python SCRIPT run.run_dir=RUN_DIR [checkpoint.resume=auto] ARGS``
(and export ``HPCTRAIN_RUN_DIR=RUN_DIR`` for scripts that read no overrides): a requeued job
comes back to the same run directory and resumes from its latest checkpoint.
"""
import sys

# First, before torch and MPI start (seconds): Slurm's warning signal (SIGUSR1) or SIGTERM must
# set the stop flag, not kill the rank. The trainer stops at the next step boundary, saves,
# and this script exits with status 3, which the job scripts requeue on.
from hpctrain.job import preemption

preemption.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from hpctrain import ArrayDataset, Trainer  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.runtime.coordination import abort_on_exception, all_or_none  # noqa: E402
from hpctrain.runtime.world import init_world  # noqa: E402

# This script's defaults; the command line's section.key=value overrides win.
DEFAULTS = ["run.name=spirals", "train.epochs=6", "train.batch_size=32", "train.optimizer=adam",
            "train.lr=0.01", "monitor.log_every=20"]


def spirals(samples, seed):
    """Two interleaved spirals, a classic that a linear model cannot learn."""
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.5, 3.5 * np.pi, samples)
    label = rng.integers(0, 2, samples)
    sign = np.where(label == 1, 1.0, -1.0)
    x = np.stack([sign * t * np.cos(t), sign * t * np.sin(t)], axis=1) / 6
    return (x + 0.05 * rng.standard_normal(x.shape)).astype(np.float32), label.astype(np.int64)


def model(width=64):
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))


def main(argv):
    world = init_world()
    with abort_on_exception(world.comm, where=world.node):
        # The same configuration on every rank, or the same error on every rank.
        cfg = all_or_none(lambda: load_config(None, DEFAULTS + argv), world.comm)
        x, y = spirals(4096, seed=cfg.run.seed)
        train, val = ArrayDataset(x[:3584], y[:3584]), ArrayDataset(x[3584:], y[3584:])
        torch.manual_seed(cfg.run.seed)
        result = Trainer(cfg, model=model(), train_data=train, val_data=val, world=world,
                         stop_requested=preemption.stop_requested).fit()
    if world.is_root:
        print(f"run directory: {result.run_dir}", flush=True)
    return preemption.EXIT_PREEMPTED if result.stopped else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
