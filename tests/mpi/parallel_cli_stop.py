"""A split run through the trainer of ``hpctrain train`` that is asked to stop after step K
(as a Slurm warning signal would ask it), at a known step instead of a racing signal.

    mpirun -n 4 python tests/mpi/parallel_cli_stop.py K CONFIG [section.key=value ...]

Exits 3 (as ``hpctrain train`` does when stopped) after the trainer saved and stopped.
"""
import sys

from hpctrain.config import load_config
from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.job.preemption import EXIT_PREEMPTED
from hpctrain.training.trainer import Trainer
from hpctrain.runtime.world import init_world


def main(stop_after, config, overrides):
    world = init_world()
    with abort_on_exception(world.comm, where=world.node):
        trainer = Trainer(load_config(config, overrides), world=world,
                          stop_requested=lambda: trainer.state.progress.step >= stop_after)
        result = trainer.fit()
    print(f"RANK {world.rank} STOPPED {result.stopped} AT {result.steps}", flush=True)
    return EXIT_PREEMPTED if result.stopped else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
