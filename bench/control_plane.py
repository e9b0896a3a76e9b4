"""The control plane at many ranks: the real coordinator and N simulated ranks, no MPI, no data.

    python bench/control_plane.py --ranks 64,256,1024
    python bench/control_plane.py --ranks 32 --steps 5 --json out.json     # what the test runs
    python bench/control_plane.py --ranks 64,256,1024 --plot docs/control_plane.png
    python bench/control_plane.py --ranks 1024 --ranks-per-host 8      # through host aggregators

The coordinator is started as ``ringrun`` starts it (``launch.coordinator_process``'s command
line and environment, a fresh job secret). The N ranks are gRPC clients, one channel and
one ``Negotiate`` stream each, spread over ``--processes`` worker processes of asyncio
(``grpc.aio``). Each rank registers, sends a heartbeat every ``--heartbeat-interval-s`` and,
step after step, waits a rank-specific skew (uniform in 0 .. ``--skew-ms``), declares the
same ``--tensors`` named float32 allreduces (in reverse order, in lists of ten, as a
backward pass hands them over) and waits until the responses name every one of them.
Measured, per N:

- **register**: from starting the worker processes to the last rank's welcome;
- **negotiation p50 / p99**: per step, from the last request any rank sent to the last
  response any rank received (all processes read the same monotonic clock);
- **fused**: responses per step (how many collectives the tensors were fused into);
- **coordinator CPU** (share of one core during the steps) and **RSS** (peak, VmHWM);
- **messages/s**: messages the ranks sent and received during the steps, per second;
- **stall**: one rank holds back its requests for 2.5 x the stall warning time; the
  coordinator's warning lines during it (one summary line is the target) and that step's time;
- **death**: one rank's stream is cut without a goodbye; the time until every other rank
  has received the abort;
- **same order**: every rank received the same response lists, in the same order, with
  the same fused names (a hash of them per rank).

Liveness is simulated as real hosts run it, with the default ``RINGMASTER_HOST_TIMEOUT_S``
(``--host-timeout-s``): the ranks are spread over hosts named ``simH`` (8 ranks each, or
``--ranks-per-host``), none of them the coordinator's, and every host's agent beats the
coordinator once a second (a ``Ping`` carrying the host's ranks' states, as
``ringmaster.coordinator.host_agent`` sends it), from the worker process that holds the host's
first rank; every stream to the coordinator (a rank's, a simulated or real aggregator's) pings
every second with the host timeout, as a stream from another host does
(``common/keepalive.py``). The beats sent and answered are in the results.

With ``--ranks-per-host K`` the ranks reach the coordinator through host aggregators
(``RINGMASTER_HOST_AGGREGATOR``), K ranks per host. The last ``--real-hosts`` hosts run the
real aggregator (``ringmaster.coordinator.aggregator``, in a worker process) with K simulated
ranks connected to it, as a real host would; they hold the late rank of the stall and the
rank whose death is timed. The other hosts are simulated at the aggregator's side of the
wire: one ``NegotiateHost`` stream each, registering K ranks and sending each list of
requests once, merged for all K, when the last of its ranks would have declared it (its
skew is the largest of K ranks' skews). On a real cluster every aggregator has its own
host; here the simulated ones send the coordinator what a real one sends for a host whose
ranks all declared alike, in ``--host-messages`` messages a step (a real aggregator sends as
many as its batching makes: the run reports how many the real one sent; with
``--host-messages real`` each simulated host sends, from the second step on, as many as the
real aggregator of its worker process has sent a step so far), without K simulated ranks each
taking CPU from it.

Prints a table; ``--json`` writes every figure, ``--plot`` a PNG of latency and memory
against N (matplotlib). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import random
import secrets
import statistics
import sys
import tempfile
import time

import grpc

from ringmaster.common import keepalive, proc
from ringmaster.common.config import Config
from ringmaster.common.message_size import grpc_options
from ringmaster.coordinator.aggregator import HostAggregator
from ringmaster.proto.auth import call_metadata
from ringmaster.coordinator.host_merge import HOLD_S
from ringmaster.launch.coordinator_process import CoordinatorProcess
from ringmaster.proto import ringmaster_pb2 as pb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simulated_agents import agents_of  # noqa: E402

NEGOTIATE = "/ringmaster.Coordinator/Negotiate"
NEGOTIATE_HOST = "/ringmaster.Coordinator/NegotiateHost"
MESSAGE_BYTES = 16 << 20
LIST_SIZE = 10  # requests per message, as a backward pass hands gradients over in bursts
#: Ranks per simulated host when they reach the coordinator directly.
RANKS_PER_HOST = 8


def remote_options(options) -> list:
    """A stream's keepalive as from another host: the watch on the coordinator (keepalive.py)."""
    return keepalive.stream_options("remote.invalid:1", options["host_timeout_s"])


