"""Train every equivalence scenario of tests/test_equivalence.py, one after another in one
process, with whichever hpctrain is first on the import path.

    mpirun -n 2 python tests/mpi/equivalence_run.py OUT first  [SCENARIO ...]   # stops at step STOP_AT
    mpirun -n 1 python tests/mpi/equivalence_run.py OUT resume [SCENARIO ...]   # resumes, trains to the end

Each scenario trains in OUT/<scenario> (run.run_dir) and writes its checkpoints to
OUT/<scenario>/checkpoints. Rank 0 prints ``HPCTRAIN_FILE <hpctrain.__file__>`` (which copy of
the code ran) and one ``SCENARIO <name> <phase> stopped=<bool> step=<n>`` line per scenario.

Only the public API that both the code before and after the package redesign have is used,
so that the very same script drives both.
"""
import random
import sys
import traceback

import numpy as np

import hpctrain
from hpctrain import Trainer, TrainConfig, load_config  # noqa: F401 (TrainConfig: the API's)
from synthetic_data import synthetic

STOP_AT = 5  # mid-epoch 2 (4 steps per epoch), between two step-interval checkpoints
COMMON = [
    "model.in_features=8", "model.hidden=16", "model.depth=2", "model.num_classes=4",
    # The global batch, not the per-rank one: 2 ranks and 1 rank walk the same data order.
    "train.global_batch_size=16", "train.lr=0.2", "train.momentum=0.9", "train.epochs=3",
    "checkpoint.every_steps=2", "checkpoint.keep_last=0", "checkpoint.resume=auto",
    "monitor.progress=off", "monitor.log_every=100", "run.seed=7",
]
# name -> (overrides of the 2-rank launch, overrides of the 1-rank resume)
SCENARIOS = {
    "sync": ([], []),
    "local_sgd": (["comm.mode=local_sgd", "comm.sync_every=2"], ["comm.mode=local_sgd", "comm.sync_every=2"]),
    "stale": (["comm.mode=stale"], ["comm.mode=stale"]),
    "shard_optimizer": (["comm.shard=optimizer"], ["comm.shard=optimizer"]),
    # 2 stages on 2 ranks: one replica. The split checkpoint resumes in the dense model.
    "pipeline": (["parallel.stages=2", "parallel.micro_batches=2"], ["parallel.stages=1"]),
}


def run(out, phase, name):
    first, resume = SCENARIOS[name]
    cfg = load_config(None, [*COMMON, *(first if phase == "first" else resume), f"run.run_dir={out}/{name}"])
    # Checkpoints hold rank 0's global numpy and Python generator states (trainer/rng), which
    # hpctrain does not seed (it re-seeds torch every step): seeded here, so the files repeat.
    random.seed(11)
    np.random.seed(11)
    stop = None
    if phase == "first":
        # Every rank asks at the same step: a deterministic stop, no signal racing the loop.
        stop = lambda: trainer.state.progress.step >= STOP_AT  # noqa: E731
    trainer = Trainer(cfg, train_data=synthetic(64, 1), val_data=synthetic(32, 2), stop_requested=stop)
    result = trainer.fit()
    if trainer.world.rank == 0:
        print(f"SCENARIO {name} {phase} stopped={result.stopped} step={result.steps}", flush=True)
    return result


def main(argv):
    out, phase, names = argv[0], argv[1], argv[2:] or list(SCENARIOS)
    if phase not in ("first", "resume"):
        raise SystemExit(f"phase must be 'first' or 'resume', not {phase!r}")
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"HPCTRAIN_FILE {hpctrain.__file__}", flush=True)
    for name in names:
        try:
            run(out, phase, name)
        except BaseException:
            # One rank failing alone would leave the others waiting in a collective.
            traceback.print_exc()
            sys.stderr.write(f"SCENARIO {name} {phase} FAILED on rank {MPI.COMM_WORLD.Get_rank()}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
