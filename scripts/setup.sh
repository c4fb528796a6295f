#!/usr/bin/env bash
# One idempotent setup of the hpctrain stack into ./.venv.
#
#   make setup            (or: bash scripts/setup.sh)
#   VENV=/opt/hpctrain/0.1.0/venv SETUP_MODE=site bash scripts/setup.sh   (what `make install` runs)
#
# Order of preference for MPI and parallel HDF5:
#   1. what the cluster's modules put on PATH (mpicc; h5pcc, HDF5_DIR or pkg-config),
#   2. as root on Debian/Ubuntu: Open MPI and parallel HDF5 from the distribution,
#   3. otherwise stop and say what to `module load`.
# Compiled Python packages (mpi4py, h5py, Horovod) are built once into wheels and cached
# under $HPCTRAIN_CACHE (default ~/.cache/hpctrain/wheels), keyed by what they were built
# against, so a second setup rebuilds nothing. PyPI's serial h5py wheel, which one test of
# `hpctrain doctor` needs, is downloaded once into the same cache.
#
# Variables: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# TORCH_SPEC (pip requirement for torch, default torch==2.13.0), HPCTRAIN_CACHE,
# HPCTRAIN_BUILD_JOBS (parallel compile jobs, default: number of cores),
# SETUP_MODE (`dev`, the default: hpctrain installed editable from this checkout, plus what the
# tests need; `site`: a normal install of hpctrain that works without the checkout, no test extras),
# SETUP_FACTS (a file to write what the stack was built against, as shell assignments).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=0.28.1
CACHE=${HPCTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain}/wheels
JOBS=${HPCTRAIN_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}
SETUP_MODE=${SETUP_MODE:-dev}
case $SETUP_MODE in dev|site) ;; *) echo "[setup] ERROR: SETUP_MODE=$SETUP_MODE; expected dev or site" >&2; exit 2 ;; esac

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
# A build left running in the background is stopped with its compilers when setup stops early.
kill_tree() { local child; for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done; kill "$1" 2>/dev/null || true; }
horovod_pid=
trap '[ -z "$horovod_pid" ] || kill_tree "$horovod_pid"' EXIT

# ---------------------------------------------------------------- system stack
have_parallel_hdf5() {
  [ -n "${HDF5_DIR:-}" ] && [ -f "$HDF5_DIR/include/H5pubconf.h" ] && grep -q 'define H5_HAVE_PARALLEL 1' "$HDF5_DIR/include/H5pubconf.h" && return 0
  command -v h5pcc >/dev/null 2>&1 && return 0
  command -v pkg-config >/dev/null 2>&1 && pkg-config --exists hdf5-openmpi 2>/dev/null && return 0
  return 1
}

missing=()
command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin libopenmpi-dev)
have_parallel_hdf5 || missing+=(libhdf5-openmpi-dev hdf5-tools)
command -v h5dump >/dev/null 2>&1 || missing+=(hdf5-tools)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing from the distribution: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    die "missing: ${missing[*]}.
  On a cluster: module load openmpi hdf5/parallel cmake   (names vary: see 'module avail mpi hdf5')
  On Debian/Ubuntu as root: apt-get install ${missing[*]}"
  fi
fi
have_parallel_hdf5 || die "no parallel HDF5 found (h5pcc, HDF5_DIR or pkg-config hdf5-openmpi). HINT: module load a parallel hdf5 build, or set HDF5_DIR to it"

# How h5py finds HDF5: an explicit HDF5_DIR wins, then Debian's pkg-config name, then h5pcc's prefix.
if [ -z "${HDF5_DIR:-}" ]; then
  if pkg-config --exists hdf5-openmpi 2>/dev/null; then
    export HDF5_PKGCONFIG_NAME=hdf5-openmpi
  elif command -v h5pcc >/dev/null 2>&1; then
    export HDF5_DIR=$(dirname "$(dirname "$(command -v h5pcc)")")
  fi
fi
if [ -n "${HDF5_PKGCONFIG_NAME:-}" ]; then
  HDF5_VERSION=$(pkg-config --modversion "$HDF5_PKGCONFIG_NAME")
else
  HDF5_VERSION=$(grep -o 'define H5_VERSION "[^"]*"' "$HDF5_DIR/include/H5pubconf.h" | cut -d'"' -f2 || echo unknown)
fi
MPI_ID=$(mpirun --version 2>&1 | head -n1 | tr -cs 'A-Za-z0-9.' '-' | sed 's/^-*//; s/-*$//')
CUDA=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then CUDA=cuda; fi
say "MPI: $(command -v mpicc) ($MPI_ID); HDF5 $HDF5_VERSION; $CUDA"

