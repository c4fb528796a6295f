"""Layouts that cannot work must fail on every rank with a clear message, never hang.

    mpirun -n 4 python tests/mpi/parallel_misconfig.py {indivisible,replicas,layers,width,balance}

Every rank prints ``RANK r ERROR <type>`` before the error ends the job.
"""
import sys

import torch
from torch import nn

from hpctrain.runtime.coordination import abort_on_exception
from hpctrain.parallel import HybridParallel, Layout
from hpctrain.parallel.tensor import MLPBlock

CASES = {
    # (layout, model layers, balance)
    "indivisible": (Layout(stages=3), 6, "params"),           # 4 ranks, replicas of 3
    "replicas": (Layout(stages=2, replicas=3), 6, "params"),  # needs 6 ranks
    "layers": (Layout(stages=4), 3, "params"),                # more stages than layers
    "width": (Layout(tensor=4), 0, "params"),                 # hidden width 6 over 4 ranks
    "balance": (Layout(stages=2), 6, [5, 2]),                 # counts do not sum to 6
}


def main(case):
    from mpi4py import MPI

    layout, nlayers, balance = CASES[case]
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(nlayers)] or [nn.Linear(4, 4), MLPBlock(4, 6)]
    try:
        HybridParallel(layers, layout, nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1), balance=balance)
    except Exception as exc:
        print(f"RANK {MPI.COMM_WORLD.Get_rank()} ERROR {type(exc).__name__}", flush=True)
        raise
    print(f"RANK {MPI.COMM_WORLD.Get_rank()} NO ERROR", flush=True)


if __name__ == "__main__":
    from mpi4py import MPI

    with abort_on_exception(MPI.COMM_WORLD):
        main(sys.argv[1])
