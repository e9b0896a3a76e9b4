"""Every transport implements ``ops.transport.Transport``, and the GPU ones open by name from one
registry whose names are the setting's choices (no GPU or CuPy needed: the classes import without)."""

import inspect

import pytest
from mpijob import mpirun

from ringmaster.common.config import GPU_TRANSPORTS
from ringmaster.ops.gpu import TRANSPORT_CLASSES, open_transport, transport_class
from ringmaster.ops.hierarchical import HierarchicalTransport
from ringmaster.ops.transport import HostTransport, Transport

METHODS = [name for name, member in inspect.getmembers(Transport, inspect.isfunction) if not name.startswith("_")]


def test_the_registry_holds_every_transport_the_setting_names():
    assert set(TRANSPORT_CLASSES) == set(GPU_TRANSPORTS) - {"auto"}


@pytest.mark.parametrize("cls", [HostTransport, HierarchicalTransport,
                                 *(transport_class(name) for name in TRANSPORT_CLASSES)], ids=lambda cls: cls.__name__)
def test_every_transport_implements_the_interface(cls):
    assert len(METHODS) == 9 and "allreduce" in METHODS
    missing = [name for name in METHODS if not callable(getattr(cls, name, None))]
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert isinstance(getattr(cls, "name", None), str)
    for name in METHODS:  # the interface's parameters, in its order (extra keywords allowed after them)
        wanted = list(inspect.signature(getattr(Transport, name)).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        assert have[:len(wanted)] == wanted, f"{cls.__name__}.{name}{have} is not Transport.{name}{wanted}"


def test_an_unknown_transport_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown GPU transport 'rdma'; use one of nccl, ipc, mpi, staged"):
        open_transport("rdma", None, None, 0)


@pytest.mark.timeout(60)
def test_the_host_transport_runs_every_collective_against_numpy():
    result = mpirun(2, """
        import numpy as np
        from mpi4py import MPI
        from ringmaster.ops.transport import HostTransport, Transport
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        t = HostTransport(comm, 1 << 16)
        assert isinstance(t, Transport)
        a = np.arange(10, dtype=np.float32) * (rank + 1)
        t.allreduce(a, "sum", scale=0.5)
        assert np.array_equal(a, np.arange(10, dtype=np.float32) * 1.5), a
        out = np.empty(10, dtype=np.float32)
        t.allreduce(out, "max", source=np.full(10, rank, np.float32))
        assert (out == size - 1).all()
        b = np.full(4, rank, np.int32); t.broadcast(b, 1); assert (b == 1).all()
        recv = np.empty(2 * 3, np.uint8); t.allgatherv(np.full(3, rank, np.uint8), recv, [3, 3])
        assert recv.tolist() == [0, 0, 0, 1, 1, 1]
        part = np.empty(5, np.float32); t.reducescatter(np.ones(10, np.float32), part, "sum", [5, 5])
        assert (part == 2).all()
        print("OK", rank, flush=True)
    """, timeout=50)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.lines_starting("OK")) == ["0", "1"], result.output[-2000:]
