"""Each rank reports the error a bad configuration gives it, then the job exits 2.

    mpirun -n 2 python tests/mpi/train_errors.py section.key=value ...

Prints ``rank R: <ExceptionType>: <message>`` on every rank, so a test can check that all
ranks failed the same way (and that none hung waiting for another).
"""
import os
import sys

import numpy as np

from hpctrain import ArrayDataset, HpctrainError, Trainer, load_config
from hpctrain.runtime.world import init_world


def main(overrides):
    world = init_world()
    data = ArrayDataset(np.zeros((64, 4), np.float32), np.zeros(64, np.int64))
    try:
        cfg = load_config(None, ["model.in_features=4", "model.num_classes=2", "train.max_steps=2",
                                 "run.root=/tmp/hpctrain-test-errors", *overrides])
        Trainer(cfg, train_data=data, world=world, checkpoints=None).fit()
    except HpctrainError as exc:
        # one write per line: the ranks share mpirun's stdout, and print() writes the
        # newline apart, so lines of two ranks could run together
        os.write(1, f"rank {world.rank}: {type(exc).__name__}: {' | '.join(str(exc).splitlines())}\n".encode())
        return exc.exit_code
    os.write(1, f"rank {world.rank}: no error\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
