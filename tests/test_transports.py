"""Every transport implements ``ops.transport.Transport``, and every one opens by name from one
registry (``common/transports.py``) whose GPU names are the setting's choices (no GPU or CuPy
needed: the classes import without)."""

import inspect

import pytest
from mpijob import mpirun

from ringmaster.common import transports
from ringmaster.common.config import SETTINGS, ConfigError, load_config
from ringmaster.ops.gpu import open_transport, transport_class
from ringmaster.ops.hierarchical import HierarchicalTransport
from ringmaster.ops.transport import HostTransport, HostTransports, Transport

#: The registry's key for GPU transports: a name, not a device any test here uses.
GPU = "cuda"  # cuda-marker: not a device (a registry key)

METHODS = [name for name, member in inspect.getmembers(Transport, inspect.isfunction) if not name.startswith("_")]


def test_the_registry_holds_ringmasters_transports_and_the_setting_offers_its_gpu_ones():
    assert transports.transport_names("cpu") == ("host",)
    assert transports.transport_names(GPU) == ("nccl", "ipc", "mpi", "staged")
    setting = next(setting for setting in SETTINGS if setting.variable == "RINGMASTER_GPU_TRANSPORT")
    assert setting.choices == ("auto", "nccl", "ipc", "mpi", "staged") == transports.gpu_transport_choices()
    assert transports.transport_class("host", "cpu") is HostTransport


@pytest.fixture
def registered():
    """Registers transports for one test and forgets them after it."""
    names = []

    def register(name, cls, devices=(GPU,)):
        transports.register_transport(name, cls, devices)
        names.append(name)
    yield register
    for name in names:
        transports._REGISTRY.pop(name, None)


def test_a_registered_transport_is_a_choice_of_the_setting_and_opens(registered):
    class LoopTransport(HostTransport):
        name = "loop"

    with pytest.raises(ConfigError, match="RINGMASTER_GPU_TRANSPORT='loop' is invalid"):
        load_config({"RINGMASTER_GPU_TRANSPORT": "loop"})
    registered("loop", LoopTransport, devices=(GPU, "cpu"))
    registered("lazy", "ringmaster.ops.gpu.staged:StagedTransport")
    assert load_config({"RINGMASTER_GPU_TRANSPORT": "Loop"}).gpu_transport == "loop"
    assert transports.gpu_transport_choices()[-2:] == ("loop", "lazy")
    assert transport_class("loop") is LoopTransport and transport_class("lazy") is transport_class("staged")
    assert HostTransports(1 << 16, "loop").choose(None).name == "loop"
    assert transports.transport_class("loop", "cpu") is LoopTransport
    transports.register_transport("loop", LoopTransport, (GPU, "cpu"))  # the same again: nothing changes


@pytest.mark.parametrize("args, error", [
    (("Bad Name", HostTransport), "not a lower-case word"),
    (("auto", HostTransport), "'auto' is reserved"),
    (("hierarchical", HostTransport), "'hierarchical' is reserved"),
    (("nccl", HostTransport), "'nccl' is already registered .ringmaster.ops.gpu.nccl:NcclTransport."),
    (("tpu", HostTransport, ("tpu",)), r"devices \['tpu'\] must be some of cpu, cuda"),
    (("broken", "no colon here"), "is not a class nor 'module:Class'"),
])
def test_a_bad_registration_is_refused_naming_the_fix(args, error):
    with pytest.raises(ValueError, match=error):
        transports.register_transport(*args)
    assert transports.transport_names(GPU) == ("nccl", "ipc", "mpi", "staged")


@pytest.mark.parametrize("cls", [HostTransport, HierarchicalTransport,
                                 *(transport_class(name) for name in transports.transport_names(GPU))],
                         ids=lambda cls: cls.__name__)
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
    with pytest.raises(ValueError, match="unknown cpu transport 'nccl'; use one of host"):
        transports.transport_class("nccl", "cpu")


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
