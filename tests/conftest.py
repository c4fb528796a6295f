import os
import sys

# The harness modules (mpi_harness, slurm_cluster) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
