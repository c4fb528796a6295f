"""Run under ``srun --mpi=pmix`` on several nodes: every rank says where hpctrain places it
(rank, size, local rank, node name), checked against MPI itself with one all-reduce; rank 0
writes what all ranks said to OUT as JSON.

    srun -N2 -n4 --mpi=pmix python tests/mpi/multinode_placement.py OUT
"""
import json
import socket
import sys

from hpctrain.runtime.world import init_world

world = init_world()
comm = world.comm
# a real collective across the nodes, not only the launcher's variables
assert comm.allreduce(1) == world.size, "the ranks do not form one MPI world"
said = {"rank": world.rank, "size": world.size, "local_rank": world.local_rank, "local_size": world.local_size,
        "node": world.node, "hostname": socket.gethostname(), "launcher": world.launcher}
everyone = comm.gather(said, root=0)
if world.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(everyone, f)
