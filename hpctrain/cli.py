"""The ``hpctrain`` command. Each subcommand lives in its own module and is imported only
when used, so ``hpctrain --help`` and ``hpctrain doctor`` stay fast on a login node.

    hpctrain doctor [--json]                  check the stack (MPI, parallel h5py, Horovod, torch)
    mpirun -n 4 hpctrain train CONFIG [k=v]   train data-parallel
    hpctrain launch [-n N] CONFIG [k=v]       start the ranks, restart the job after a failure
    hpctrain ckpt list|inspect|verify|export  work with checkpoints
    hpctrain report RUN_DIR                   plots and a summary of a run
    hpctrain examples [--copy DIR]            where the examples and job scripts are; copy them
"""
import argparse
import importlib
import sys

from . import __version__

# subcommand -> (module, help). Each module has ``main(argv) -> int``.
SUBCOMMANDS = {
    "doctor": ("hpctrain.commands.doctor", "check that this machine can run a parallel job, and say how to fix it"),
    "train": ("hpctrain.commands.train", "train a model data-parallel (launch under mpirun or srun)"),
    "launch": ("hpctrain.commands.launch", "start the ranks of a training job and restart it when it fails"),
    "ckpt": ("hpctrain.commands.ckpt", "list, inspect, verify and export checkpoints"),
    "report": ("hpctrain.commands.report", "write plots and a summary of a finished run"),
    "examples": ("hpctrain.commands.examples", "print where the examples and job scripts are, or copy them (--copy DIR)"),
}


def build_parser():
    parser = argparse.ArgumentParser(prog="hpctrain", description="Data-parallel PyTorch training on HPC clusters.",
                                     epilog="Run `hpctrain COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        # Before the slow imports (torch, mpi4py) and MPI start: a warning signal during start-up must set the
        # stop flag, not kill the rank (SIGUSR1's default action). The trainer's install() keeps the flag.
        from .job import preemption
        preemption.install()
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
