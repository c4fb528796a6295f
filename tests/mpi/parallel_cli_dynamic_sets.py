"""Horovod already running (a data-parallel backend made first), then a split model whose
replicas need process sets: added dynamically with HOROVOD_DYNAMIC_PROCESS_SETS=1, else a
clear BackendUnavailable on every rank.

    HOROVOD_DYNAMIC_PROCESS_SETS=1 mpirun -n 4 python tests/mpi/parallel_cli_dynamic_sets.py
"""
import torch
from torch import nn

from hpctrain.backends import get_backend
from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.parallel import HybridParallel, Layout
from hpctrain.runtime.world import init_world


def main():
    world = init_world()
    get_backend("horovod", world)  # hvd.init without process sets
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    try:
        hp = HybridParallel(model, Layout(stages=2), nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1),
                            micro_batches=2, backend="horovod")
    except Exception as exc:
        print(f"RANK {world.rank} ERROR {type(exc).__name__}", flush=True)
        raise
    g = torch.Generator().manual_seed(1)
    loss = hp.train_step(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    sums = [float(p.detach().sum()) for p in hp.module.parameters()]
    assert all(s == hp.grid.dp_comm.allgather(sums)[0] for s in hp.grid.dp_comm.allgather(sums))
    print(f"RANK {world.rank} DYNAMIC SETS OK {hp.backend.describe()} loss {loss:.4f}", flush=True)
    world.comm.Barrier()


if __name__ == "__main__":
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        main()
