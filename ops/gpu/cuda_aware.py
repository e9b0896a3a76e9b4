"""Is the MPI library under mpi4py CUDA-aware? Asked of the library itself, at run time.

Open MPI answers through ``MPIX_Query_cuda_support()`` (1: device buffers are accepted),
MPICH through ``MPIX_GPU_query_support()`` (a nonzero GPU type). Both are looked up in the
``libmpi`` this process has loaded, so the answer is about the library mpi4py runs on,
not another one on the ``PATH``. A library that offers neither is taken as not CUDA-aware:
a device buffer handed to such an MPI is a segfault, so the doubt goes to ``staged``.
``RINGMASTER_CUDA_AWARE_MPI=1`` overrides the check for a library that is CUDA-aware but
cannot say so.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from typing import Tuple


@functools.lru_cache(maxsize=None)
def mpi_cuda_support() -> Tuple[bool, str]:
    """(CUDA-aware?, what was found) for the loaded MPI library."""
    override = os.environ.get("RINGMASTER_CUDA_AWARE_MPI", "")
    if override in ("1", "0"):
        return override == "1", f"RINGMASTER_CUDA_AWARE_MPI={override}"
    from mpi4py import MPI  # noqa: F401  (loads libmpi into this process)

    library = _loaded_libmpi()
    if library is None:
        return False, "no libmpi is loaded in this process"
    lib = ctypes.CDLL(library)
    if hasattr(lib, "MPIX_Query_cuda_support"):
        supported = bool(lib.MPIX_Query_cuda_support())
        return supported, f"{os.path.basename(library)}: MPIX_Query_cuda_support() = {int(supported)}"
    if hasattr(lib, "MPIX_GPU_query_support"):
        gpu_type = ctypes.c_int(0)
        lib.MPIX_GPU_query_support(ctypes.byref(gpu_type))
        return gpu_type.value != 0, f"{os.path.basename(library)}: MPIX_GPU_query_support() = {gpu_type.value}"
    return False, f"{os.path.basename(library)} offers no CUDA-support query"


def _loaded_libmpi():
    """The path of the libmpi shared object mapped into this process, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            found = re.findall(r"(/\S*/libmpi(?:ch)?\.so[.\d]*)$", maps.read(), flags=re.MULTILINE)
    except OSError:
        return None
    return found[0] if found else None
