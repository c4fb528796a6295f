"""Run a script as if this rank stood on the node ``NODES`` names for it (``NODES=a,b``: rank 0 on a, rank 1
on b), by setting ``SLURMD_NODENAME`` as slurmd does: two nodes on one machine, for the node-local level's
copies on the next node.

    mpirun -n 2 -x NODES=a,b python tests/mpi/as_node.py SCRIPT [ARGS ...]
"""
import os
import runpy
import sys

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
os.environ["SLURMD_NODENAME"] = os.environ["NODES"].split(",")[rank]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
