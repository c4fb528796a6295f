"""Run under mpirun: one rank hangs inside a watched step while the others wait for it in
an allreduce. Its watchdog (short timeout) must dump the stacks, name the rank and host,
and abort every rank; the others' watchdogs have a long timeout so that it is the hanging
rank that fires.

    mpirun -n 2 python tests/mpi/fail_hang.py HANGING_RANK TIMEOUT
"""
import sys
import time

from mpi4py import MPI

from hpctrain.job.watchdog import Watchdog

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
hanging, timeout = int(sys.argv[1]), float(sys.argv[2])


def slow_io_that_never_returns():
    time.sleep(3600)


watchdog = Watchdog(timeout=timeout if rank == hanging else 600, comm=comm)
for step in range(3):
    with watchdog.step(step):
        if step == 2 and rank == hanging:
            print(f"rank {rank}: hanging in step {step}", flush=True)
            slow_io_that_never_returns()
        comm.allreduce(step)
    print(f"rank {rank}: step {step} done", flush=True)
watchdog.close()
print(f"rank {rank}: finished", flush=True)
