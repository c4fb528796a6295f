"""Every communicator hpctrain makes is ready for mpi4py's object reductions before training starts: mpi4py
sets one up (a collective MPI_Comm_dup, holding the GIL) on the first ``comm.allreduce``, and doing that in the
middle of a step can deadlock with Horovod's background thread. mpi4py counts object reductions per
communicator (its context's tag): 0 means none ran yet, so the next one would set the context up.

    mpirun -n 4 python tests/mpi/object_reductions_ready.py
"""
from mpi4py import MPI

from hpctrain.parallel import Layout
from hpctrain.parallel.layout import ProcessGrid
from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.runtime.world import init_world


def reductions_so_far(comm):
    return MPI._commctx_intra(comm)[1]  # creates the context where there was none (then 0)


def main():
    world = init_world(comm=MPI.COMM_WORLD.Dup())  # a communicator nothing has reduced over yet
    grid = ProcessGrid.build(Layout(stages=2), world.comm)
    comms = {"world": world.comm, "pipeline": grid.pp_comm, "replicas": grid.dp_comm,
             "tensor": grid.tp_comm, "stage": grid.stage_comm}
    counts = {name: reductions_so_far(c) for name, c in comms.items()}
    print(f"RANK {world.rank} REDUCTIONS BEFORE TRAINING {sorted(counts.items())}", flush=True)
    assert all(n >= 1 for n in counts.values()), counts
    print(f"RANK {world.rank} READY", flush=True)


if __name__ == "__main__":
    with abort_on_exception(MPI.COMM_WORLD):
        main()
