#!/usr/bin/env bash
# The whole suite: unit tests, real multi-rank tests under mpirun, real Slurm, end-to-end (make test).
# Two pytest-xdist workers: the tests on the Slurm clusters run in order on one (they mostly wait: for jobs to
# be scheduled, SlurmdTimeout, a real time limit), beside the tests that compute on the other; the first takes
# tests of the rest once the Slurm tests are done.
# docs/testing.md has the tiers; `make test PYTEST_ARGS="-n 0"` runs everything in one process, in order.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -v --durations=30 -n 2 --dist loadgroup "$@"
