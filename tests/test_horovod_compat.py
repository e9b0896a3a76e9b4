"""Scripts written for horovod.torch run with the import line changed, and uneven data with join()."""

import pathlib
import re

import pytest
from mpijob import mpirun, ringrun

JOBS = pathlib.Path(__file__).parent / "jobs"
HOROVOD_IMPORT = "import horovod.torch as hvd"


def horovod_script_with_ringmaster() -> str:
    source = (JOBS / "horovod_script.py").read_text()
    assert source.count(HOROVOD_IMPORT) == 1
    return source.replace(HOROVOD_IMPORT, "import ringmaster as hvd")


def assert_trained_alike(result, np):
    """The script trained its 3 epochs past 85 % accuracy, and every rank holds the same weights."""
    assert result.returncode == 0, result.output[-4000:]
    accuracies = [float(a) for a in re.findall(r"accuracy ([0-9.]+)%", result.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 85.0, result.stdout
    agreed = result.lines_starting("rank ")
    assert len(agreed) == np and all(f"saw {np} ranks, weights identical: True" in line for line in agreed), \
        result.output[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 4])
def test_a_horovod_script_runs_with_only_the_import_changed(np):
    assert_trained_alike(ringrun(np, horovod_script_with_ringmaster(), timeout=110, ringrun_args=["--oversubscribe"]),
                         np)


@pytest.mark.timeout(120)
def test_the_horovod_script_with_fp16_allreduce():
    result = ringrun(2, horovod_script_with_ringmaster(), timeout=110, args=["--fp16-allreduce"])
    assert result.returncode == 0, result.output[-4000:]
    accuracies = [float(a) for a in re.findall(r"accuracy ([0-9.]+)%", result.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 85.0, result.stdout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np,fp16", [(2, False), (3, True), (4, False)])
def test_the_horovod_script_with_adasum(np, fp16):
    """Horovod's --use-adasum (learning rate not scaled), also with --fp16-allreduce, which
    Horovod's PyTorch refuses, and at 3 ranks, which Horovod refuses."""
    args = ["--use-adasum"] + (["--fp16-allreduce"] if fp16 else [])
    assert_trained_alike(ringrun(np, horovod_script_with_ringmaster(), timeout=140, ringrun_args=["--oversubscribe"],
                                 args=args), np)


# Three wide hidden layers: the plan's buckets are [head fused, 1.4 MB, bias, 1.4 MB, first layer];
# with only small buckets started from the hooks, step() reduces the rest last produced first.
WIDE = {"UNEVEN_HIDDEN": "600", "UNEVEN_HIDDEN_LAYERS": "3"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np, first_batches, epochs, overlap, model",
                         [(2, 2, 1, "auto", {}), (3, 2, 1, "auto", {}), (2, 1, 1, "auto", {}), (3, 1, 2, "auto", {}),
                          (4, 1, 2, "all", {}),
                          (4, 2, 1, "small", {**WIDE, "UNEVEN_EXPECT_ORDER": "0,4,3,2,1"}),
                          (2, 2, 1, "all", {**WIDE, "UNEVEN_EXPECT_ORDER": "0,1,2,3,4"})],
                         ids=["2-ranks", "3-ranks", "joined-before-the-plan-ran", "two-epochs",
                              "two-epochs-buckets-on-the-plan-thread", "wide-layers-reduced-last-produced-first",
                              "wide-layers-on-the-plan-thread-in-order"])
def test_uneven_data_with_join_finishes_and_matches_the_reference(np, first_batches, epochs, overlap, model):
    result = mpirun(np, (JOBS / "uneven_join.py").read_text(), timeout=110,
                    env={"UNEVEN_FIRST_BATCHES": str(first_batches), "UNEVEN_EPOCHS": str(epochs),
                         "RINGMASTER_PLAN_OVERLAP": overlap, **model})
    failures = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert not failures, "\n".join(failures)
    assert result.stdout.count("DONE 0 failures") == np, result.output[-3000:]
    assert result.returncode == 0
