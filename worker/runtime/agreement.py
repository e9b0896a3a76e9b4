"""What every rank of a job must agree on, checked in one collective call."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
from mpi4py import MPI


def ranges(comm: MPI.Comm, *values: int) -> List[Tuple[int, int]]:
    """(lowest, highest) over the ranks of ``comm`` of each of this rank's ``values``: one
    ``MAX`` allreduce of ``[-v, v]`` per value (a collective call)."""
    bounds = np.array([sign * int(value) for value in values for sign in (-1, 1)], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, bounds, op=MPI.MAX)
    return [(-int(bounds[2 * i]), int(bounds[2 * i + 1])) for i in range(len(values))]
