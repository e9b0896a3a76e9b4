"""What the coordinator says about stalls: a few summary lines per check, never one per tensor.

A rank that declared 100,000 tensors the others never will makes 100,000 stalls at once;
one warning line each was 21.6 MB of log in one burst. Here stalls of the same kind, process
set and missing ranks share one line (how many, the oldest and newest wait, the first few
names), and one check prints at most :data:`MAX_LINES` lines. A lone stall reads as before:
``stall: tensor 'x' has waited 61 s: ranks [0] are ready, ranks [1] (rank 1 on host) ...``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

from ringmaster.coordinator.negotiation import Stall
from ringmaster.coordinator.process_sets import describe_set
from ringmaster.coordinator.validation import shown

#: Most lines one stall check logs; the rest are counted in a last line.
MAX_LINES = 10
#: Names quoted in a summary line.
NAMES_SHOWN = 5
#: Longest list of ranks written out one by one; longer ones are written as runs.
RANKS_LISTED = 8

_HINT = "One rank may be running a different code path, or be stuck or slow."


def stall_key(stall: Stall) -> Tuple:
    """What makes two stalls one: their kind, process set and missing ranks."""
    return stall.kind, stall.process_set_id, tuple(stall.missing_ranks)


def ranks_text(ranks: Sequence[int]) -> str:
    """``ranks`` as a list, runs of consecutive ranks as ``a-b`` once the list is long
    (``[0-1022]`` rather than 1,023 numbers; short lists read as Python lists)."""
    if len(ranks) <= RANKS_LISTED:
        return str(list(ranks))
    runs, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            runs.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return f"[{', '.join(runs)}] ({len(ranks)} ranks)"


#: The straggler report's probes (``worker/frontend/lateness_probes.py``): a late rank's probe
#: stalls beside the collective it is late for, which the warning names instead.
PROBE_PREFIX = "ringmaster.lateness."


def warning_lines(stalls: Sequence[Stall], host_of: Callable[[int], str]) -> List[str]:
    """The warning lines for the stalls found by one check (without the ``stall:`` logger prefix)."""
    stalls = [stall for stall in stalls if not stall.name.startswith(PROBE_PREFIX)] or stalls
    buckets: Dict[Tuple, List[Stall]] = {}
    for stall in stalls:
        key = (stall.kind, stall.process_set_id, tuple(stall.missing_ranks), tuple(stall.waiting_ranks))
        buckets.setdefault(key, []).append(stall)
    lines = [_line(bucket, host_of) for bucket in list(buckets.values())[:MAX_LINES]]
    if len(buckets) > MAX_LINES:
        rest = sum(len(bucket) for bucket in list(buckets.values())[MAX_LINES:])
        lines.append(f"stall: … and {rest} more stalled requests waiting for other ranks")
    return lines


def shutdown_reason(stalls: Sequence[Stall], limit_s: float) -> str:
    """Why the job is aborted for ``stalls`` (the first is the oldest), naming the knob."""
    first = stalls[0]
    more = f"; {len(stalls) - 1} more waited as long" if len(stalls) > 1 else ""
    knob = f"(RINGMASTER_STALL_SHUTDOWN_S={limit_s:g})"
    missing = ranks_text(first.missing_ranks)
    if first.kind == "join":
        return (f"join() on ranks {ranks_text(first.waiting_ranks)} stalled for {first.seconds:.0f} s {knob}: ranks "
                f"{missing} neither joined nor ran a collective in that time{more}")
    if first.kind == "group":
        return (f"group '{shown(first.name)}'{in_set(first)} stalled for {first.seconds:.0f} s {knob}: "
                f"{first.detail}, and ranks {missing} never declared the rest{more}")
    return (f"{_what(first)}{in_set(first)} stalled for {first.seconds:.0f} s {knob}: ranks {missing} "
            f"never submitted it{more}")


def in_set(stall: Stall) -> str:
    """' in process set N (ranks [...])' for a stall outside the global set, else ''."""
    return f" in {describe_set(stall.process_set_id, stall.set_ranks)}" if stall.process_set_id else ""


def _line(bucket: List[Stall], host_of: Callable[[int], str]) -> str:
    first = bucket[0]
    missing = first.missing_ranks
    hosts = ", ".join(host_of(rank) for rank in missing[:NAMES_SHOWN])
    if len(missing) > NAMES_SHOWN:
        hosts += ", …"
    who = f"ranks {ranks_text(missing)} ({hosts})" if missing else "no rank"
    if first.kind == "join":
        return (f"stall: ranks {ranks_text(first.waiting_ranks)} have waited {first.seconds:.0f} s in join() "
                f"while {who} neither joined nor ran a collective with them. A rank may be stuck, or have stopped "
                f"training without calling join().")
    if first.kind == "group":
        groups = _names(bucket, "group", "groups")
        return (f"stall: {groups}{in_set(first)} {_waited(bucket)}: {first.detail}"
                f"{'' if len(bucket) == 1 else ' (the first)'}, and no rank declared the rest: ranks "
                f"{ranks_text(first.waiting_ranks)} declared every part, {who} declared fewer than group_size. {_HINT}")
    if len(bucket) == 1:
        return (f"stall: {_what(first)}{in_set(first)} {_waited(bucket)}: ranks {ranks_text(first.waiting_ranks)} are "
                f"ready, {who} have not submitted it. {_HINT}")
    noun = {"tensor": "tensors"}.get(first.kind, f"{first.kind} requests")
    return (f"stall: {_names(bucket, first.kind, noun)}{in_set(first)} {_waited(bucket)}: ranks "
            f"{ranks_text(first.waiting_ranks)} are ready, {who} have not submitted them. {_HINT}")


def _what(stall: Stall) -> str:
    return f"{stall.kind} '{shown(stall.name)}'"


def _names(bucket: List[Stall], singular: str, plural: str) -> str:
    if len(bucket) == 1:
        return f"{singular} '{shown(bucket[0].name)}'"
    quoted = ", ".join(f"'{shown(stall.name, 60)}'" for stall in bucket[:NAMES_SHOWN])
    more = f" and {len(bucket) - NAMES_SHOWN} more" if len(bucket) > NAMES_SHOWN else ""
    return f"{len(bucket)} {plural} ({quoted}{more})"


def _waited(bucket: List[Stall]) -> str:
    seconds = [stall.seconds for stall in bucket]
    low, high = min(seconds), max(seconds)
    verb = "has" if len(bucket) == 1 else "have"
    if f"{low:.0f}" == f"{high:.0f}":
        return f"{verb} waited {high:.0f} s"
    return f"{verb} waited {low:.0f}-{high:.0f} s"


__all__ = ["MAX_LINES", "in_set", "shutdown_reason", "warning_lines"]
