#!/usr/bin/env bash
# Install hpctrain once for a whole cluster, as a module:
#
#   make install PREFIX=/opt/hpctrain/0.1.0 [MODULEFILES=/opt/modulefiles]
#   (or: PREFIX=... bash scripts/install.sh)
#
# Load the MPI and parallel HDF5 modules first: everything is built against what is loaded
# now (scripts/setup.sh, SETUP_MODE=site), and the modulefile loads the same modules again.
# What it leaves, none of it pointing back into this checkout:
#   $PREFIX/venv/                        the environment (torch, mpi4py, parallel h5py, Horovod, hpctrain)
#   $PREFIX/bin/hpctrain                 the command (the only name the module puts on PATH)
#   $PREFIX/share/hpctrain/install.json  what it was built against (`hpctrain doctor` compares)
#   $PREFIX/share/hpctrain/{examples,slurm}  the examples and job scripts (`hpctrain examples`)
#   $MODULEFILES/hpctrain/<version>.lua  for Lmod, and $MODULEFILES/hpctrain/<version> (Tcl) for
#                                        Environment Modules; MODULEFILES defaults to $PREFIX/modulefiles
#
# Variables: PREFIX (required), MODULEFILES, MODULE_VERSION (default: hpctrain's version),
# STACK_MODULES (the modules the modulefile loads; default: those loaded now whose names say
# MPI or HDF5), and those of scripts/setup.sh (PYTHON, TORCH_SPEC, HPCTRAIN_CACHE, ...).
# Use a Python every user can run (a site module's, or the system's): the environment links to it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf '[install] %s\n' "$*"; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 2; }

[ -n "${PREFIX:-}" ] || die "no PREFIX. HINT: make install PREFIX=/opt/hpctrain/<version>"
mkdir -p "$PREFIX" || die "cannot create $PREFIX. HINT: choose a PREFIX you may write to"
PREFIX=$(cd "$PREFIX" && pwd)
case $PREFIX/ in "$ROOT"/*) die "PREFIX $PREFIX is inside this checkout; the installation must outlive it. HINT: choose a PREFIX outside $ROOT" ;; esac
MODULEFILES=${MODULEFILES:-$PREFIX/modulefiles}
mkdir -p "$MODULEFILES"
MODULEFILES=$(cd "$MODULEFILES" && pwd)

facts=$(mktemp)
trap 'rm -f "$facts"' EXIT
say "building the environment in $PREFIX/venv"
VENV=$PREFIX/venv SETUP_MODE=site SETUP_FACTS=$facts bash "$ROOT/scripts/setup.sh"
# shellcheck disable=SC1090
. "$facts"

share=$PREFIX/share/hpctrain
rm -rf "$share/examples" "$share/slurm"
mkdir -p "$share/examples" "$share/slurm" "$PREFIX/bin"
cp -R "$ROOT"/examples/. "$share/examples/"
cp "$ROOT"/slurm/*.sbatch "$ROOT"/slurm/README.md "$share/slurm/"
find "$share" -name __pycache__ -prune -exec rm -rf {} +
ln -sfn ../venv/bin/hpctrain "$PREFIX/bin/hpctrain"

# The record and the modulefiles are written by the installed package itself (hpctrain.install).
"$PREFIX/venv/bin/python" -m hpctrain.install \
  --prefix "$PREFIX" --modulefiles "$MODULEFILES" ${MODULE_VERSION:+--module-version "$MODULE_VERSION"} \
  --mpirun "$MPIRUN" --mpicc "$MPICC" --mpi-version-line "$MPI_VERSION_LINE" --mpi-version "$MPI_VERSION" \
  --hdf5-version "$HDF5_VERSION" --hdf5-dir "$HDF5_DIR" --hdf5-pkgconfig "$HDF5_PKGCONFIG_NAME" \
  --torch-version "$TORCH_VERSION" --python-version "$PYTHON_VERSION" --cuda "$CUDA" \
  --loaded-modules "${LOADEDMODULES:-}" ${STACK_MODULES+--stack-modules "$STACK_MODULES"}

# Every user reads and runs it; only the installer writes.
chmod -R a+rX,go-w "$PREFIX" "$MODULEFILES"
