"""The GPU path's logic that needs no GPU, run in CI: transport choice, CUDA-awareness,
the staged pipeline's schedule and collectives (host arrays for device ones), the
hierarchical allreduce's composition of transports, settings."""

import pathlib

import pytest
from mpijob import assert_job_passed, mpirun

from ringmaster.common.config import ConfigError, load_config
from ringmaster.ops.gpu import Placement, choose_hierarchical, choose_transport
from ringmaster.ops.gpu.cuda_aware import mpi_cuda_support
from ringmaster.ops.gpu.staged import STAGED_MAX_CHUNKS, staged_chunks

JOBS = pathlib.Path(__file__).parent / "jobs"
STAGED_JOB = (JOBS / "staged_host.py").read_text()
HIERARCHICAL_JOB = (JOBS / "hierarchical_transports.py").read_text()
#: staged_host.py's checks on every rank: 20 allreduces, 16 schedules, the chunking, 4 other
#: collectives, and 36 of the 8-bit ring (on the staged link, and a chunk at a time).
STAGED_CASES = 77


def placement(hosts, gpus, nccl=True, cuda_aware=False):
    return Placement(tuple(hosts), tuple(gpus), nccl, cuda_aware, "libmpi.so.40: MPIX_Query_cuda_support() = 0")


@pytest.mark.parametrize("hosts,gpus,nccl,cuda_aware,expected", [
    (["a", "a"], ["a/0", "a/1"], True, False, "nccl"),             # a GPU per rank
    (["a", "b"], ["a/0", "b/0"], True, False, "nccl"),             # across hosts, a GPU each
    (["a"], ["a/0"], True, False, "nccl"),                         # one rank
    (["a", "a"], ["a/0", "a/0"], True, False, "ipc"),              # two ranks share a GPU
    (["a", "a"], ["a/0", "a/1"], False, False, "ipc"),             # no NCCL, one host
    (["a", "a", "b", "b"], ["a/0", "a/0", "b/0", "b/0"], True, True, "mpi"),
    (["a", "a", "b", "b"], ["a/0", "a/0", "b/0", "b/0"], True, False, "staged"),
    (["a", "b"], ["a/0", "b/0"], False, False, "staged"),
])
def test_auto_picks_the_transport_that_fits_the_placement(hosts, gpus, nccl, cuda_aware, expected):
    choice = choose_transport("auto", placement(hosts, gpus, nccl, cuda_aware))
    assert choice.name == expected
    assert choice.reason


@pytest.mark.parametrize("setting,hosts,gpus,nccl,cuda_aware,message", [
    ("nccl", ["a", "a"], ["a/0", "a/0"], True, False, "ranks 0, 1 share GPU a/0"),
    ("nccl", ["a", "a"], ["a/0", "a/1"], False, False, "CuPy has no NCCL"),
    ("ipc", ["a", "b"], ["a/0", "b/0"], True, False, "CUDA IPC works only within one host"),
    ("mpi", ["a"], ["a/0"], True, False, "not CUDA-aware (libmpi.so.40: MPIX_Query_cuda_support() = 0)"),
    ("gloo", ["a"], ["a/0"], True, False, "not a GPU transport"),
])
def test_a_forced_transport_that_cannot_run_is_refused_with_the_reason(setting, hosts, gpus, nccl, cuda_aware,
                                                                      message):
    with pytest.raises(ValueError, match="RINGMASTER_GPU_TRANSPORT") as error:
        choose_transport(setting, placement(hosts, gpus, nccl, cuda_aware))
    assert message in str(error.value)


@pytest.mark.parametrize("setting", ["nccl", "ipc", "staged"])
def test_a_forced_transport_that_fits_is_used(setting):
    assert choose_transport(setting, placement(["a"], ["a/0"])).name == setting


@pytest.mark.parametrize("local_gpus,nccl,cuda_aware,within,between", [
    (["a/0", "a/1"], True, False, "nccl", "staged"),   # Horovod's placement: NCCL in the host, MPI between
    (["a/0", "a/1"], True, True, "nccl", "mpi"),       # a CUDA-aware MPI takes the device chunk
    (["a/0", "a/0"], True, False, "ipc", "staged"),    # ranks of a host share its GPU
    (["a/0", "a/1"], False, False, "ipc", "staged"),   # no NCCL
])
def test_the_hierarchical_allreduce_picks_a_transport_within_and_one_between_hosts(local_gpus, nccl, cuda_aware,
                                                                                   within, between):
    local = placement(["a", "a"], local_gpus, nccl, cuda_aware)
    cross = placement(["a", "b"], ["a/0", "b/0"], nccl, cuda_aware)
    inside, across = choose_hierarchical("auto", local, cross)
    assert (inside.name, across.name) == (within, between)
    assert across.reason.startswith("between hosts")


