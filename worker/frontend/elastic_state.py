"""Elastic training state: what is committed, restored and synchronized across a re-formed job.

As Horovod's ``hvd.elastic`` (``State``, ``ObjectState``, ``TorchState``):

* ``save()`` keeps an in-memory copy of the state; ``restore()`` puts it back;
* ``sync()`` makes every rank's state rank 0's (parameters and optimizer by broadcast, other
  attributes by ``broadcast_object``), then saves it;
* ``commit()`` = ``save()``, then, under an elastic ``ringrun``, rank 0 stores the saved state
  in the driver's state service (it outlives every rank: the next generation's rank 0 loads
  it and ``sync()`` hands it to the others), then ``check_host_updates()``;
* ``check_host_updates()`` asks the driver (rank 0 asks, every rank gets the answer by
  broadcast, so all raise together) whether hosts were added or removed, and raises
  :class:`HostsUpdatedInterrupt` if so.

A snapshot is ``torch.save`` of ``{"format": 1, "values": {name: saved value}}``: model and
optimizer ``state_dict`` copies, samplers' ``state_dict``, and the other attributes as
deep copies (so later changes to a list or dict do not leak into the committed copy).
"""

from __future__ import annotations

import copy
import io
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ringmaster.common import elastic as protocol
from ringmaster.worker.frontend import functions, topology
from ringmaster.worker.frontend.elastic_sampler import ElasticSampler
from ringmaster.worker.frontend.sharded import refuse_elastic
from ringmaster.worker.runtime.errors import RingmasterError

log = logging.getLogger("ringmaster.elastic")

SNAPSHOT_FORMAT = 1


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: the job re-forms at this point, without restoring.

    Raised on every rank at the same ``commit()``/``check_host_updates()``; the function
    decorated with :func:`ringmaster.elastic.run` handles it.

    Args:
        skip_sync: True when hosts were only removed (Horovod's meaning; ringmaster's
            re-formed job always synchronizes from rank 0).
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


def service_client() -> Optional[protocol.ServiceClient]:
    """The driver's state service when started by an elastic ``ringrun``, else ``None``."""
    address = protocol.elastic_address(os.environ)
    if address is None:
        return None
    return protocol.ServiceClient(address, os.environ.get("RINGMASTER_SECRET", ""))


