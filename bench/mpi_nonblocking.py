"""Open MPI's blocking MPI_Allreduce against MPI_Iallreduce plus a busy Test loop, raw mpi4py.

    mpirun -np 2 python bench/mpi_nonblocking.py
    mpirun -np 4 --oversubscribe python bench/mpi_nonblocking.py

ringmaster runs MPI_Allreduce messages below ``ops.mpi_collectives.NONBLOCKING_MAX_BYTES``
(1 MiB) as MPI_Iallreduce, so that a wait for a late peer can yield the core and notice a
failed job (``ops/waiting.py``). This shows what that costs MPI itself, with nothing of
ringmaster in the way: median microseconds of 300 calls per size, a barrier before each.
"""

import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.rank == 0:
    print(f"{comm.size} ranks; median us of 300 float32 sums in place")
    print(f"{'size':>9} {'blocking':>10} {'Iallreduce':>11} {'ratio':>6}")
for nbytes in (16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20):
    array = np.ones(nbytes // 4, np.float32)
    medians = {}
    for way in ("blocking", "nonblocking"):
        samples = []
        for _ in range(300):
            comm.Barrier()
            start = time.perf_counter()
            if way == "blocking":
                comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            else:
                request = comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM)
                while not request.Test():
                    pass
            samples.append(time.perf_counter() - start)
        medians[way] = np.median(samples) * 1e6
    if comm.rank == 0:
        print(f"{nbytes >> 10:>5} KiB {medians['blocking']:10.1f} {medians['nonblocking']:11.1f} "
              f"{medians['nonblocking'] / medians['blocking']:6.2f}")
