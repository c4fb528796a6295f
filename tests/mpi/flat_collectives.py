"""The sharding collectives of a backend on uneven parts (one part empty), checked against
the values every rank can compute: reduce_scatter_mean, the bucket average
(start_average/wait_average), allgather_flat, and the Horovod backend's broadcast all-gather
(its GPU path) on CPU tensors.

    mpirun -n 3 python tests/mpi/flat_collectives.py horovod|mpi

Prints ``FLAT OK <backend>`` on rank 0; raises on every rank otherwise.
"""
import sys

import torch

from hpctrain.backends import get_backend
from hpctrain.runtime.world import init_world


def main(backend_name):
    world = init_world()
    backend = get_backend(backend_name, world)
    rank, size = world.rank, world.size
    counts = [5, 0, 7][:size] if size == 3 else [4] * size
    total = sum(counts)
    base = torch.arange(total, dtype=torch.float32)
    mine = base * (rank + 1)  # the mean over ranks is base * (size + 1) / 2
    expected = base * (size + 1) / 2
    lo = sum(counts[:rank])
    part = backend.reduce_scatter_mean(mine.clone(), counts)
    torch.testing.assert_close(part, expected[lo:lo + counts[rank]])
    averaged = backend.wait_average(backend.start_average(mine.clone(), name="flat-test"))
    torch.testing.assert_close(averaged, expected)
    gathers = [("allgather_flat", backend.allgather_flat)]
    if hasattr(backend, "allgather_by_broadcasts"):
        gathers.append(("allgather_by_broadcasts", backend.allgather_by_broadcasts))
    for name, gather in gathers:
        flat = torch.full((total,), -1.0)
        flat[lo:lo + counts[rank]] = base[lo:lo + counts[rank]]  # this rank holds only its part
        gather(flat, counts)
        assert torch.equal(flat, base), f"{name} on rank {rank}: {flat.tolist()}"
    if rank == 0:
        print(f"FLAT OK {backend_name} {[n for n, _ in gathers]}", flush=True)


if __name__ == "__main__":
    from mpi4py import MPI

    from hpctrain.runtime.coordination import abort_on_exception

    with abort_on_exception(MPI.COMM_WORLD):
        main(sys.argv[1])
