"""How the coordinator's checks end a job: the :class:`Verdict` (of health.py and host_liveness.py)."""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Verdict(NamedTuple):
    """Why the job ends, as the coordinator's abort tells every rank."""

    kind: int
    reason: str
    failed_rank: int = -1
    failed_host: str = ""
    stalled_ranks: Sequence[int] = ()
    #: the failed host is cut off (its agent went silent): MPI will not learn of it, so an
    #: elastic job re-forms at once instead of trying to shrink in place
    host_unreachable: bool = False


__all__ = ["Verdict"]
