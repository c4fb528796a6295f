#!/usr/bin/env bash
# The whole suite: unit tests, real multi-rank tests under mpirun, real Slurm, end-to-end (make test).
# Three pytest-xdist workers: the tests on the single-node Slurm cluster, those on the multi-node one and the
# installation's each start in order on a worker of their own (the first two mostly wait: for jobs to be
# scheduled, SlurmdTimeout, a real time limit); the other tests go to whichever worker is free
# (tests/conftest.py sets the groups and their order).
# docs/testing.md has the tiers; `make test PYTEST_ARGS="-n 0"` runs everything in one process, in order.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -v --durations=30 -n 3 --dist loadgroup --no-loadscope-reorder "$@"
