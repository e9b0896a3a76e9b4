"""What the user's threads hand the background thread: entries, the tensor table, process-set communicators."""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, Optional, Sequence

import torch

from ringmaster.worker.runtime.device import ready_event
from ringmaster.worker.runtime.handles import Handle


@dataclasses.dataclass
class Entry:
    """One tensor this rank submitted and is waiting on."""

    name: str
    op_type: int
    tensor: torch.Tensor                     # contiguous input
    handle: Handle
    part: int = 0                            # position in a grouped handle
    output: Optional[torch.Tensor] = None    # where the result goes; None: a new tensor (out of place)
    copy_back: Optional[torch.Tensor] = None  # non-contiguous in-place target
    returns: Optional[torch.Tensor] = None    # in place: the caller's own tensor, handed back
    process_set_id: int = 0                  # the set that runs it (0: every rank)
    cache_key: Optional[tuple] = None        # its signature, if the response cache may run it again
    #: CUDA tensors: an event on the producing stream, recorded at submission (device.ready_event).
    ready_event: object = None

    def __post_init__(self):
        if self.ready_event is None:
            self.ready_event = ready_event(self.tensor)


class TensorTable:
    """Tensors submitted by the user's threads, by (process set, name), until the background thread runs them."""

    def __init__(self):
        self._entries: Dict[tuple, Entry] = {}
        self._lock = threading.Lock()

    def add(self, entry: Entry) -> None:
        key = (entry.process_set_id, entry.name)
        with self._lock:
            if key in self._entries:
                where = f" in process set {entry.process_set_id}" if entry.process_set_id else ""
                raise ValueError(f"a collective named '{entry.name}'{where} is already in flight on this rank; "
                                 f"synchronize it first or pass a different name=")
            self._entries[key] = entry

    def take(self, process_set_id: int, name: str) -> Optional[Entry]:
        with self._lock:
            return self._entries.pop((process_set_id, name), None)

    def drop(self, process_set_id: int, name: str) -> None:
        self.take(process_set_id, name)

    def device_index(self, process_set_id: int, names) -> Optional[int]:
        """The GPU of the first of ``names`` in flight here that is a CUDA tensor (else None)."""
        with self._lock:
            for name in names:
                entry = self._entries.get((process_set_id, name))
                if entry is not None and getattr(entry.tensor, "is_cuda", False):
                    return entry.tensor.device.index
        return None

    def cache_keys(self, process_set_id: int, names) -> Dict[str, Optional[tuple]]:
        """The cache key of each of ``names`` in flight here (a name not here: None)."""
        with self._lock:
            return {name: getattr(self._entries.get((process_set_id, name)), "cache_key", None) for name in names}


@dataclasses.dataclass(frozen=True)
class SetComm:
    """A process set as this rank's background thread runs it: its communicator and members."""

    comm: object                 # mpi4py communicator of the members
    rank: int                    # this rank's position in the set
    size: int
    ranks: Sequence[int]         # global ranks, sorted (position i holds global rank ranks[i])


def take(table: TensorTable, response, name: str, device=None) -> Optional[Entry]:
    """The entry of ``name`` in ``response``'s set (None: this rank joined); with ``device``,
    readable on its stream (the background thread's)."""
    entry = table.take(response.process_set_id, name)
    if entry is not None and device is not None:
        device.ready(entry)
    return entry


def complete(entry: Entry, result, device=None) -> None:
    """Hand ``result`` to ``entry``'s caller (into its non-contiguous target first, if it has one)."""
    if entry.copy_back is not None:
        entry.copy_back.copy_(result)
    entry.handle.set_result(result if entry.returns is None else entry.returns, entry.part,
                            None if device is None else device.completion())
