"""``hpctrain train CONFIG [section.key=value ...]``, also ``python -m hpctrain.commands.train``; e.g.
``mpirun -n 4 hpctrain train examples/digits.toml train.batch_size=32``."""
import argparse
import sys

from ..config import load_config
from ..job import preemption
from ..runtime.coordination import abort_on_exception, all_or_none
from ..training.trainer import Trainer


def main(argv=None):
    """``hpctrain train CONFIG [section.key=value ...]``: 0 done, 3 stopped on request, 2 bad input,
    5 stopped by non-finite gradients (``train.on_nonfinite``), 4 a hang ended by the watchdog."""
    parser = argparse.ArgumentParser(
        prog="hpctrain train",
        description="Train data-parallel, or split into pipeline stages and tensor-parallel ranks as [parallel] "
                    "says; launch with mpirun or srun --mpi=pmix.",
        epilog="example: mpirun -n 4 hpctrain train examples/digits.toml train.batch_size=32 comm.backend=mpi")
    parser.add_argument("config", help="TOML configuration file")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override a configuration value, e.g. train.lr=0.05")
    args = parser.parse_args(argv)

    from ..runtime.world import init_world  # after the parser: `--help` without torch or MPI

    with abort_on_exception(None):  # before MPI there is no job to abort
        world = init_world()
    with abort_on_exception(world.comm, where=world.node):
        cfg = all_or_none(lambda: load_config(args.config, args.overrides), world.comm)
        preemption.install()  # Slurm's warning signals (USR1, TERM) become the stop flag
        result = Trainer(cfg, world=world, stop_requested=preemption.stop_requested).fit()
    if world.is_root:
        print(f"run directory: {result.run_dir}", flush=True)
    # a requested stop (after saving) exits 3: the job script requeues the job on it
    return preemption.EXIT_PREEMPTED if result.stopped else 0


if __name__ == "__main__":
    sys.exit(main())
