"""Run under mpirun: an unhandled exception on one rank ends every rank, quickly."""
import sys
import time

from mpi4py import MPI

from hpctrain.runtime.coordination import abort_on_exception

comm = MPI.COMM_WORLD
failing = int(sys.argv[1])
with abort_on_exception(comm):
    if comm.Get_rank() == failing:
        time.sleep(0.5)
        raise RuntimeError("injected failure")
    comm.Barrier()  # the other ranks wait here: they must not hang
    print("barrier passed", flush=True)
