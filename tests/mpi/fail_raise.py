"""Run under mpirun: one rank raises while the others wait in a collective (an allreduce,
as in training). Every rank must end within seconds, with the failing rank and host named.

    mpirun -n 4 python tests/mpi/fail_raise.py FAILING_RANK
"""
import sys
import time

from mpi4py import MPI

from hpctrain.runtime.coordination import abort_on_exception

comm = MPI.COMM_WORLD
failing = int(sys.argv[1])
with abort_on_exception(comm):
    comm.Barrier()
    print(f"rank {comm.Get_rank()}: started", flush=True)
    if comm.Get_rank() == failing:
        time.sleep(0.5)  # let the others block first
        raise ValueError(f"injected failure on rank {failing}")
    comm.allreduce(1)  # never completes: the failing rank does not join
    print(f"rank {comm.Get_rank()}: allreduce passed", flush=True)
