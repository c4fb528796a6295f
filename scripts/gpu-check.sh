#!/usr/bin/env bash
# GPU readiness in one command, on a node with an NVIDIA GPU (about 10 minutes on one GPU):
#
#   bash scripts/gpu-check.sh [OUT_DIR]           (on a cluster: srun --gres=gpu:1 -c 8 bash scripts/gpu-check.sh)
#
#   1. builds the stack into $VENV (default .venv-gpu): a venv that sees the system's CUDA
#      PyTorch when there is one (else TORCH_SPEC from PyPI), mpi4py, parallel h5py and
#      Horovod with NCCL (make setup builds with NCCL when nvidia-smi sees a GPU);
#   2. runs the GPU tests (tests/test_gpu.py: ranks sharing one GPU, fp16 with a GradScaler,
#      Horovod on CUDA tensors with MPI and NCCL operations);
#   3. runs the GPU benchmark (benchmarks/gpu.py: fp16 against fp32 all-reduce of CUDA tensors
#      of 64 and 256 MiB; a training step against DDP) with one rank per GPU (NCCL) into
#      OUT_DIR/gpu.json, and with two ranks per GPU (through host memory) into gpu-shared.json.
#
# Where no GPU is visible it says so and exits 3 before building anything.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/gpu-$(date +%Y%m%d-%H%M%S)}
export VENV=${VENV:-.venv-gpu}
say() { printf '[gpu-check] %s\n' "$*"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  say "no NVIDIA GPU is visible here (nvidia-smi finds none): nothing to check." >&2
  say "HINT: run it on a GPU node, e.g. srun --gres=gpu:1 --cpus-per-task=8 bash scripts/gpu-check.sh" >&2
  exit 3
fi
nvidia-smi -L
start=$(date +%s)

# A CUDA PyTorch that the system already has (an HPC module, a container image) is used as
# it is: a multi-GB download per venv helps no one.
if [ ! -x "$VENV/bin/python" ] && python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  say "using the system's CUDA PyTorch ($(python3 -c 'import torch; print(torch.__version__)')) in $VENV"
  # Without ensurepip (a distribution's python3 lacking its venv package) the venv uses the pip
  # of the outer environment, which the .pth file below makes visible.
  python3 -m venv --system-site-packages "$VENV" 2>/dev/null || python3 -m venv --clear --without-pip --system-site-packages "$VENV"
  # A python3 that is itself a venv or conda environment keeps its packages out of the "system"
  # ones of a venv made from it: a .pth file adds them, behind the new venv's own builds.
  site_dir=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -c 'import site; print("\n".join("import site; site.addsitedir(%r)" % p for p in site.getsitepackages()))' \
    > "$site_dir/_hpctrain_outer_env.pth"
fi
bash scripts/setup.sh
PY=$VENV/bin/python
"$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' || {
  say "the PyTorch in $VENV cannot use the GPU (a CPU build?)." >&2
  say "HINT: rm -rf $VENV and rerun with TORCH_SPEC naming a CUDA build of torch, or module load one first" >&2
  exit 1
}
"$VENV/bin/hpctrain" doctor || true   # its report is the first thing to read when a test below fails
say "setup took $(( $(date +%s) - start )) s"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
"$PY" -m pytest -v -m gpu tests/test_gpu.py
mkdir -p "$OUT"
MPIRUN=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
GPUS=$(nvidia-smi -L | grep -c '^GPU')
# One rank per GPU: the NCCL paths (Horovod, DDP). Then two ranks per GPU: what sharing a GPU
# costs on the paths that allow it (hpctrain's mpi backend through host memory, DDP over gloo).
"${MPIRUN[@]}" -n "$GPUS" --timeout 300 "$PY" benchmarks/gpu.py --out "$OUT/gpu.json"
"${MPIRUN[@]}" -n $((2 * GPUS)) --timeout 300 "$PY" benchmarks/gpu.py --out "$OUT/gpu-shared.json"
say "done in $(( $(date +%s) - start )) s; figures in $OUT/gpu.json and $OUT/gpu-shared.json"