# ---------------------------------------------------------------- venv
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip wheel || say "pip and wheel not upgraded (no index?): the venv's own are used"
fi
case $VENV in /*) PY="$VENV/bin/python" ;; *) PY="$ROOT/$VENV/bin/python" ;; esac
PIP=("$PY" -m pip install -q --disable-pip-version-check)
PYVER=$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')

pyok() { "$PY" -c "$@" >/dev/null 2>&1; }

pyok 'import torch, numpy' || { say "installing $TORCH_SPEC and numpy"; "${PIP[@]}" "$TORCH_SPEC" numpy; }
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
# hpctrain's own runtime dependencies come with it at the end, from setup.cfg.
# pytest-xdist: `make test` runs the Slurm tests, which mostly wait, beside the others (scripts/test.sh), as
# one group of tests. pytest < 9: pytest-xdist 3.8 (the newest) marks a group in a test's id in a way pytest 9
# no longer reads, and then spreads the group's tests over every worker.
PYTEST_SPEC='pytest>=8,<9'
pyok 'import numpy, pytest, xdist, cython, pkgconfig, setuptools, packaging, psutil, sys; sys.exit(int(pytest.__version__.split(".")[0]) >= 9)' || {
  say "installing numpy, pytest and build tools"
  "${PIP[@]}" numpy "$PYTEST_SPEC" pytest-xdist cython pkgconfig setuptools packaging psutil
}

# The builds below are installed with --ignore-installed: a package of the same version that an
# outer environment provides (a venv over a system or conda Python) would otherwise count as
# installed, and the build would be skipped.
# Build (or reuse) a wheel of a compiled package. $1 name, $2 cache key, $3.. build command
# run in a scratch dir that must leave exactly one wheel in $OUTDIR.
cached_wheel() {
  local name=$1 key=$2; shift 2
  local dir="$CACHE/$name-$key"
  if ! ls "$dir"/*.whl >/dev/null 2>&1; then
    say "building $name once (cached in $dir)" >&2  # stdout is the wheel's path only
    local tmp; tmp=$(mktemp -d)
    mkdir -p "$dir"
    ( cd "$tmp" && OUTDIR="$tmp/out" "$@" ) >&2 || { rm -rf "$tmp"; die "building $name failed (see above)"; }
    cp "$tmp"/out/*.whl "$dir"/
    rm -rf "$tmp"
  fi
  ls "$dir"/*.whl | head -n1
}

# Horovod 0.28.1 asks for C++14, PyTorch >= 2.1 headers need C++17: patch the sdist.
build_horovod() {
  "$PY" -m pip download -q --no-deps --no-binary=:all: "horovod==$HOROVOD_VERSION" -d .
  tar xzf horovod-*.tar.gz
  cd horovod-$HOROVOD_VERSION
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' CMakeLists.txt horovod/torch/CMakeLists.txt
  local gpu=()
  [ "$CUDA" = cuda ] && gpu=(HOROVOD_GPU_OPERATIONS=NCCL)
  # CMake >= 4 refuses the cmake_minimum_required(2.8.12) of Horovod's bundled gloo without this,
  # and GCC >= 13 no longer brings <string>/<stdexcept>/<cstdint> in through other headers,
  # which some of Horovod's headers relied on.
  env CMAKE_POLICY_VERSION_MINIMUM="${CMAKE_POLICY_VERSION_MINIMUM:-3.5}" \
      CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept" \
      HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j"$JOBS" "${gpu[@]}" \
      "$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$OUTDIR"
}
# Horovod takes the longest to build and needs neither mpi4py nor h5py: on a node with many
# cores it builds in the background while they do.
HOROVOD_KEY="$HOROVOD_VERSION-$PYVER-torch$TORCH_VERSION-$MPI_ID-$CUDA"
HOROVOD_WHEEL_PATH=$(mktemp)
if ! pyok 'import horovod.torch'; then
  cached_wheel horovod "$HOROVOD_KEY" build_horovod > "$HOROVOD_WHEEL_PATH" &
  horovod_pid=$!
fi

# An mpi4py that some other MPI built (a PyPI wheel in a system Python, another module) is
# rebuilt against this one: its library must report the version that mpirun reports.
MPI_VERSION=$(mpirun --version 2>&1 | grep -o '[0-9][0-9]*\.[0-9][0-9.]*' | head -n1 || true)
mpi4py_matches() {
  "$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version())' 2>/dev/null | grep -qF "${MPI_VERSION:-?}"
}
build_mpi4py() { CC=mpicc "$PY" -m pip wheel -q --no-deps --no-binary=mpi4py mpi4py -w "$OUTDIR"; }
if ! mpi4py_matches; then
  whl=$(cached_wheel mpi4py "$PYVER-$MPI_ID" build_mpi4py)
  "${PIP[@]}" --no-deps --ignore-installed "$whl"
fi

build_h5py() {
  CC=mpicc HDF5_MPI=ON "$PY" -m pip wheel -q --no-deps --no-binary=h5py --no-build-isolation h5py -w "$OUTDIR"
}
if ! pyok 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)'; then
  "$PY" -m pip uninstall -q -y h5py >/dev/null 2>&1 || true
  whl=$(cached_wheel h5py "$PYVER-hdf5-$HDF5_VERSION-$MPI_ID" build_h5py)
  "${PIP[@]}" --no-deps --ignore-installed "$whl"
  pyok 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' \
    || die "h5py was installed but has no MPI support; check that HDF5 ($HDF5_VERSION) is a parallel build"
fi

# The test that `hpctrain doctor` names the fix for a serial h5py needs a real one: PyPI's
# wheel of the same version (HDF5 bundled, no MPI). Fetched once into the cache, so that the
# tests install it from this file and never reach the network.
H5PY_VERSION=$("$PY" -c 'from importlib.metadata import version; print(version("h5py"))')
SERIAL_H5PY="$CACHE/h5py-serial-$H5PY_VERSION-$PYVER"
if [ "$SETUP_MODE" = dev ] && ! ls "$SERIAL_H5PY"/h5py-*.whl >/dev/null 2>&1; then
  say "downloading the serial h5py $H5PY_VERSION wheel once, for the tests (into $SERIAL_H5PY)"
  mkdir -p "$SERIAL_H5PY"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      "h5py==$H5PY_VERSION" -d "$SERIAL_H5PY" \
    || say "WARNING: could not download it; only tests/test_doctor.py::test_serial_h5py_names_the_fix needs it"
fi

if [ -n "$horovod_pid" ]; then
  wait "$horovod_pid" || { horovod_pid=; die "building horovod failed (see above)"; }
  horovod_pid=
  "${PIP[@]}" --no-deps --ignore-installed "$(cat "$HOROVOD_WHEEL_PATH")"
  "${PIP[@]}" cloudpickle psutil pyyaml packaging cffi
fi
rm -f "$HOROVOD_WHEEL_PATH"

# ---------------------------------------------------------------- hpctrain itself
# With the dependencies setup.cfg declares (torch, mpi4py, h5py and Horovod are deliberately
# not among them: they are the builds above), and the extras the tests and the digits example use.
if [ "$SETUP_MODE" = site ]; then
  # A wheel of this checkout, installed as any package: the environment no longer needs the checkout.
  # Built from a copy of the sources, so that no build output of an earlier install slips in.
  say "installing hpctrain (from a wheel of $ROOT) and its dependencies"
  wheeldir=$(mktemp -d)
  mkdir "$wheeldir/src"
  cp -R "$ROOT"/hpctrain "$ROOT"/setup.cfg "$ROOT"/pyproject.toml "$ROOT"/README.md "$wheeldir/src/"
  find "$wheeldir/src" -name __pycache__ -prune -exec rm -rf {} +
  "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation "$wheeldir/src" -w "$wheeldir" \
    || { rm -rf "$wheeldir"; die "building the hpctrain wheel failed (see above)"; }
  whl=$(ls "$wheeldir"/hpctrain-*.whl)
  "${PIP[@]}" --no-deps --force-reinstall "$whl"
  "${PIP[@]}" "$whl[examples,safetensors,hf]"
  rm -rf "$wheeldir"
else
  pyok 'import hpctrain, sys; sys.exit(0 if hpctrain.__file__.startswith(sys.argv[1]) else 1)' "$ROOT" 2>/dev/null \
    && [ -x "$VENV/bin/hpctrain" ] \
    && pyok 'import tqdm, matplotlib, sklearn, safetensors, transformers' \
    && { [ "$(uname -m)" != x86_64 ] || pyok 'import isal'; } \
    || { say "installing hpctrain (editable) and its dependencies"; "${PIP[@]}" --no-build-isolation -e ".[examples,safetensors,hf]"; }
fi

if [ -n "${SETUP_FACTS:-}" ]; then
  # What the compiled packages were built against, for `make install`'s record (shell-quoted).
  {
    printf 'MPIRUN=%q\nMPICC=%q\nMPI_VERSION_LINE=%q\nMPI_VERSION=%q\n' "$(command -v mpirun)" "$(command -v mpicc)" \
      "$(mpirun --version 2>&1 | head -n1)" "${MPI_VERSION:-}"
    printf 'HDF5_VERSION=%q\nHDF5_DIR=%q\nHDF5_PKGCONFIG_NAME=%q\n' "$HDF5_VERSION" "${HDF5_DIR:-}" "${HDF5_PKGCONFIG_NAME:-}"
    printf 'TORCH_VERSION=%q\nCUDA=%q\nPYTHON_VERSION=%q\n' "$TORCH_VERSION" "$CUDA" "$("$PY" -c 'import platform; print(platform.python_version())')"
  } >"$SETUP_FACTS"
fi

say "done: $VENV ready (torch $TORCH_VERSION). Check it with: $VENV/bin/hpctrain doctor"
