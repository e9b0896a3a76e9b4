"""The benchmark scripts still run and print their tables (tiny budgets: a smoke test, not a timing)."""

import pathlib
import re
import sys

import pytest
from mpijob import MPIRUN_ARGS, job_environment, run_command

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.timeout(180)
def test_allreduce_benchmark_prints_its_table():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "allreduce.py"),
                          "--budget", "0.01"], timeout=170, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    assert "rm/mpi" in result.stdout and "64 MiB" in result.stdout
    assert "100 x 16 KiB async allreduces" in result.stdout and "4-byte allreduce round trip" in result.stdout


@pytest.mark.timeout(120)
def test_ring_vs_mpi_benchmark_prints_its_table():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "ring_vs_mpi.py"),
                          "--sizes", "4K,1M", "--reps", "3"], timeout=110, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    assert "1 MiB" in result.stdout or "1M" in result.stdout, result.stdout


@pytest.mark.timeout(90)
def test_training_benchmark_prints_its_table_and_a_trace():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "train.py"),
                          "--rounds", "1", "--steps", "1", "--warmup", "1", "--batch-size", "2", "--trace"],
                         timeout=80, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    for model in ("mlp", "cnn"):
        for mode in ("no-comm", "sync-only", "ringmaster", "ddp-gloo", "naive-mpi"):
            assert re.search(rf"^(\[0\]: )?{model} .* {mode} ", result.stdout, re.MULTILINE), result.stdout
    # One traced step per model and rank, read from ringmaster's timeline.
    assert result.stdout.count("first allreduce") == 4, result.stdout
    assert len(re.findall(r"\d+ of \d+ allreduces started before backward ended", result.stdout)) == 4, result.stdout


@pytest.mark.timeout(90)
def test_step_phases_benchmark_prints_phases_and_differences():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "step_phases.py"),
                          "--model", "lenet", "--turns", "3", "--warmup", "1", "--batch-size", "2"],
                         timeout=80, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    number = r" +[+-]?\d+\.\d\d"
    for mode in ("sync-only", "naive-mpi", "ringmaster"):
        for rank in (0, 1):  # one row of medians per rank, then one of differences for the compared modes
            rows = re.findall(rf"^(?:\[0\]: )?{mode} +{rank}(?:{number}){{5}}$", result.stdout, re.MULTILINE)
            assert len(rows) == (1 if mode == "sync-only" else 2), result.stdout
    for mode in ("naive-mpi", "ringmaster"):
        assert re.search(rf"^(?:\[0\]: )?{mode} +slowest{number}$", result.stdout, re.MULTILINE), result.stdout
    assert "backward passes ended apart" in result.stdout, result.stdout


@pytest.mark.timeout(60)
def test_quantize_benchmark_prints_its_table():
    result = run_command([sys.executable, str(BENCH / "quantize.py"), "--sizes", "4K", "--reps", "2",
                          "--threads", "1,all"], timeout=50, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    for codec in ("float32 copy_", "dynamic tree", "linear8", "dynamic tree, bucketize"):
        assert re.search(rf"^ +4K +1  {codec} ", result.stdout, re.MULTILINE), result.stdout
    assert "timing 4K elements" in result.stderr


@pytest.mark.timeout(60)
def test_selection_benchmark_prints_its_table():
    result = run_command([sys.executable, str(BENCH / "selection.py"), "--sizes", "4K,64K", "--reps", "1",
                          "--threads", "1,all"], timeout=50, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    for method in ("torch.topk", "trimmed top-k", "threshold, search", "threshold, reuse", "sampled search"):
        assert re.search(rf"^ +64 Ki \| +1 \| {method} +\|", result.stdout, re.MULTILINE), result.stdout
    assert "64 Ki, 1 thread(s): repetition 1/1" in result.stderr


@pytest.mark.timeout(90)
def test_compression_benchmark_prints_bytes_and_step_times():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "compression.py"),
                          "--hidden", "256", "--rounds", "1", "--steps", "1", "--warmup", "1", "--ratio", "0.01"],
                         timeout=80, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    rows = dict(re.findall(r"^\| (\w+) \| [0-9.]+ \| [0-9.]+ × \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) × \|$", result.stdout,
                           re.MULTILINE))
    assert set(rows) == {"dense", "fp16", "int8", "linear8", "rgc", "topk"}, result.stdout
    assert float(rows["dense"]) == 1.0 and 3.9 <= float(rows["int8"]) <= 4.0 and float(rows["rgc"]) > 10, rows