class State:
    """Base class of elastic states (Horovod's ``hvd.elastic.State``).

    Subclasses implement :meth:`save`, :meth:`restore`, :meth:`sync` and the snapshot hooks
    :meth:`_snapshot_values` / :meth:`_load_snapshot_values`.
    """

    def __init__(self, bcast_object: Optional[Callable] = None, get_rank: Optional[Callable[[], int]] = None):
        self._bcast_object = bcast_object or functions.broadcast_object
        self._get_rank = get_rank or topology.rank
        self._reset_callbacks: List[Callable[[], None]] = []
        self._known_hosts_version = protocol.hosts_version(os.environ)
        self.last_commit_seconds: Optional[float] = None

    # ------------------------------------------------------------------ Horovod's API
    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Run ``callbacks`` (no arguments) after every re-form, e.g. to rescale the learning rate."""
        if callable(callbacks):
            callbacks = [callbacks]
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called after the job re-formed and the state was synchronized: run the reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float = 0.0, update_res: int = 0) -> None:
        """Horovod's notification hook; ringmaster asks the driver at each commit instead."""

    def commit(self) -> None:
        """Save the state, store it with the elastic driver (rank 0), then check for host changes.

        Collective: every rank calls it at the same step.

        Raises:
            HostsUpdatedInterrupt: hosts were added or removed (on every rank at once).
        """
        started = time.perf_counter()
        self.save()
        self._publish()
        self.last_commit_seconds = time.perf_counter() - started
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if the elastic driver saw hosts come or go.

        Collective (one broadcast); does nothing outside an elastic ``ringrun``.
        """
        service = service_client()
        if service is None:
            return
        version = service.hosts_version() if self._get_rank() == 0 else None
        version = self._bcast_object(version, 0)
        if version != self._known_hosts_version:
            self._known_hosts_version = version
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keep an in-memory copy of the state (the committed state)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put the last saved copy back."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's, and save it. Collective."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called on a re-form before the reset callbacks (samplers re-shard here)."""

    # ------------------------------------------------------------------ snapshots
    def _snapshot_values(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _load_snapshot_values(self, values: Dict[str, Any]) -> None:
        raise NotImplementedError

    def snapshot(self) -> bytes:
        """The saved state as bytes (what rank 0 stores with the elastic driver)."""
        buffer = io.BytesIO()
        torch.save({"format": SNAPSHOT_FORMAT, "values": self._snapshot_values()}, buffer)
        return buffer.getvalue()

    def load_snapshot(self, data: bytes) -> None:
        """Make ``data`` (from :meth:`snapshot`) the saved state and restore it."""
        loaded = torch.load(io.BytesIO(data), weights_only=False)
        if not isinstance(loaded, dict) or loaded.get("format") != SNAPSHOT_FORMAT:
            raise RingmasterError("the elastic driver holds a snapshot this version of ringmaster cannot read")
        self._load_snapshot_values(loaded["values"])
        self.restore()

    def _publish(self) -> None:
        """Rank 0 stores the saved state with the elastic driver (a no-op without one)."""
        service = service_client()
        if service is None or self._get_rank() != 0:
            return
        try:
            service.put_state(self.snapshot())
        except protocol.ServiceError as error:
            raise RingmasterError(f"rank 0 could not store the committed state: {error}") from None


class ObjectState(State):
    """Plain Python attributes as elastic state (Horovod's ``hvd.elastic.ObjectState``).

    ``ObjectState(epoch=0, batch=0)`` makes ``state.epoch`` and ``state.batch`` attributes
    that ``commit()`` saves (deep copies), ``restore()`` puts back and ``sync()`` takes from
    rank 0 (by ``broadcast_object``). ``bcast_object`` and ``get_rank`` are accepted for
    Horovod compatibility and default to ringmaster's.
    """

    def __init__(self, bcast_object: Optional[Callable] = None, get_rank: Optional[Callable[[], int]] = None,
                 **kwargs):
        self._saved_state: Dict[str, Any] = {name: copy.deepcopy(value) for name, value in kwargs.items()}
        self._set_attrs()
        super().__init__(bcast_object, get_rank)

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            object.__setattr__(self, name, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            current = {name: getattr(self, name) for name in self._saved_state}
            self._saved_state = self._bcast_object(current, 0)
            self._set_attrs()

    def _snapshot_values(self) -> Dict[str, Any]:
        return {"objects": self._saved_state}

    def _load_snapshot_values(self, values: Dict[str, Any]) -> None:
        self._saved_state = dict(values["objects"])


def _detached_copy(state_dict):
    return {name: value.detach().clone() if torch.is_tensor(value) else copy.deepcopy(value)
            for name, value in state_dict.items()}


class TorchState(ObjectState):
    """A model, an optimizer, samplers and any other attributes as elastic state
    (Horovod's ``hvd.elastic.TorchState``).

    ``TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)``: the model's
    and optimizer's ``state_dict`` are copied at ``save()`` and loaded at ``restore()``;
    ``sync()`` broadcasts rank 0's parameters and optimizer state. A
    :class:`~ringmaster.worker.frontend.elastic_sampler.ElasticSampler` argument is saved
    as its state (``epoch`` and ``processed_num``, the same on every rank), and re-sharded
    over the new ranks at a re-form. Assigning ``state.model = other`` replaces the tracked object.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 bcast_object: Optional[Callable] = None, get_rank: Optional[Callable[[], int]] = None, **kwargs):
        refuse_elastic(optimizer)  # sharded state cannot be restored at other ranks
        tracked = {"model": model, "optimizer": optimizer}
        samplers = {name: value for name, value in kwargs.items() if isinstance(value, ElasticSampler)}
        tracked.update(samplers)
        plain = {name: value for name, value in kwargs.items() if name not in samplers}
        object.__setattr__(self, "_tracked", {name: value for name, value in tracked.items() if value is not None})
        object.__setattr__(self, "_saved_tracked", {})
        for name, value in self._tracked.items():
            object.__setattr__(self, name, value)
        if model is None:
            object.__setattr__(self, "model", None)
        if optimizer is None:
            object.__setattr__(self, "optimizer", None)
        super().__init__(bcast_object, get_rank, **plain)
        self._save_tracked()

    def __setattr__(self, name: str, value) -> None:
        tracked = self.__dict__.get("_tracked")
        if name == "optimizer":
            refuse_elastic(value)
        if tracked is not None and name in tracked:
            tracked[name] = value
        object.__setattr__(self, name, value)

    def _save_tracked(self) -> None:
        saved = {}
        for name, value in self._tracked.items():
            if isinstance(value, torch.nn.Module):
                saved[name] = _detached_copy(value.state_dict())
            elif isinstance(value, torch.optim.Optimizer):
                saved[name] = copy.deepcopy(value.state_dict())
            elif isinstance(value, ElasticSampler):
                saved[name] = copy.deepcopy(value.state_dict())
        object.__setattr__(self, "_saved_tracked", saved)

    def save(self) -> None:
        self._save_tracked()
        super().save()

    def restore(self) -> None:
        for name, saved in self._saved_tracked.items():
            value = self._tracked.get(name)
            if value is not None:
                value.load_state_dict(copy.deepcopy(saved))
        super().restore()

    def sync(self) -> None:
        for name, value in self._tracked.items():
            if isinstance(value, torch.nn.Module):
                functions.broadcast_parameters(value.state_dict(), root_rank=0)
            elif isinstance(value, torch.optim.Optimizer):
                functions.broadcast_optimizer_state(value, root_rank=0)
            elif isinstance(value, ElasticSampler):
                value.load_state_dict(self._bcast_object(value.state_dict(), 0))
        super().sync()
        self._save_tracked()

    def reset(self) -> None:
        for value in self._tracked.values():
            if isinstance(value, ElasticSampler):
                value.reset()

    def _snapshot_values(self) -> Dict[str, Any]:
        values = super()._snapshot_values()
        values["tracked"] = self._saved_tracked
        return values

    def _load_snapshot_values(self, values: Dict[str, Any]) -> None:
        super()._load_snapshot_values(values)
        object.__setattr__(self, "_saved_tracked", dict(values["tracked"]))
