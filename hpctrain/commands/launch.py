"""``hpctrain launch``: start the ranks of a training job, and relaunch it when it fails.

    hpctrain launch -n 4 examples/digits.toml train.global_batch_size=48     # mpirun -n 4 ...
    sbatch -N 4 --ntasks-per-node=8 --wrap "hpctrain launch --max-restarts 5 job.toml"  # srun --mpi=pmix

It trains as ``hpctrain train`` does, in one run directory that every launch is given. Inside a Slurm
allocation the ranks are started with ``srun --mpi=pmix`` (the allocation decides how many), elsewhere with
``mpirun -n RANKS``. What it restarts, on how many ranks, and what it records: :mod:`hpctrain.job.relaunch`. A
hang is ended only by the watchdog: set ``train.step_timeout`` (or ``HPCTRAIN_WATCHDOG_TIMEOUT``)."""
import argparse
import sys

from ..errors import HpctrainError
from ..job.launchers import PROGRAM, say
from ..job.plan import make_plan
from ..job.relaunch import Supervisor


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description="Start the ranks of `hpctrain train` (srun --mpi=pmix inside a Slurm "
                                 "allocation, else mpirun) and relaunch the job from its newest checkpoint "
                                 "when it fails.",
        epilog="example: hpctrain launch -n 4 --max-restarts 3 --shrink examples/digits.toml "
               "train.global_batch_size=48 train.step_timeout=300. Set train.global_batch_size to keep the "
               "training the same on fewer ranks, and train.step_timeout to have a hang ended and relaunched.")
    parser.add_argument("-n", type=int, default=None, metavar="RANKS",
                        help="ranks to start (outside Slurm; inside an allocation its tasks decide)")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="N", help="relaunches at most (default 3)")
    parser.add_argument("--min-ranks", type=int, default=1, metavar="M",
                        help="stop rather than relaunch on fewer ranks (default 1)")
    parser.add_argument("--shrink", action="store_true",
                        help="on one node, relaunch without a failed rank's slot (one rank fewer)")
    parser.add_argument("--exclude", default="", metavar="NODES",
                        help="inside a Slurm allocation, start without these nodes (comma-separated), as a "
                             "relaunch leaves out a node that failed")
    parser.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                        help="auto: srun inside a Slurm allocation, else mpirun")
    parser.add_argument("--launcher-args", "--mpirun-args", "--srun-args", dest="launcher_args", default="",
                        metavar="ARGS", help="more arguments for mpirun or srun, one string "
                                             "(e.g. --mpirun-args='--oversubscribe --bind-to none')")
    parser.add_argument("--spares", type=int, default=1, metavar="SETS",
                        help="sets of warm spare ranks kept started for the next relaunch (default 1; 0: none). "
                             "Started once training runs, they wait without using a core, holding about the "
                             "memory the ranks hold at start-up; a relaunch calls them instead of starting "
                             "ranks (under srun: a step of the allocation, srun --overlap)")
    parser.add_argument("--spares-memory", type=float, default=0, metavar="MIB",
                        help="end a warm spare set that holds more resident memory than this once up, and keep "
                             "none after it (default 0: not bounded)")
    parser.add_argument("--start-timeout", type=float, default=600, metavar="SECONDS",
                        help="end and relaunch a launch whose ranks are not through start-up (imports, MPI; rank 0 "
                             "writing the run's config.toml) in this time (default 600; 0: no limit). A TOML "
                             "configuration's ranks only: a script's need not write config.toml")
    parser.add_argument("--warm-pool", action=argparse.BooleanOptionalAction, default=True,
                        help="fork this host's ranks (mpirun's) from one process that did their imports once, at "
                             "every launch, relaunch and spare set (default: on; --no-warm-pool: each rank imports)")
    parser.add_argument("--python", default=None, help="the Python the ranks run (default: this one)")
    parser.add_argument("config", help="TOML configuration file, or a Python training script (.py) that takes "
                                       "section.key=value overrides")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override a configuration value, e.g. train.lr=0.05")
    return parser


def main(argv=None):
    """0 done; 2 bad input (never restarted); 3 stopped on request (passed on); 5 diverged (not
    restarted); otherwise the status of the last failure when restarts ran out."""
    args = build_parser().parse_args(argv)
    try:
        plan = make_plan(args)
    except HpctrainError as exc:
        say(f"error: {exc}\nnot started (and nothing would be restarted: the same error would repeat)")
        return exc.exit_code
    return Supervisor(plan).run()


if __name__ == "__main__":
    sys.exit(main())