@pytest.mark.timeout(90)
def test_hybrid_benchmark_prints_step_times_and_bytes():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "hybrid.py"),
                          "--width", "256", "--batch-size", "4", "--rounds", "1", "--steps", "1", "--warmup", "1"],
                         timeout=80, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    number = r" [0-9.]+ \|"
    rows = dict(re.findall(rf"^\| ([\w-]+) \|{number * 4} [0-9.]+ × \|{number} (.+) \|$", result.stdout,
                           re.MULTILINE))
    assert set(rows) == {"no-comm", "data-parallel", "hybrid-a", "hybrid-b", "hybrid-c"}, result.stdout
    # no-comm sends nothing of its own; the response cache's cycles may still carry the bench's
    # last cached metric (rm.bytes_sent() counts them), a few hundred bytes against megabytes.
    assert rows["data-parallel"] == "1.0 × fewer", rows
    assert rows["no-comm"] == "—" or float(rows["no-comm"].split()[0]) >= 100, rows


@pytest.mark.timeout(120)
def test_cluster_benchmark_runs_across_shaped_hosts():
    sys.path.insert(0, str(BENCH.parent / "tests" / "cluster"))
    import netns_cluster

    reason = netns_cluster.unavailable_reason()
    if reason:
        from cluster.fixtures import unavailable
        unavailable(reason)
    result = run_command([sys.executable, str(BENCH / "cluster.py"), "--rate", "1gbit", "--sizes", "1M",
                          "--reps", "1", "--skip-training"], timeout=110, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    assert re.search(r"raw TCP, one stream: [0-9.]+ MB/s", result.stdout), result.stdout
    for name in ("ringmaster", "ringmaster int8", "mpi4py"):
        assert re.search(rf"^\| 1 MiB \| {name} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ × \|$", result.stdout, re.MULTILINE), \
            result.stdout


@pytest.mark.timeout(150)
def test_small_collectives_benchmark_prints_cached_negotiated_and_mpi():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "small_collectives.py"),
                          "--rounds", "2", "--steps", "2"], timeout=140, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    for row in ("4-byte allreduce p50", "100 x 16 KiB async step", "submitting, per tensor", "cache awake"):
        assert row in result.stdout, result.stdout


@pytest.mark.timeout(120)
def test_anatomy_benchmark_times_the_parts_of_a_cached_allreduce():
    for extra, rows in ((["--calls", "200"], ("make the vector", "whole call, untimed", "carried in the cycle")),
                        (["--sizes", "4,65536"], ("ringmaster", "65536"))):
        result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "anatomy.py"), *extra],
                             timeout=100, env=job_environment())
        assert result.returncode == 0, result.output[-3000:]
        for row in rows:
            assert row in result.stdout, result.stdout


@pytest.mark.timeout(90)
def test_mpi_nonblocking_benchmark_prints_both_ways():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "mpi_nonblocking.py")],
                         timeout=80, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    assert "blocking" in result.stdout and "1024 KiB" in result.stdout, result.stdout


@pytest.mark.timeout(120)
def test_sharded_benchmark_prints_state_and_step_times():
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, str(BENCH / "sharded.py"),
                          "--width", "64", "--rounds", "1", "--steps", "1", "--warmup", "1"],
                         timeout=110, env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    for mode, peer in (("unsharded", "ddp"), ("sharded", "ddp-zero"), ("sharded-overlap", "ddp-zero"),
                       ("ddp-zero", "ddp-zero"), ("ddp", "ddp")):
        assert re.search(rf"^(\[0\]: )?{mode} +\d+\.\d +\d\.\d{{3}} .* \d+\.\d\d {peer}$", result.stdout,
                         re.MULTILINE), result.stdout