def progress(text: str) -> None:
    print(f"[control-plane] {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ a simulated rank
def step_requests(names):
    """The request lists a rank sends in a step: every tensor, last first, in lists of ten."""
    order = names[::-1]
    return [[pb.TensorRequest(name=name, op_type=pb.ALLREDUCE, reduce_op=pb.AVERAGE, dtype="float32",
                              shape=[256, 256], device="cpu", prescale_factor=1.0, postscale_factor=1.0)
             for name in order[start:start + LIST_SIZE]] for start in range(0, len(order), LIST_SIZE)]


class SimulatedRank:
    """One rank: a channel, a ``Negotiate`` stream, a heartbeat task and the steps' timings."""

    def __init__(self, rank: int, size: int, address: str, secret: str, tensors: int, keepalive_options=(),
                 hostname: str = ""):
        self.rank, self.size, self.tensors = rank, size, tensors
        self.hostname = hostname or f"sim{rank // RANKS_PER_HOST}"
        self.channel = grpc.aio.insecure_channel(address, options=list(keepalive_options) + grpc_options(MESSAGE_BYTES))
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.call = self.channel.stream_stream(NEGOTIATE, request_serializer=None,
                                               response_deserializer=pb.CoordinatorMessage.FromString)(
            self._requests(), metadata=call_metadata(secret))
        self.names = [f"grad.{index}" for index in range(tensors)]
        self.sent = self.received = 0
        self.welcomed_at = None
        self.aborted_at = None
        self.step_requests_at, self.step_done_at, self.step_responses = [], [], []
        self.order = hashlib.sha256()  # every response list received, in order: the same on every rank

    async def _requests(self):
        while True:
            message = await self.outgoing.get()
            if message is None:
                return
            self.sent += 1
            yield message.SerializeToString()

    def send(self, message) -> None:
        self.outgoing.put_nowait(message)

    async def register(self) -> None:
        self.send(pb.RankMessage(register=pb.Register(rank=self.rank, size=self.size, hostname=self.hostname,
                                                      pid=100000 + self.rank)))
        message = await self.call.read()
        self.received += 1
        assert message.WhichOneof("kind") == "welcome", message
        self.welcomed_at = time.monotonic()

    async def heartbeats(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.send(pb.RankMessage(heartbeat=pb.Heartbeat()))

    async def read_message(self):
        message = await self.call.read()
        if message is not grpc.aio.EOF:
            self.received += 1
        return message

    async def step(self, skew_s: float) -> None:
        """Declare every tensor after ``skew_s``; return once responses named them all."""
        await asyncio.sleep(skew_s)
        for requests in step_requests(self.names):
            self.send(pb.RankMessage(requests=pb.RequestList(requests=requests)))
            await asyncio.sleep(0)
        self.step_requests_at.append(time.monotonic())
        await self._read_step()

    async def _read_step(self) -> None:
        missing, responses = set(self.names), 0
        while missing:
            message = await self.read_message()
            kind = message.WhichOneof("kind")
            if kind == "abort":
                raise RuntimeError(f"rank {self.rank}: the job was aborted: {message.abort.reason}")
            self.order.update(f"{message.responses.sequence}:".encode())
            for response in message.responses.responses:
                self.order.update(("|".join(response.names) + ";").encode())
                if response.error_kind != pb.NO_ERROR:
                    raise RuntimeError(f"rank {self.rank}: {response.error_message}")
                missing.difference_update(response.names)
                responses += 1
        self.step_done_at.append(time.monotonic())
        self.step_responses.append(responses)

    async def await_abort(self) -> None:
        while True:
            message = await self.read_message()
            if message is grpc.aio.EOF:
                return
            if message.WhichOneof("kind") == "abort":
                self.aborted_at = time.monotonic()
                return

    async def cut(self) -> float:
        """End the stream without a goodbye (a rank that died); returns when."""
        cut_at = time.monotonic()
        self.call.cancel()
        await self.channel.close(grace=None)
        return cut_at


class SimulatedHost(SimulatedRank):
    """A host aggregator's side of the wire for ``per_host`` ranks: one ``NegotiateHost``
    stream, each request list sent once for all its ranks (as the real aggregator does when
    every rank of its host declared alike)."""

    def __init__(self, first_rank: int, per_host: int, size: int, address: str, secret: str, tensors: int,
                 messages: int = 2, keepalive_options=()):
        self.rank, self.size, self.tensors, self.per_host = first_rank, size, tensors, per_host
        self.messages = messages
        self.channel = grpc.aio.insecure_channel(address, options=list(keepalive_options) + grpc_options(MESSAGE_BYTES))
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.call = self.channel.stream_stream(NEGOTIATE_HOST, request_serializer=None,
                                               response_deserializer=pb.HostDownstream.FromString)(
            self._requests(), metadata=call_metadata(secret))
        self.names = [f"grad.{index}" for index in range(tensors)]
        self.streams = list(range(per_host))
        self.delivered = []  # messages of the last HostDownstream not yet read
        self.cycle_s = 0.001  # RINGMASTER_CYCLE_TIME's default: the real aggregator's least time between sends
        self.sent = self.received = 0
        self.welcomed_at = self.aborted_at = None
        self.step_requests_at, self.step_done_at, self.step_responses = [], [], []
        self.order = hashlib.sha256()

    def send_hosted(self, *hosted) -> None:
        self.send(pb.HostUpstream(messages=hosted))

    async def read_message(self):
        while not self.delivered:
            downstream = await self.call.read()
            if downstream is grpc.aio.EOF:
                return downstream
            self.received += 1
            self.delivered.extend(delivery.message for delivery in downstream.deliveries if delivery.message)
        return pb.CoordinatorMessage.FromString(self.delivered.pop(0))

    async def register(self) -> None:
        self.send_hosted(*(pb.HostedMessage(streams=[stream], message=pb.RankMessage(register=pb.Register(
            rank=self.rank + stream, size=self.size, hostname=f"sim{self.rank // self.per_host}",
            pid=100000 + self.rank + stream))) for stream in self.streams))
        message = await self.read_message()
        assert message.WhichOneof("kind") == "welcome", message
        self.welcomed_at = time.monotonic()

    async def heartbeats(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.send_hosted(*(pb.HostedMessage(streams=[stream], message=pb.RankMessage(heartbeat=pb.Heartbeat()))
                               for stream in self.streams))

    async def step(self, skew_s: float) -> None:
        """The step's lists merged, as ``messages`` messages one cycle apart: the real
        aggregator sends the first list at once and batches what follows within a cycle (how
        many it sent per step is in the results: ``aggregator_messages_per_step``)."""
        await asyncio.sleep(skew_s)
        lists = step_requests(self.names)
        groups = [lists[:1]] + _split(lists[1:], self.messages - 1) if self.messages > 1 else [lists]
        for index, group in enumerate(group for group in groups if group):
            if index:
                await asyncio.sleep(self.cycle_s)
            self.send_hosted(pb.HostedMessage(streams=self.streams, message=pb.RankMessage(
                requests=pb.RequestList(requests=[request for requests in group for request in requests]))))
        self.step_requests_at.append(time.monotonic())
        await self._read_step()


def _split(items, parts: int):
    """``items`` in ``parts`` consecutive runs of (nearly) equal length."""
    size, extra = divmod(len(items), max(parts, 1))
    runs, start = [], 0
    for index in range(max(parts, 1)):
        end = start + size + (index < extra)
        runs.append(items[start:end])
        start = end
    return runs


async def _worker_main(ranks, size, address, secret, options, pipe, hosts=()) -> None:
    """Runs ``ranks`` (direct streams) and ``hosts``: (first rank, ranks per host, real)."""
    tensors, aggregators, simulated = options["tensors"], [], []
    remote = remote_options(options)
    for first, per_host, real in hosts:
        if real:  # the real aggregator, with its ranks connected to it as on a real host
            aggregator = HostAggregator(address, secret, MESSAGE_BYTES, hold_s=options["hold_s"],
                                        host_timeout_s=options["host_timeout_s"], upstream_options=remote)
            await aggregator.start()
            aggregators.append(aggregator)
            local = keepalive.stream_options(aggregator.address, options["host_timeout_s"])
            simulated += [SimulatedRank(rank, size, aggregator.address, secret, tensors, local,
                                        hostname=f"sim{first // per_host}")
                          for rank in range(first, first + per_host)]
    follow = options["host_messages"] == 0  # "real": as this worker's real aggregator sends
    simulated += [SimulatedHost(first, per_host, size, address, secret, tensors, options["host_messages"] or 2, remote)
                  for first, per_host, real in hosts if not real]
    simulated += [SimulatedRank(rank, size, address, secret, tensors, remote) for rank in ranks]
    await asyncio.gather(*(rank.register() for rank in simulated))
    agents = agents_of(ranks, RANKS_PER_HOST, hosts, size, address, secret) if options["host_timeout_s"] > 0 else []
    beats = [asyncio.ensure_future(rank.heartbeats(options["heartbeat_interval_s"])) for rank in simulated]
    beats += [asyncio.ensure_future(agent.beats()) for agent in agents]
    pipe.send(("registered", max(rank.welcomed_at for rank in simulated)))
    generator = random.Random(simulated[0].rank)
    def skew(rank) -> float:  # a simulated host sends when the last of its ranks would have
        return max(generator.uniform(0, options["skew_ms"]) / 1e3 for _ in range(getattr(rank, "per_host", 1)))

    writes_before = [aggregator.upstream_writes for aggregator in aggregators]
    for step in range(options["steps"]):
        await asyncio.gather(*(rank.step(skew(rank)) for rank in simulated))
        if follow and aggregators:  # the real aggregators' messages a step so far, rounded
            sent = sum(a.upstream_writes - before for a, before in zip(aggregators, writes_before))
            for host in simulated:
                if isinstance(host, SimulatedHost):
                    host.messages = max(1, min(LIST_SIZE, round(sent / len(aggregators) / (step + 1))))
    writes = [(aggregator.upstream_writes - before) / options["steps"]
              for aggregator, before in zip(aggregators, writes_before)]
    pipe.send(("steps", [(rank.rank, rank.step_requests_at, rank.step_done_at, rank.step_responses, rank.sent,
                          rank.received, rank.order.hexdigest(), getattr(rank, "per_host", 1)) for rank in simulated],
               writes, [(agent.sent, agent.answered) for agent in agents],
               [host.messages for host in simulated if isinstance(host, SimulatedHost)]))
    # the stall: the last rank of the job holds back its requests
    stall_s = options["stall_s"]
    await asyncio.gather(*(rank.step(stall_s if rank.rank == size - 1 else 0.0) for rank in simulated))
    pipe.send(("stalled", None))
    # the death: the parent names the worker whose first rank is cut
    command = pipe.recv()
    watching = simulated[1:] if command == "cut" else simulated
    cut_at = await simulated[0].cut() if command == "cut" else None
    watchers = [asyncio.ensure_future(rank.await_abort()) for rank in watching]
    if watchers:
        await asyncio.wait(watchers, timeout=60)
    for beat in beats:
        beat.cancel()
    pipe.send(("death", cut_at, [rank.aborted_at for rank in watching]))
    for rank in simulated:
        rank.send(None)
        await rank.channel.close(grace=None)
    for agent in agents:
        await agent.channel.close(grace=None)
    for aggregator in aggregators:
        await aggregator.stop()


def _worker(ranks, size, address, secret, options, pipe, hosts=()) -> None:
    try:
        asyncio.run(_worker_main(ranks, size, address, secret, options, pipe, hosts))
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which stops the run
        pipe.send(("error", f"{type(error).__name__}: {error}"))


# ------------------------------------------------------------------ the coordinator
class Coordinator:
    """The coordinator daemon with ringrun's command line and environment; stderr kept in a file."""

    def __init__(self, size: int, options: dict, directory: str):
        self.secret = secrets.token_hex(32)
        env = {key: value for key, value in os.environ.items() if not key.startswith("RINGMASTER_")}
        env.update({"RINGMASTER_SECRET": self.secret,
                    "RINGMASTER_HEARTBEAT_INTERVAL_S": str(options["heartbeat_interval_s"]),
                    "RINGMASTER_STALL_WARNING_S": str(options["stall_warning_s"]),
                    "RINGMASTER_HOST_TIMEOUT_S": str(options["host_timeout_s"]),
                    "RINGMASTER_START_TIMEOUT": "120"})
        self.log_path = os.path.join(directory, "coordinator.log")
        self._log = open(self.log_path, "w")
        self.daemon = CoordinatorProcess(size=size, bind="127.0.0.1", advertise="127.0.0.1", env=env,
                                         address_file=os.path.join(directory, "address"), start_timeout=60,
                                         stderr=self._log)
        self.address = self.daemon.start()
        self.process = self.daemon.process

    def cpu_s(self) -> float:
        found = proc.stat(self.process.pid)
        return (found.utime + found.stime) / os.sysconf("SC_CLK_TCK")

    def memory_mb(self, field: str = "VmHWM") -> float:
        with open(f"/proc/{self.process.pid}/status") as handle:
            return int(handle.read().split(f"{field}:")[1].split()[0]) / 1024

    def log_lines(self):
        with open(self.log_path, errors="replace") as handle:
            return handle.read().splitlines()

    def stop(self) -> None:
        self.daemon.stop()
        self._log.close()


# ------------------------------------------------------------------ one N
def assign(size: int, options: dict):
    """Per worker process: (its direct ranks, its hosts as (first rank, ranks, real)). The last
    process holds the last host, a real one, whose first rank is the one cut for the death."""
    workers = min(options["processes"], size)
    per_host = options["ranks_per_host"]
    if per_host <= 1:
        return [(list(range(index, size, workers)), []) for index in range(workers)]
    if size % per_host:
        raise SystemExit(f"--ranks-per-host {per_host} does not divide {size} ranks")
    count = size // per_host
    real = min(max(options["real_hosts"], 1), count)
    hosts = [(host * per_host, per_host, host >= count - real) for host in range(count)]
    workers = min(workers, count)
    assignments = [([], hosts[index:count:workers][::-1]) for index in range(workers)]
    last = hosts[-1]
    for _, held in assignments:
        if last in held:
            held.remove(last)
    assignments[-1][1].insert(0, last)
    return assignments


def measure(size: int, options: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="ringmaster-control-plane-") as directory:
        coordinator = Coordinator(size, options, directory)
        context = multiprocessing.get_context("spawn")
        processes, pipes = [], []
        assignments = assign(size, options)
        try:
            started = time.monotonic()
            for ranks, hosts in assignments:
                parent, child = context.Pipe()
                process = context.Process(target=_worker, args=(ranks, size, coordinator.address, coordinator.secret,
                                                                options, child, hosts), daemon=True)
                process.start()
                processes.append(process)
                pipes.append(parent)
            registered = max(_expect(pipe, "registered")[1] for pipe in pipes) - started
            progress(f"{size} ranks registered in {registered:.2f} s")
            cpu_before, wall_before = coordinator.cpu_s(), time.monotonic()
            reports = [_expect(pipe, "steps", timeout=600) for pipe in pipes]
            records = [record for report in reports for record in report[1]]
            writes = [per_step for report in reports for per_step in report[2]]
            beats = [beat for report in reports for beat in report[3]]
            simulated_messages = [count for report in reports for count in report[4]]
            cpu, wall = coordinator.cpu_s() - cpu_before, time.monotonic() - wall_before
            lines_before = len(coordinator.log_lines())
            stall_started = time.monotonic()
            for pipe in pipes:
                _expect(pipe, "stalled", timeout=600)
            stall_step = time.monotonic() - stall_started
            warnings = [line for line in coordinator.log_lines()[lines_before:] if "WARNING" in line or "stall" in line]
            # Before the death: the coordinator aborts the job then, and an exited process has no memory figures.
            rss = coordinator.memory_mb()
            pipes[-1].send("cut")
            for pipe in pipes[:-1]:
                pipe.send("watch")
            deaths = [_expect(pipe, "death", timeout=120) for pipe in pipes]
            cut_at = deaths[-1][1]
            aborted = [when for _, _, whens in deaths for when in whens]
            death_s = (max(aborted) - cut_at) if aborted and None not in aborted else float("nan")
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
            coordinator.stop()
    steps = options["steps"]
    latencies = []
    for step in range(steps):
        last_request = max(requests[step] for _, requests, *_ in records)
        last_response = max(done[step] for _, _, done, *_ in records)
        latencies.append(last_response - last_request)
    fused = statistics.median(next(responses for rank, _, _, responses, *_ in records if rank == 0))
    messages = sum(sent + received for *_, sent, received, _, _ in records)
    ordered = sorted(latencies)
    return {
        "ranks": size, "tensors": options["tensors"], "steps": steps,
        "ranks_per_host": options["ranks_per_host"], "host_messages": options["host_messages"],
        "real_hosts": min(options["real_hosts"], size // options["ranks_per_host"])
        if options["ranks_per_host"] > 1 else 0,
        "register_s": registered,
        "negotiation_p50_ms": 1e3 * statistics.median(latencies),
        "negotiation_p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "fused_responses_per_step": fused,
        "coordinator_cpu_share": cpu / wall,
        "coordinator_rss_mb": rss,
        "messages_per_s": messages / wall,
        "stall_step_s": stall_step, "stall_warning_lines": len(warnings), "stall_warnings": warnings[:5],
        "death_to_every_rank_s": death_s,
        "same_order_on_every_rank": len({order for *_, order, _ in records}) == 1,
        "ranks_reporting": sum(ranks for *_, ranks in records),
        # messages each real host aggregator sent the coordinator per step (a simulated host sends one per list)
        "aggregator_messages_per_step": statistics.median(writes) if writes else None,
        "simulated_host_messages": statistics.median(simulated_messages) if simulated_messages else None,
        "host_timeout_s": options["host_timeout_s"], "agents": len(beats),
        "agent_beats_sent": sum(sent for sent, _ in beats), "agent_beats_answered": sum(done for _, done in beats),
    }


def _expect(pipe, kind: str, timeout: float = 300):
    if not pipe.poll(timeout):
        raise TimeoutError(f"no '{kind}' from a worker within {timeout:g} s")
    message = pipe.recv()
    if message[0] == "error":
        raise RuntimeError(f"a worker failed: {message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"expected '{kind}' from a worker, got {message[0]!r}")
    return message


# ------------------------------------------------------------------ output
def print_table(rows) -> None:
    header = (f"{'ranks':>6} {'register s':>10} {'p50 ms':>8} {'p99 ms':>8} {'fused':>6} {'coord CPU':>9} "
              f"{'RSS MB':>7} {'msgs/s':>8} {'stall warnings':>14} {'death s':>8} {'same order':>10}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['ranks']:>6} {row['register_s']:>10.2f} {row['negotiation_p50_ms']:>8.1f} "
              f"{row['negotiation_p99_ms']:>8.1f} {row['fused_responses_per_step']:>6.0f} "
              f"{row['coordinator_cpu_share']:>9.2f} {row['coordinator_rss_mb']:>7.0f} {row['messages_per_s']:>8.0f} "
              f"{row['stall_warning_lines']:>14} {row['death_to_every_rank_s']:>8.2f} "
              f"{'yes' if row['same_order_on_every_rank'] else 'NO':>10}")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [row["ranks"] for row in rows]
    figure, (latency, memory) = plt.subplots(1, 2, figsize=(10, 4))
    latency.plot(ranks, [row["negotiation_p50_ms"] for row in rows], "o-", label="p50")
    latency.plot(ranks, [row["negotiation_p99_ms"] for row in rows], "s--", label="p99")
    latency.axhline(50, color="grey", linewidth=0.8, linestyle=":", label="p50 target (1,024 ranks)")
    latency.set(xscale="log", yscale="log", xlabel="simulated ranks", ylabel="ms",
                title=f"negotiation of {rows[0]['tensors']} tensors per step")
    latency.legend()
    memory.plot(ranks, [row["coordinator_rss_mb"] for row in rows], "o-")
    memory.set(xscale="log", xlabel="simulated ranks", ylabel="MB", title="coordinator peak RSS")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="64,256,1024", help="comma-separated numbers of simulated ranks")
    parser.add_argument("--steps", type=int, default=20, help="steps per N")
    parser.add_argument("--tensors", type=int, default=100, help="tensors declared per rank and step")
    parser.add_argument("--skew-ms", type=float, default=20.0, help="largest per-rank delay before a step's requests")
    parser.add_argument("--processes", type=int, default=4, help="worker processes holding the simulated ranks")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="reach the coordinator through host aggregators of this many ranks (1: directly)")
    parser.add_argument("--real-hosts", type=int, default=1,
                        help="with --ranks-per-host: how many hosts run the real aggregator with simulated ranks")
    parser.add_argument("--host-messages", default="2",
                        help="messages a simulated host sends per step: its lists merged, one cycle apart "
                             "(default %(default)s: the first list, then the rest; 10: one per list; 'real': as many "
                             "as the real aggregator of its worker process sent a step so far, which needs "
                             "--real-hosts of at least --processes)")
    parser.add_argument("--hold-ms", type=float, default=1e3 * HOLD_S,
                        help="the aggregators' hold time (default %(default)g)")
    parser.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    parser.add_argument("--stall-warning-s", type=float, default=2.0)
    parser.add_argument("--host-timeout-s", type=float, default=Config.host_timeout_s,
                        help="RINGMASTER_HOST_TIMEOUT_S of the job (default %(default)g, ringmaster's; 0: no agents, "
                             "no liveness pings)")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    parser.add_argument("--plot", metavar="PATH", help="save a PNG of latency and memory against N (matplotlib)")
    args = parser.parse_args(argv)
    options = {"tensors": args.tensors, "steps": args.steps, "skew_ms": args.skew_ms, "processes": args.processes,
               "heartbeat_interval_s": args.heartbeat_interval_s, "stall_warning_s": args.stall_warning_s,
               "stall_s": 2.5 * args.stall_warning_s, "ranks_per_host": args.ranks_per_host,
               "real_hosts": args.real_hosts, "hold_s": args.hold_ms / 1e3,
               "host_messages": 0 if args.host_messages == "real" else int(args.host_messages),
               "host_timeout_s": args.host_timeout_s}
    rows = []
    for size in (int(text) for text in args.ranks.split(",")):
        progress(f"{size} ranks, {args.steps} steps of {args.tensors} tensors")
        rows.append(measure(size, options))
    through = (f"through host aggregators of {args.ranks_per_host} ranks ({args.real_hosts} real; the simulated "
               f"ones send {args.host_messages} messages a step), "
               if args.ranks_per_host > 1 else "")
    print(f"# {through}{args.tensors} tensors per step, skew up to {args.skew_ms:g} ms, "
          f"{args.processes} worker processes, {os.cpu_count()} cores; stall: one rank {options['stall_s']:g} s late "
          f"(RINGMASTER_STALL_WARNING_S={args.stall_warning_s:g})")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
