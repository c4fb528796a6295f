#!/usr/bin/env bash
# Benchmarks (make bench): all-reduce bandwidth, training step against DDP, checkpoint I/O,
# memory and step time of comm.shard (benchmarks/zero_memory.py),
# scaling. Prints a table; JSON and table.md go to bench-results/<timestamp>/.
#   BENCH_QUICK=1   small sizes and few steps (~2 minutes instead of ~30)
#   BENCH_ONLY=allreduce,ckpt_io   only the launches whose names start so
# Each launch runs under mpirun with a timeout; see benchmarks/run_all.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python benchmarks/run_all.py "$@"
