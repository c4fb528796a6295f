"""Run under mpirun: one rank leaves the block by a BaseException that is not an Exception
while the others wait in a collective. Every rank must end within seconds, non-zero, with the
rank and host named; only an exit that every rank takes alike ends the ranks normally.

    mpirun -n 2 python tests/mpi/exit_one_rank.py RANK MODE

MODE: exit3 (sys.exit(3)), exit0 (sys.exit(0)), interrupt (KeyboardInterrupt), base (a
BaseException subclass); everywhere: every rank raises everywhere(SystemExit(4)); collective:
an on_root error inside a nested abort_on_exception (every rank exits 2, no abort).
"""
import sys
import time

from mpi4py import MPI

from hpctrain.runtime.coordination import abort_on_exception, everywhere, on_root
from hpctrain.errors import ConfigError


class Cancelled(BaseException):
    """Like asyncio.CancelledError or a library's own BaseException: not an Exception."""


comm = MPI.COMM_WORLD
rank = comm.Get_rank()
failing, mode = int(sys.argv[1]), sys.argv[2]
with abort_on_exception(comm):
    comm.Barrier()
    print(f"rank {rank}: started", flush=True)
    if mode == "everywhere":
        raise everywhere(SystemExit(4))
    if mode == "collective":
        with abort_on_exception(comm):
            on_root(lambda: (_ for _ in ()).throw(ConfigError("bad value", hint="fix it")), comm)
    if rank == failing:
        time.sleep(0.5)  # let the others block first
        if mode == "exit3":
            sys.exit(3)
        if mode == "exit0":
            sys.exit(0)
        if mode == "interrupt":
            raise KeyboardInterrupt()
        if mode == "base":
            raise Cancelled(f"injected on rank {rank}")
        raise SystemExit(f"unknown mode {mode}")
    comm.allreduce(1)  # never completes: the failing rank does not join
    print(f"rank {rank}: allreduce passed", flush=True)
