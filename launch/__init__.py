"""``ringrun``, the launcher: hosts, coordinator daemon, ``mpirun``, signals, exit status.

Modules, one job each: :mod:`.hosts` (``-H``, hostfiles, slots, local hosts),
:mod:`.network` (the coordinator's bind/advertised address), :mod:`.environment`
(``RINGMASTER_*`` variables), :mod:`.command` (checks on the user's command),
:mod:`.mpi_command` (Open MPI / MPICH command lines), :mod:`.coordinator_process`
(the coordinator daemon), :mod:`.output` (rank-tagged output, per-rank files),
:mod:`.processes` and :mod:`.job` (running mpirun), :mod:`.cli` (``main``).
"""
