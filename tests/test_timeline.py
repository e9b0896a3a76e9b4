"""The timeline: Chrome-tracing JSON of each tensor's negotiation, queue and run."""

import json
import pathlib

import pytest
from mpijob import mpirun, ringrun

JOBS = pathlib.Path(__file__).parent / "jobs"
SMALL_JOB = """
import torch
import ringmaster as rm
rm.init()
rm.allreduce(torch.ones(3), name="summed")
rm.shutdown()
"""


@pytest.mark.timeout(90)
def test_start_and_stop_timeline_record_every_tensor(tmp_path):
    result = mpirun(2, (JOBS / "timeline.py").read_text(), timeout=80, args=[str(tmp_path)])
    assert [line for line in result.output.splitlines() if line.startswith("FAIL")] == []
    assert result.stdout.count("DONE 0 failures") == 2, result.output[-3000:]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pattern,files", [("tl.{rank}.json", ["tl.0.json", "tl.1.json"]),
                                           ("tl.json", ["tl.json"])])
def test_ringrun_timeline_filename_records_from_init(tmp_path, pattern, files):
    result = ringrun(2, SMALL_JOB, timeout=80, ringrun_args=["--timeline-filename", str(tmp_path / pattern)])
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    for name in files:
        events = json.loads((tmp_path / name).read_text())
        assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "summed"}} in events
        assert [e["name"] for e in events if e["ph"] == "B"] == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE",
                                                                 "MPI_ALLREDUCE"]


@pytest.mark.timeout(30)
def test_start_timeline_in_a_missing_directory_is_refused(tmp_path):
    result = mpirun(1, f"""
import ringmaster as rm
rm.init()
try:
    rm.start_timeline({str(tmp_path / "missing" / "t.json")!r})
except ValueError as error:
    print("refused:", error)
rm.shutdown()
""", timeout=25)
    assert "refused:" in result.stdout and "does not exist" in result.stdout, result.output[-2000:]
