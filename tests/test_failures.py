"""Failures end as clear errors on every rank and a non-zero exit, never as a hang."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from mpijob import job_environment, mpirun, ringrun

from ringmaster.common.config import Config
from ringmaster.coordinator.server import Coordinator


def run_timed(np, script, env=None, timeout=60, launcher=mpirun):
    start = time.monotonic()
    result = launcher(np, script, timeout=timeout, env=env)
    return result, time.monotonic() - start


@pytest.mark.timeout(90)
@pytest.mark.parametrize("launcher", [mpirun, ringrun], ids=["mpirun", "ringrun"])
@pytest.mark.parametrize("death", ["os._exit(1)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_dying_rank_ends_the_job_within_30s(death, launcher):
    result, seconds = run_timed(2, f"""
        import os, signal, time, torch, ringmaster as rm
        rm.init()
        rm.allreduce(torch.ones(4))
        if rm.rank() == 1:
            {death}
        time.sleep(0.5)
        rm.allreduce(torch.ones(4), name="after-death")
        print("UNREACHABLE")
    """, timeout=80, launcher=launcher)
    assert result.returncode != 0
    assert seconds < 30, f"took {seconds:.0f} s"
    assert "UNREACHABLE" not in result.stdout
    if launcher is ringrun:
        # Under plain mpirun, Open MPI kills the job and its output forwarding at once, so
        # only ringrun (whose coordinator writes to ringrun's own stderr) can promise this line.
        assert "rank 1 (host" in result.output and "lost its connection" in result.output, result.output[-3000:]
        assert "its process has exited" in result.output, result.output[-3000:]  # looked up, not guessed


@pytest.mark.timeout(90)
def test_a_stall_warning_names_the_missing_rank():
    """...and never sends SIGUSR1 to a late rank whose program owns it (a SLURM preemption handler)."""
    result, _ = run_timed(2, """
        import signal, time, torch, ringmaster as rm
        if int(__import__("os").environ.get("OMPI_COMM_WORLD_RANK", "0")) == 1:
            signal.signal(signal.SIGUSR1, lambda *_: print("PREEMPTED", flush=True))
        rm.init()
        if rm.rank() == 1:
            time.sleep(4)
        print("RESULT", rm.allreduce(torch.ones(2), name="late.tensor", op=rm.Sum).tolist(), flush=True)
    """, env={"RINGMASTER_STALL_WARNING_S": "1"}, timeout=80)
    assert result.returncode == 0, result.output
    assert "PREEMPTED" not in result.output, "the coordinator sent SIGUSR1 to a rank whose program owns it"
    assert "stall: tensor 'late.tensor'" in result.output
    assert "ranks [1]" in result.output and "have not submitted it" in result.output
    assert result.lines_starting("RESULT") == ["[2.0, 2.0]", "[2.0, 2.0]"]


@pytest.mark.timeout(90)
def test_a_stall_longer_than_the_shutdown_limit_aborts_the_job():
    result, seconds = run_timed(2, """
        import time, torch, ringmaster as rm
        rm.init()
        if rm.rank() == 1:
            time.sleep(60)
        try:
            rm.allreduce(torch.ones(2), name="never")
        except rm.StalledTensorError as error:
            print("STALLED", error, flush=True)
            raise
    """, env={"RINGMASTER_STALL_WARNING_S": "1", "RINGMASTER_STALL_SHUTDOWN_S": "3"}, timeout=80)
    assert result.returncode != 0
    assert seconds < 30
    assert "STALLED" in result.stdout and "'never'" in result.stdout and "ranks [1]" in result.stdout


@pytest.mark.timeout(90)
def test_a_rank_stalling_before_a_gradient_plan_step_is_named_and_the_job_aborts():
    """The plan's steps are not negotiated; the waiting rank's heartbeats name the late rank, which prints its
    stacks."""
    result, seconds = run_timed(2, """
        import time, torch, torch.nn as nn, ringmaster as rm
        rm.init()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 4))
        optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
        try:
            for step in range(6):
                if step == 4 and rm.rank() == 1:
                    time.sleep(60)
                optimizer.zero_grad()
                model(torch.randn(8, 64)).sum().backward()
                optimizer.step()
            print("PLAN", optimizer._plan is not None and optimizer._plan.runs_ahead(), flush=True)
        except rm.StalledTensorError as error:
            print("STALLED", optimizer._plan.runs_ahead(), error, flush=True)
            raise
    """, env={"RINGMASTER_STALL_WARNING_S": "1", "RINGMASTER_STALL_SHUTDOWN_S": "3"}, timeout=80)
    assert result.returncode != 0
    assert seconds < 30, f"took {seconds:.0f} s"
    assert "STALLED True" in result.stdout, result.output[-3000:]
    assert "DistributedOptimizer.plan." in result.stdout and "ranks [1]" in result.stdout, result.output[-3000:]
    # The rank the others waited for shows where it was: its main thread, in the script's sleep.
    assert "rank 1 is one the others waited for" in result.output, result.output[-3000:]
    assert "ringmaster: rank 0 is one" not in result.output
    stacks = result.output[result.output.index("rank 1 is one the others waited for"):]
    assert ("most recent call first" in stacks and 'File "<string>", line' in stacks
            and "in <module>" in stacks), stacks[:3000]


@pytest.mark.timeout(90)
def test_a_hung_rank_is_detected_by_missing_heartbeats():
    result, seconds = run_timed(2, """
        import os, signal, torch, ringmaster as rm
        rm.init()
        if rm.rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            rm.allreduce(torch.ones(2), name="waits")
        except rm.RankFailedError as error:
            print("FAILED", error, flush=True)
            raise
    """, env={"RINGMASTER_HEARTBEAT_TIMEOUT_S": "3", "RINGMASTER_HEARTBEAT_INTERVAL_S": "0.5"}, timeout=80)
    assert result.returncode != 0
    assert seconds < 30
    assert "FAILED" in result.stdout and "rank 1" in result.stdout and "heartbeat" in result.stdout
    assert "it is stopped (SIGSTOP" in result.stdout  # its process was looked up: frozen, not gone


@pytest.mark.timeout(90)
def test_a_live_rank_whose_threads_get_no_cpu_is_not_declared_dead(tmp_path):
    """A rank that sends no heartbeat while its process runs (here its gRPC threads are made to
    wait: the same as on a host whose scheduler does not run them) gets a warning, and the job
    goes on: "sent no heartbeat" ends a job only for a process that is stopped or gone."""
    result, _ = run_timed(2, """
        import time, torch, ringmaster as rm
        from ringmaster.worker.runtime.current import runtime
        rm.init()
        rm.allreduce(torch.ones(1), name="before")
        if rm.rank() == 1:
            outbox = runtime().outbox
            with outbox._condition:  # the sending thread cannot take a message for 5 s
                time.sleep(5)
        rm.allreduce(torch.ones(1), name="after")
        print("DONE", rm.rank(), flush=True)
        rm.shutdown()
    """, env={"RINGMASTER_HEARTBEAT_TIMEOUT_S": "2", "RINGMASTER_HEARTBEAT_INTERVAL_S": "0.5"}, timeout=80,
        launcher=ringrun)
    assert result.returncode == 0 and len(result.lines_starting("DONE")) == 2, result.output[-3000:]
    assert "but its process is running" in result.output, result.output[-3000:]


@pytest.mark.timeout(60)
def test_a_rank_with_the_wrong_token_is_refused():
    coordinator = Coordinator(1, "the-right-secret", Config(), "127.0.0.1", 0).start()
    try:
        result = mpirun(1, """
            import ringmaster as rm
            try:
                rm.init()
            except rm.CoordinatorUnreachableError as error:
                print("REFUSED", error, flush=True)
        """, env={"RINGMASTER_COORDINATOR_ADDR": coordinator.address, "RINGMASTER_SECRET": "a-wrong-secret"},
            timeout=50)
    finally:
        coordinator.stop(grace=0)
    assert "REFUSED" in result.stdout, result.output
    assert "refused this rank's token" in result.stdout
    assert "the-right-secret" not in result.output and "a-wrong-secret" not in result.output


@pytest.mark.timeout(60)
def test_collectives_before_init_raise_a_clear_error():
    result = mpirun(1, """
        import torch, ringmaster as rm
        try:
            rm.allreduce(torch.ones(1))
        except rm.NotInitializedError as error:
            print("ERROR", error)
    """, timeout=50)
    assert "ERROR ringmaster is not initialized: call ringmaster.init() first" in result.stdout


@pytest.mark.timeout(90)
def test_a_dead_coordinator_is_reported_on_every_rank():
    result, seconds = run_timed(2, """
        import time, torch, ringmaster as rm
        from ringmaster.worker.runtime.current import runtime
        from mpi4py import MPI
        rm.init()
        rm.allreduce(torch.ones(2))
        MPI.COMM_WORLD.Barrier()  # both ranks have their result before the coordinator goes
        if rm.rank() == 0:
            runtime().endpoint.process.kill()  # the coordinator rank 0 started under plain mpirun
        time.sleep(1)
        try:
            rm.allreduce(torch.ones(2), name="after")
        except rm.CoordinatorUnreachableError as error:
            print("LOST", rm.rank(), error, flush=True)
            raise
    """, timeout=80)
    assert result.returncode != 0, result.output[-3000:]
    assert seconds < 30, result.output[-3000:]
    lost = result.lines_starting("LOST")
    assert lost, result.output[-3000:]
    assert all("lost its connection to the ringmaster coordinator" in line for line in lost), result.output[-3000:]
    assert all("a fresh connection got no answer" in line for line in lost), result.output[-3000:]


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_early_fails_what_it_never_submitted():
    result, seconds = run_timed(2, """
        import time, torch, ringmaster as rm
        rm.init()
        rm.allreduce(torch.ones(1))
        if rm.rank() == 1:
            raise SystemExit(0)      # a clean exit, without join()
        time.sleep(1)
        try:
            rm.allreduce(torch.ones(1), name="orphan")
        except rm.RankFailedError as error:
            print("ORPHAN", error, flush=True)
    """, timeout=80, launcher=ringrun)
    assert seconds < 30, result.output[-3000:]
    [message] = result.lines_starting("ORPHAN")
    assert "rank 1 (host" in message and "shut down without submitting tensor 'orphan'" in message
    assert "join()" in message


@pytest.mark.timeout(90)
def test_sigusr1_to_ringrun_makes_every_rank_print_its_stacks_and_the_job_goes_on(tmp_path):
    script = textwrap.dedent("""
        import os, pathlib, sys, time, ringmaster as rm
        rm.init()

        def waiting_in_a_function_of_its_own():
            pathlib.Path(sys.argv[1], f"ready.{rm.rank()}").touch()
            for _ in range(80):
                time.sleep(0.1)

        waiting_in_a_function_of_its_own()
        rm.barrier()
        print("DONE", rm.rank(), flush=True)
    """)
    command = [sys.executable, "-m", "ringmaster.launch", "-np", "2", sys.executable, "-c", script, str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=job_environment(), start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while len(list(tmp_path.glob("ready.*"))) < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert len(list(tmp_path.glob("ready.*"))) == 2, "the ranks did not start"
        os.kill(process.pid, signal.SIGUSR1)
        stdout, stderr = process.communicate(timeout=40)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, stdout + stderr
    assert stdout.count("DONE") == 2, stdout + stderr
    assert stderr.count("in waiting_in_a_function_of_its_own") == 2, stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_rank_waiting_in_a_long_collective_keeps_sending_heartbeats():
    """"Sent no heartbeat" must mean frozen or gone: a rank whose training loop waits in a
    blocking mpi4py collective far longer than the heartbeat timeout is not declared dead."""
    result, _ = run_timed(2, """
        import time, torch, ringmaster as rm
        from mpi4py import MPI
        rm.init()
        rm.allreduce(torch.ones(1), name="before")
        if rm.rank() == 1:
            time.sleep(8)  # rank 0 waits in Barrier meanwhile: 8 s against a 3 s heartbeat timeout
        MPI.COMM_WORLD.Barrier()
        rm.allreduce(torch.ones(1), name="after")
        print("DONE", rm.rank(), flush=True)
        rm.shutdown()
    """, timeout=100, env={"RINGMASTER_HEARTBEAT_INTERVAL_S": "0.5", "RINGMASTER_HEARTBEAT_TIMEOUT_S": "3"})
    assert result.returncode == 0 and len(result.lines_starting("DONE")) == 2, result.output[-3000:]
    assert "sent no heartbeat" not in result.output


@pytest.mark.timeout(90)
def test_a_rank_whose_python_threads_never_run_again_ends_the_job_naming_the_gil():
    """Rank 1 waits in mpi4py's pickle-based allreduce, which holds the GIL, for a rank 0 that
    never joins it: rank 1's process runs, but none of its threads can send a heartbeat. It is
    given 5 heartbeat timeouts (a busy host may starve threads that long), then the job ends."""
    result, seconds = run_timed(2, """
        import torch, ringmaster as rm
        from mpi4py import MPI
        rm.init()
        rm.allreduce(torch.ones(1), name="before")
        if rm.rank() == 1:
            MPI.COMM_WORLD.allreduce(1)  # rank 0 never calls it
        rm.allreduce(torch.ones(1), name="after")  # rank 0 waits here until the job ends
    """, env={"RINGMASTER_HEARTBEAT_TIMEOUT_S": "1", "RINGMASTER_HEARTBEAT_INTERVAL_S": "0.25"}, timeout=80,
        launcher=ringrun)
    assert result.returncode != 0
    assert seconds < 40, f"took {seconds:.0f} s"
    assert "rank 1 (host" in result.output and "holds the GIL" in result.output, result.output[-3000:]
