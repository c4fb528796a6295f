#!/usr/bin/env bash
# The README's run command: train the digits example on 2 ranks with Horovod ring
# all-reduce and fp16 gradient compression, checkpointing collectively into parallel HDF5,
# then write the run's plots. Prints where every output is.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
args=(-n "$NP" --oversubscribe)
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
mpirun "${args[@]}" --timeout 900 .venv/bin/hpctrain train examples/digits.toml comm.compression=fp16 "$@" | tee "$log"
run_dir=$(sed -n 's/^run directory: //p' "$log" | tail -n1)
[ -n "$run_dir" ] || { echo "demo: the run printed no run directory" >&2; exit 1; }
.venv/bin/hpctrain report "$run_dir" >/dev/null
cat <<TXT

Outputs of this run, in $run_dir:
  config.toml      the resolved configuration
  metrics.jsonl    one JSON line per logging interval (loss, throughput, per-rank phase times)
  checkpoints/     HDF5 checkpoints and the 'latest' pointer; try: h5ls -r $run_dir/checkpoints/\$(cat $run_dir/checkpoints/latest)
  report/          plots (PNG) and summary.txt, written by: .venv/bin/hpctrain report $run_dir
Verify a checkpoint: .venv/bin/hpctrain ckpt verify $run_dir/checkpoints/\$(cat $run_dir/checkpoints/latest)
TXT
