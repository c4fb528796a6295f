#!/usr/bin/env bash
# The whole suite: unit tests, real multi-rank tests under mpirun, real Slurm, end-to-end.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -v --durations=15 "$@"
