#!/usr/bin/env bash
# The README's run command: train the digits example on 2 ranks with Horovod and fp16
# gradient compression, checkpointing into parallel HDF5; prints the run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
args=(-n "$NP" --oversubscribe)
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-true}
exec mpirun "${args[@]}" --timeout 900 .venv/bin/hpctrain train examples/digits.toml "$@"
