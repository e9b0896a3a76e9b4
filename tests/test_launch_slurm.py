"""ringrun inside a SLURM allocation: node-list and count parsing, hosts and -np from SLURM's
variables, the mpirun command for a fake allocation, and one real job on this machine with
a fake SLURM environment. No SLURM is needed; only the last test starts MPI."""

import socket
import sys

import pytest

from mpijob import job_environment, run_command
from ringmaster.launch import hosts as hosts_module
from ringmaster.launch.cli import parse_args
from ringmaster.launch.errors import LaunchError
from ringmaster.launch.hosts import Host, check_slots, resolve_hosts
from ringmaster.launch.mpi_command import MPICH, OPENMPI, MpiImplementation, build_command
from ringmaster.launch.network import CoordinatorAddress
from ringmaster.launch.slurm import (MAX_NODES, SlurmAllocation, expand_counts, expand_nodelist,
                                     in_allocation, slurm_allocation)

OMPI5 = MpiImplementation("/opt/ompi/bin/mpirun", OPENMPI, (5, 0, 11))
HYDRA = MpiImplementation("/opt/mpich/bin/mpirun", MPICH, (4, 2, 0))
PYTHON = [sys.executable, "-c", "pass"]


def _env(**variables):
    """A fake allocation: job 42 on node[01-02] with 4 tasks each, plus ``variables``
    (``None`` removes one)."""
    env = {"PATH": "/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-02]",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS": "8"}
    env.update(variables)
    return {name: value for name, value in env.items() if value is not None}


# ---------------------------------------------------------------- node lists

@pytest.mark.parametrize("text, names", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("n[001-003]", ["n001", "n002", "n003"]),
    ("n[5]", ["n5"]),
    ("n[07]", ["n07"]),
    ("n[3-3]", ["n3"]),
    ("a[1-3]b", ["a1b", "a2b", "a3b"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("r[1-2]c[3,5]n[0]", ["r1c3n0", "r1c5n0", "r2c3n0", "r2c5n0"]),
    ("gpu-a.example.com", ["gpu-a.example.com"]),
    ("gpu-[1-2].example.com", ["gpu-1.example.com", "gpu-2.example.com"]),
    ("node[01-02],login1,gpu[7,9-10]", ["node01", "node02", "login1", "gpu7", "gpu9", "gpu10"]),
    ("a, b  c\td", ["a", "b", "c", "d"]),
    ("  node[1-2]  ", ["node1", "node2"]),
    ("a,a", ["a", "a"]),
    ("x[1,3,2]", ["x1", "x3", "x2"]),
    ("node_1,NODE-2", ["node_1", "NODE-2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"),
    ("   ", "empty"),
    ("node[01-04", "'[' without a matching ']'"),
    ("node01]", "']' without a matching '['"),
    ("a[1-2]]", "']' without a matching '['"),
    ("a[[1-2]]", "nested"),
    ("a[]", "empty brackets"),
    ("a[4-2]", "range '4-2' goes down; write it as 2-4"),
    ("a[10-09]", "goes down"),
    ("a,,b", "empty entry"),
    (",a", "empty entry"),
    ("a,", "empty entry"),
    ("a[x]", "[x] holds 'x'"),
    ("a[1-]", "holds '1-'"),
    ("a[-2]", "holds '-2'"),
    ("a[1-2-3]", "holds '1-2-3'"),
    ("a[1,,2]", "holds ''"),
    ("a[1, 2]", "holds ' 2'"),
    ("[1-2]", "only brackets"),
    (f"n[0-{MAX_NODES}]", "more than"),
    ("a[1-1000]b[1-1000]", "more than"),
])
def test_expand_nodelist_errors_name_variable_and_value(text, fragment):
    with pytest.raises(LaunchError) as error:
        expand_nodelist(text, "SLURM_JOB_NODELIST")
    message = str(error.value)
    assert f"SLURM_JOB_NODELIST={text!r}" in message
    assert fragment in message


# ---------------------------------------------------------------- counts per node

@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("2(x3),1(x2),5", [2, 2, 2, 1, 1, 5]),
    ("72(x2),36", [72, 72, 36]),
    ("1(x1)", [1]),
    ("0,2", [0, 2]),
    (" 3 , 4 ", [3, 4]),
])
def test_expand_counts(text, counts):
    assert expand_counts(text, "SLURM_TASKS_PER_NODE") == counts


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"),
    ("x", "'x' is not N or N(xR)"),
    ("2(x)", "'2(x)'"),
    ("2(3)", "'2(3)'"),
    ("2x3", "'2x3'"),
    ("-1", "'-1'"),
    ("2(x3", "'2(x3'"),
    ("2,,3", "''"),
    ("2(x0)", "repeats 0 times"),
    (f"1(x{MAX_NODES + 1})", "more than"),
])
def test_expand_counts_errors(text, fragment):
    with pytest.raises(LaunchError) as error:
        expand_counts(text, "SLURM_JOB_CPUS_PER_NODE")
    message = str(error.value)
    assert f"SLURM_JOB_CPUS_PER_NODE={text!r}" in message and fragment in message


