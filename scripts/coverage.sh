#!/usr/bin/env bash
# Line coverage of hpctrain/ over every process the suite starts: the pytest process, every rank that
# mpirun or srun starts, and every `hpctrain` command a test runs (make coverage).
#
#   make coverage                      the whole suite; the report goes to coverage/ (report.txt, html/)
#   make coverage PYTEST_ARGS='-m "not slurm"'
#
# How: a .pth file in the venv starts coverage.py in any Python process that finds COVERAGE_PROCESS_START
# in its environment (mpirun, srun and sbatch pass the environment on to the ranks); each process writes its
# own data file (parallel = true) into one folder, combined at the end. A rank ended by SIGKILL or by
# MPI_Abort writes nothing: the lines it ran before are counted only where another process ran them too.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${VENV:-.venv}/bin/python
case $PY in /*) ;; *) PY=$ROOT/$PY ;; esac  # absolute: the report is made from inside $OUT
OUT=${COVERAGE_OUT:-coverage}

"$PY" -c 'import coverage' 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check 'coverage>=7.10'
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# One line, executed by site.py at every start of this venv's Python; it costs nothing unless the variable is set.
echo 'import os; os.environ.get("COVERAGE_PROCESS_START") and __import__("coverage").process_startup()' \
  > "$SITE/hpctrain-coverage.pth"

rm -rf "$OUT"
mkdir -p "$OUT/data"
export HPCTRAIN_COVERAGE_DATA="$ROOT/$OUT/data/.coverage"
export COVERAGE_PROCESS_START="$ROOT/scripts/coverage.rc"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
status=0
"$PY" -m pytest -p no:cacheprovider "$@" || status=$?
unset COVERAGE_PROCESS_START

cd "$OUT"
"$PY" -m coverage combine --quiet --rcfile="$ROOT/scripts/coverage.rc" data >/dev/null
"$PY" -m coverage report --rcfile="$ROOT/scripts/coverage.rc" --data-file=data/.coverage > report.txt
"$PY" -m coverage html --rcfile="$ROOT/scripts/coverage.rc" --data-file=data/.coverage -d html -q
"$PY" -m coverage json --rcfile="$ROOT/scripts/coverage.rc" --data-file=data/.coverage -o coverage.json -q
tail -n 1 report.txt
echo "coverage: $OUT/report.txt, $OUT/html/index.html (pytest exited $status)"
exit $status