def test_the_hierarchical_allreduce_refuses_a_forced_transport_that_cannot_run_within_the_host():
    shared = placement(["a", "a"], ["a/0", "a/0"])
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        choose_hierarchical("nccl", shared, placement(["a", "b"], ["a/0", "b/0"]))
    assert choose_hierarchical("staged", shared, placement(["a", "b"], ["a/0", "b/0"]))[0].name == "staged"


@pytest.mark.timeout(120)
def test_hierarchical_transport_on_two_pretend_hosts_of_two_with_each_transports_host_logic():
    """ipc within the hosts (its own schedule over shared-memory windows), staged or a
    CUDA-aware mpi between them (their own code on host buffers), the runtime's rule."""
    # osc ^ucx: the wheel's UCX one-sided component complains (harmlessly) where there is no UCX device.
    result = mpirun(4, HIERARCHICAL_JOB, timeout=100, args=["host", "2"], env={"OMPI_MCA_osc": "^ucx"})
    assert_job_passed(result, 4)
    assert result.lines_starting("DONE") == ["363 cases, 0 failures"] * 4, result.stdout[-3000:]


def test_the_wheels_open_mpi_is_detected_as_not_cuda_aware(monkeypatch):
    monkeypatch.delenv("RINGMASTER_CUDA_AWARE_MPI", raising=False)
    mpi_cuda_support.cache_clear()
    aware, detail = mpi_cuda_support()
    assert aware is False
    assert "libmpi" in detail


def test_the_cuda_awareness_override_is_honoured(monkeypatch):
    monkeypatch.setenv("RINGMASTER_CUDA_AWARE_MPI", "1")
    mpi_cuda_support.cache_clear()
    try:
        assert mpi_cuda_support() == (True, "RINGMASTER_CUDA_AWARE_MPI=1")
    finally:
        mpi_cuda_support.cache_clear()


def test_gpu_transport_setting_is_parsed_and_checked():
    assert load_config({}).gpu_transport == "auto"
    assert load_config({"RINGMASTER_GPU_TRANSPORT": "IPC"}).gpu_transport == "ipc"
    with pytest.raises(ConfigError, match="RINGMASTER_GPU_TRANSPORT='gloo' is invalid: must be one of auto"):
        load_config({"RINGMASTER_GPU_TRANSPORT": "gloo"})


def test_staged_chunks_cover_the_buffer_and_stay_within_bounds():
    for count, itemsize in [(1, 4), (262_144, 4), (16 << 20, 4), (3_000_001, 2)]:
        bounds = staged_chunks(count, itemsize)
        assert bounds[0] == 0 and bounds[-1] == count
        assert 1 <= len(bounds) - 1 <= STAGED_MAX_CHUNKS
    assert len(staged_chunks(16 << 20, 4)) - 1 == STAGED_MAX_CHUNKS  # 64 MiB: the most chunks


def test_importing_ringmaster_does_not_import_cupy():
    import subprocess
    import sys

    code = "import sys, ringmaster, ringmaster.ops.gpu; print('cupy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 4])
def test_staged_collectives_and_schedule_with_host_copies(np):
    result = mpirun(np, STAGED_JOB, timeout=100)
    assert_job_passed(result, np)  # no FAIL line, every rank's DONE with 0 failures, exit status 0
    assert result.lines_starting("DONE") == [f"{STAGED_CASES} cases, 0 failures"] * np, result.stdout[-3000:]


@pytest.mark.timeout(60)
def test_the_gpu_transport_setting_reaches_both_executors():
    result = mpirun(1, """
        import ringmaster as rm
        from ringmaster.worker.runtime.current import runtime
        rm.init()
        state = runtime()
        runners = [state.executor] + ([state.cache._executor] if state.cache is not None else [])
        print("SETTINGS", [runner._devices._gpu_transport for runner in runners])
    """, timeout=50, env={"RINGMASTER_GPU_TRANSPORT": "staged"})
    assert result.returncode == 0, result.output[-3000:]
    [settings] = result.lines_starting("SETTINGS")
    assert settings == "['staged', 'staged']"  # the job's executor and the response cache's