# ---------------------------------------------------------------- the allocation

def test_outside_slurm_there_is_no_allocation():
    assert slurm_allocation({}) is None
    assert slurm_allocation({"SLURM_JOB_ID": "42"}) is None  # no node list
    assert slurm_allocation({"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "1"}) is None
    assert slurm_allocation(_env(SLURM_JOB_NODELIST="")) is None
    assert not in_allocation({"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": "n1"})
    assert in_allocation(_env())


def test_allocation_from_tasks_per_node():
    allocation = slurm_allocation(_env(SLURM_JOB_NODELIST="node[01-03,07]", SLURM_TASKS_PER_NODE="2(x3),1",
                                       SLURM_NTASKS="7"))
    assert allocation == SlurmAllocation("42", ("node01", "node02", "node03", "node07"), (2, 2, 2, 1),
                                         "SLURM_TASKS_PER_NODE=2(x3),1", 7)
    assert allocation.hosts() == [Host("node01", 2), Host("node02", 2), Host("node03", 2), Host("node07", 1)]
    assert "SLURM job 42" in allocation.describe() and "SLURM_TASKS_PER_NODE" in allocation.describe()


def test_allocation_slot_variables_in_order():
    # SLURM_TASKS_PER_NODE first, then SLURM_NTASKS_PER_NODE (one number for every node),
    # then SLURM_JOB_CPUS_PER_NODE
    both = slurm_allocation(_env(SLURM_NTASKS_PER_NODE="3", SLURM_JOB_CPUS_PER_NODE="16(x2)"))
    assert both.slots == (4, 4)
    per_node = slurm_allocation(_env(SLURM_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="3",
                                     SLURM_JOB_CPUS_PER_NODE="16(x2)"))
    assert per_node.slots == (3, 3) and per_node.slots_from == "SLURM_NTASKS_PER_NODE=3"
    cpus = slurm_allocation(_env(SLURM_TASKS_PER_NODE=None, SLURM_JOB_CPUS_PER_NODE="16,8", SLURM_NTASKS=None))
    assert cpus.slots == (16, 8) and cpus.ntasks is None
    assert cpus.hosts() == [Host("node01", 16), Host("node02", 8)]


def test_allocation_drops_nodes_without_slots_and_joins_repeats():
    allocation = slurm_allocation(_env(SLURM_JOB_NODELIST="a,b,a", SLURM_TASKS_PER_NODE="2,0,1"))
    assert allocation.hosts() == [Host("a", 3)]


@pytest.mark.parametrize("variables, fragments", [
    (dict(SLURM_TASKS_PER_NODE="4(x3)"), ["SLURM_TASKS_PER_NODE='4(x3)' has counts for 3 node(s)",
                                          "SLURM_JOB_NODELIST='node[01-02]' lists 2", "-H/--hostfile"]),
    (dict(SLURM_TASKS_PER_NODE="4"), ["has counts for 1 node(s)"]),
    (dict(SLURM_TASKS_PER_NODE="4(x2"), ["SLURM_TASKS_PER_NODE='4(x2'"]),
    (dict(SLURM_TASKS_PER_NODE="0(x2)"), ["SLURM_TASKS_PER_NODE='0(x2)'", "no node has a slot"]),
    (dict(SLURM_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="2(x2)"),
     ["SLURM_NTASKS_PER_NODE='2(x2)'", "--ntasks-per-node"]),
    (dict(SLURM_TASKS_PER_NODE=None), ["none of SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, "
                                       "SLURM_JOB_CPUS_PER_NODE is set", "-H/--hostfile"]),
    (dict(SLURM_NTASKS="eight"), ["SLURM_NTASKS='eight'", "positive integer"]),
    (dict(SLURM_NTASKS="0"), ["SLURM_NTASKS='0'"]),
    (dict(SLURM_JOB_NODELIST="node[02-01]"), ["SLURM_JOB_NODELIST='node[02-01]'", "goes down"]),
    (dict(SLURM_STEP_NUM_TASKS="8"), ["one of 8 tasks of an srun step", "SLURM_STEP_NUM_TASKS=8",
                                      "not under srun"]),
])
def test_allocation_errors(variables, fragments):
    with pytest.raises(LaunchError) as error:
        slurm_allocation(_env(**variables))
    for fragment in fragments:
        assert fragment in str(error.value)


def test_a_single_task_step_is_fine():
    assert slurm_allocation(_env(SLURM_STEP_NUM_TASKS="1")).slots == (4, 4)


# ---------------------------------------------------------------- hosts and slots

def test_resolve_hosts_prefers_explicit_hosts(tmp_path):
    allocation = slurm_allocation(_env())
    hostfile = tmp_path / "hosts"
    hostfile.write_text("c slots=3\n")
    assert resolve_hosts(None, None, allocation) == [Host("node01", 4), Host("node02", 4)]
    assert resolve_hosts("b:2", None, allocation) == [Host("b", 2)]
    assert resolve_hosts(None, str(hostfile), allocation) == [Host("c", 3)]


def test_check_slots_names_the_allocation():
    allocation = slurm_allocation(_env())
    check_slots(8, allocation.hosts(), oversubscribe=False, allocation=allocation)
    check_slots(20, allocation.hosts(), oversubscribe=True, allocation=allocation)
    with pytest.raises(LaunchError) as error:
        check_slots(9, allocation.hosts(), oversubscribe=False, allocation=allocation)
    message = str(error.value)
    for fragment in ("-np 9", "the 8 of the SLURM allocation", "node01:4,node02:4", "SLURM job 42",
                     "SLURM_TASKS_PER_NODE=4(x2)", "--oversubscribe", "--ntasks-per-node"):
        assert fragment in message, message


def test_check_slots_abbreviates_long_host_lists():
    many = [Host(f"n{i}", 1) for i in range(20)]
    with pytest.raises(LaunchError, match=r"n7:1,\.\.\. \(20 hosts\)"):
        check_slots(21, many, oversubscribe=False)


# ---------------------------------------------------------------- the whole plan

@pytest.fixture
def plan(monkeypatch):
    """``plan(argv, environ, mpi)``: cli.plan_job with a fake MPI, the fake nodes remote and a
    fixed coordinator address (no DNS, no mpirun)."""
    from ringmaster.launch import cli

    here = socket.gethostname()
    monkeypatch.setattr(hosts_module, "is_local_host", lambda name: name in ("localhost", here))
    monkeypatch.setattr(cli, "coordinator_address", lambda hosts, interface: CoordinatorAddress("0.0.0.0", "10.0.0.1"))

    def make(argv, environ, mpi=OMPI5):
        monkeypatch.setattr(cli, "find_mpirun", lambda: mpi.executable)
        monkeypatch.setattr(cli, "detect_mpi", lambda executable: mpi)
        return cli.plan_job(parse_args(argv), environ)
    return make


def _after(command, flag):
    return command[command.index(flag) + 1]


def test_plan_in_allocation_takes_hosts_and_np_from_slurm(plan):
    job = plan(PYTHON, _env(SLURM_JOB_NODELIST="node[01-02]", SLURM_TASKS_PER_NODE="4,2", SLURM_NTASKS="6"))
    assert job.num_proc == 6
    assert job.spec.hosts == [Host("node01", 4), Host("node02", 2)]
    assert job.hosts_origin == "SLURM job 42: SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE=4,2"
    command = build_command(job.mpi, job.spec)
    assert command[:3] == ["/opt/ompi/bin/mpirun", "-np", "6"]
    assert _after(command, "-H") == "node01:4,node02:2"
    assert "--hostfile" not in command
    assert command[-3:] == PYTHON


def test_plan_in_allocation_with_mpich_passes_the_hosts(plan):
    job = plan(PYTHON, _env(), mpi=HYDRA)
    command = build_command(job.mpi, job.spec)
    assert command[:3] == ["/opt/mpich/bin/mpirun", "-n", "8"]
    assert _after(command, "-hosts") == "node01:4,node02:4"


def test_plan_in_allocation_np_defaults_to_slots_without_ntasks(plan):
    job = plan(PYTHON, _env(SLURM_NTASKS=None, SLURM_TASKS_PER_NODE="3(x2)"))
    assert job.num_proc == 6


def test_plan_in_allocation_explicit_np(plan):
    assert plan(["-np", "3", *PYTHON], _env()).num_proc == 3
    with pytest.raises(LaunchError, match=r"-np 9 needs more slots than the 8 of the SLURM allocation"):
        plan(["-np", "9", *PYTHON], _env())
    job = plan(["-np", "9", "--oversubscribe", *PYTHON], _env())
    assert job.num_proc == 9 and "--oversubscribe" in build_command(job.mpi, job.spec)


def test_plan_explicit_hosts_win_over_slurm(plan, tmp_path):
    broken = _env(SLURM_JOB_NODELIST="node[01-", SLURM_TASKS_PER_NODE="bad")  # never read
    job = plan(["-H", "localhost:2", *PYTHON], broken)
    assert job.num_proc == 2 and job.spec.hosts == [Host("localhost", 2)] and job.hosts_origin is None
    assert job.coordinator_bind == "0.0.0.0"  # (coordinator_address is faked in these tests)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=3\n")
    job = plan(["--hostfile", str(hostfile), *PYTHON], broken)
    assert job.num_proc == 3 and job.spec.hosts == [Host("localhost", 3)]


def test_plan_reports_bad_slurm_variables(plan):
    with pytest.raises(LaunchError, match=r"SLURM_JOB_NODELIST='node\[01-'.*'\[' without a matching '\]'"):
        plan(PYTHON, _env(SLURM_JOB_NODELIST="node[01-"))


def test_plan_outside_slurm_still_requires_np(plan):
    with pytest.raises(LaunchError, match="-np N is required"):
        plan(PYTHON, {"PATH": "/bin", "SLURM_JOB_ID": "42"})  # a job id alone is no allocation


# ---------------------------------------------------------------- a real job

@pytest.mark.timeout(120)
def test_ringrun_in_a_fake_allocation_of_this_host():
    """ringrun with SLURM's variables describing this host alone, and no -np or -H: the hosts
    and the 2 ranks come from SLURM. mpirun sees the same variables; with SLURM's older names
    (SLURM_JOBID, SLURM_NODELIST), which a real allocation also sets, Open MPI reads the
    allocation itself too (and finds no srun here, which a one-host job does not need)."""
    here = socket.gethostname()
    env = {name: value for name, value in job_environment().items() if not name.startswith("SLURM_")}
    env.update({"SLURM_JOB_ID": "1", "SLURM_JOBID": "1", "SLURM_JOB_NODELIST": here, "SLURM_NODELIST": here,
                "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS": "2", "SLURM_NNODES": "1"})
    script = "import os; print('rank', os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK')))"
    result = run_command([sys.executable, "-m", "ringmaster.launch", "--verbose", sys.executable, "-c", script],
                         timeout=100, env=env)
    assert result.returncode == 0, result.output
    assert sorted(result.lines_starting("rank")) == ["0", "1"], result.output
    assert f"hosts {here}:2 from SLURM job 1" in result.stderr, result.stderr


# ---------------------------------------------------------------- inside an srun step

def test_inside_a_one_task_step_the_step_is_used_and_ringrun_says_so():
    # `srun -n 1 ringrun ...` in a 2-node job: srun rewrote SLURM_NTASKS/SLURM_TASKS_PER_NODE to the step's
    allocation = slurm_allocation(_env(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_ID="3", SLURM_NTASKS="1",
                                       SLURM_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="node02",
                                       SLURM_STEP_TASKS_PER_NODE="1"))
    assert allocation.hosts() == [Host("node02", 1)]
    assert allocation.step == "42.3" and allocation.ntasks == 1
    note = allocation.step_note()
    for fragment in ("srun step 42.3", "SLURM_STEP_TASKS_PER_NODE=1", "not job 42's whole allocation",
                     "node02:1", "straight from the batch script", "-np and -H"):
        assert fragment in note, note
    assert "SLURM step 42.3 (not the whole job 42): SLURM_STEP_NODELIST" in allocation.describe()


def test_outside_a_step_there_is_no_note():
    assert slurm_allocation(_env()).step_note() is None


def test_ringrun_prints_the_step_note_before_the_job(tmp_path):
    env = job_environment(_env(PATH=None, SLURM_STEP_NUM_TASKS="1", SLURM_STEP_ID="0", SLURM_NTASKS="1",
                               SLURM_JOB_NODELIST=socket.gethostname(), SLURM_TASKS_PER_NODE="1"))
    result = run_command([sys.executable, "-m", "ringmaster.launch", sys.executable, "-c",
                          "import ringmaster as rm; rm.init(); print('size', rm.size())"], timeout=60, env=env)
    assert result.returncode == 0, result.output[-3000:]
    assert "size 1" in result.stdout
    assert "ringrun: running inside srun step 42.0" in result.stderr, result.stderr
