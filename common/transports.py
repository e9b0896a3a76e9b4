"""Every transport ringmaster can open, registered once by name (as torch's ``Backend.register_backend``).

A *transport* moves and reduces one communicator's buffers of one kind of memory
(``ringmaster.ops.transport.Transport``). Each is registered here under a name, for the
devices whose tensors it moves, as its class or as ``"module:Class"`` (imported when first
opened, so that a CPU-only process never imports CuPy, and so that this module imports
nothing: the coordinator and ``ringrun`` read the names too).

* ``cpu``: the host's transport, constructed as ``cls(comm, segment_bytes)``;
* ``cuda``: a GPU transport, constructed as ``cls(comm, stream, device_id)``; the names are
  the choices of ``RINGMASTER_GPU_TRANSPORT`` (with ``auto``, which lets
  ``ringmaster.ops.gpu.placement`` pick one).

A user's own transport is registered before ``rm.init()`` and chosen with the variable::

    from ringmaster.common.transports import register_transport
    register_transport("rdma", "my_package.rdma:RdmaTransport")   # RINGMASTER_GPU_TRANSPORT=rdma

The worker assembles the transport of each communicator from these, flat or through the
hosts, in one place for host and GPU alike (``ringmaster.ops.hierarchical.assemble_transport``).
"""

from __future__ import annotations

import importlib
import re
from typing import Dict, NamedTuple, Tuple, Union

#: The devices a transport may serve, and how each constructs one.
DEVICES = {"cpu": "cls(comm, segment_bytes)", "cuda": "cls(comm, stream, device_id)"}
#: Names that are not transports: the setting's own choice, and the composition of two transports.
RESERVED = ("auto", "hierarchical")


class Registered(NamedTuple):
    """One registered transport: its name, its class or ``"module:Class"``, and its devices."""

    name: str
    target: Union[type, str]
    devices: Tuple[str, ...]


_REGISTRY: Dict[str, Registered] = {}


def register_transport(name: str, cls: Union[type, str], devices: Tuple[str, ...] = ("cuda",)) -> None:
    """Register transport ``cls`` (a class, or ``"module:Class"`` imported when first opened)
    under ``name`` for tensors of ``devices`` (``"cpu"``, ``"cuda"``).

    Raises ``ValueError`` for a name that is not a lower-case word, is reserved, or is taken
    by another class, and for an unknown device.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"register_transport: name {name!r} is not a lower-case word (letters, digits, _)")
    if name in RESERVED:
        raise ValueError(f"register_transport: {name!r} is reserved ({', '.join(RESERVED)}); choose another name")
    devices = tuple(devices)
    unknown = [device for device in devices if device not in DEVICES]
    if not devices or unknown:
        raise ValueError(f"register_transport({name!r}): devices {list(devices)} must be some of {', '.join(DEVICES)}")
    if isinstance(cls, str) and not re.fullmatch(r"[\w.]+:\w+", cls):
        raise ValueError(f"register_transport({name!r}): {cls!r} is not a class nor 'module:Class'")
    known = _REGISTRY.get(name)
    entry = Registered(name, cls, devices)
    if known is not None and known != entry:
        raise ValueError(f"register_transport: {name!r} is already registered ({_where(known.target)}); "
                         f"choose another name")
    _REGISTRY[name] = entry


def transport_names(device: str) -> Tuple[str, ...]:
    """The names registered for ``device``, in the order they were registered."""
    return tuple(name for name, entry in _REGISTRY.items() if device in entry.devices)


def gpu_transport_choices() -> Tuple[str, ...]:
    """The values ``RINGMASTER_GPU_TRANSPORT`` takes: ``auto`` and every transport registered for ``cuda``."""
    return ("auto", *transport_names("cuda"))


def transport_class(name: str, device: str = "cuda") -> type:
    """The class of transport ``name`` for ``device`` (``ValueError`` naming the choices if there is none)."""
    entry = _REGISTRY.get(name)
    if entry is None or device not in entry.devices:
        kind = "GPU" if device == "cuda" else device
        raise ValueError(f"unknown {kind} transport {name!r}; use one of {', '.join(transport_names(device))} "
                         f"(or register one: ringmaster.common.transports.register_transport)")
    if isinstance(entry.target, str):
        module, cls = entry.target.split(":")
        return getattr(importlib.import_module(module), cls)
    return entry.target


def _where(target) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


# ringmaster's own, in the order messages list them.
register_transport("host", "ringmaster.ops.transport:HostTransport", devices=("cpu",))
register_transport("nccl", "ringmaster.ops.gpu.nccl:NcclTransport")
register_transport("ipc", "ringmaster.ops.gpu.ipc:IpcTransport")
register_transport("mpi", "ringmaster.ops.gpu.cuda_mpi:CudaMpiTransport")
register_transport("staged", "ringmaster.ops.gpu.staged:StagedTransport")

__all__ = ["DEVICES", "RESERVED", "Registered", "gpu_transport_choices", "register_transport", "transport_class",
           "transport_names"]
