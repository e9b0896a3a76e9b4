"""Every test that needs CUDA is marked ``cuda``: CI (no GPU) skips it with the reason, and
the device check (``bench/gpu/device_check.sh``, ``pytest -m cuda``) runs it. Read from the
source by tests/cuda_markers.py; tests/conftest.py refuses, at collection, a CUDA device
given as a parameter to an unmarked test."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import cuda_markers

TESTS = pathlib.Path(__file__).resolve().parent


def test_every_test_that_needs_cuda_is_marked():
    assert cuda_markers.unmarked(TESTS) == []


def test_the_scan_sees_the_tests_that_need_cuda():
    needing = {(path.name, test.name) for path in TESTS.glob("test_*.py")
               for test in cuda_markers.tests_of(path) if test.uses}
    assert {("test_gpu.py", "test_distributed_training_on_cuda_equals_one_process_on_the_whole_batch"),
            ("test_gpu.py", "test_hierarchical_allreduce_on_cuda_on_pretend_hosts_matches_numpy"),
            ("test_quantization.py", "test_cuda_matches_cpu"),
            ("test_gpu_compression.py", "test_the_device_path_reads_back_only_where_the_docs_say")} <= needing


def findings(source: str) -> dict:
    """test name -> (needs CUDA, marked) for a module's source (jobs from tests/jobs)."""
    tests = cuda_markers.tests_of_source(textwrap.dedent(source), "test_m.py", TESTS / "jobs")
    return {t.name: (bool(t.uses), t.marked) for t in tests}


NEEDING = {
    # tests/test_quantization.py before it was marked: skipped on CI, never selected by -m cuda
    "skipif guard": """
        @pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
        def test_x():
            encode(x.cuda())
    """,
    # tests/test_rgc.py before: no cuda case is even collected without a GPU
    "parameters built where a GPU is": """
        DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

        @pytest.mark.parametrize("device", DEVICES)
        def test_x(device):
            pass
    """,
    "device keyword": """
        def test_x():
            torch.ones(2, device="cuda:0")
    """,
    "torch.cuda through a helper": """
        def settle():
            torch.cuda.synchronize()

        def helper():
            settle()

        def test_x():
            helper()
    """,
    "cupy": """
        def test_x():
            import cupy
    """,
    "a job that needs a GPU": """
        TRAINING = (JOBS / "gpu_training.py").read_text()

        def test_x():
            mpirun(2, TRAINING)
    """,
    "a job's argument": """
        def test_x():
            mpirun(4, JOB, args=["cuda", "2"])
    """,
    "an unmarked method": """
        class TestX:
            def test_x(self):
                torch.cuda.manual_seed(1)
    """,
}


@pytest.mark.parametrize("case", NEEDING)
def test_the_scan_finds_a_test_needing_cuda_unmarked(case):
    assert findings(NEEDING[case]) == {"test_x": (True, False)}


NOT_NEEDING_OR_MARKED = {
    "marked": """
        @pytest.mark.cuda
        def test_x():
            torch.ones(2).cuda()
    """,
    "module mark": """
        pytestmark = [pytest.mark.timeout(9), pytest.mark.cuda]

        def test_x():
            torch.cuda.synchronize()
    """,
    "class mark": """
        @pytest.mark.cuda
        class TestX:
            def test_x(self):
                torch.cuda.synchronize()
    """,
    "marked parameter, guarded branch": """
        DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

        def settle(device):
            if device == "cuda":
                torch.cuda.synchronize()

        @pytest.mark.parametrize("device", DEVICES)
        def test_x(device):
            settle(device)
    """,
    "probes only": """
        @pytest.mark.skipif(torch.cuda.is_available() or torch.cuda.device_count(), reason="x")
        def test_x():
            assert rm.cuda_built() is False
    """,
    "a name, not a device": """
        def test_x():
            request(device="cuda")  # cuda-marker: not a device (compared by the coordinator)
    """,
}


@pytest.mark.parametrize("case", NOT_NEEDING_OR_MARKED)
def test_the_scan_accepts_marked_tests_and_tests_that_need_no_cuda(case):
    assert findings(NOT_NEEDING_OR_MARKED[case])["test_x"] in {(True, True), (False, False)}


def test_collection_refuses_a_cuda_parameter_without_the_mark(tmp_path):
    (tmp_path / "test_p.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("device", ["cpu", "cuda", pytest.param("cuda:1", marks=pytest.mark.cuda)])
        def test_p(device):
            pass
    """))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                             "--collect-only", "--rootdir", str(tmp_path), str(tmp_path / "test_p.py")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert result.returncode == 4, result.stdout + result.stderr  # a usage error
    assert "test_p.py::test_p[cuda]" in result.stderr and "cuda:1" not in result.stderr, result.stderr
