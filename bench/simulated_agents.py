"""Host agents as bench/control_plane.py simulates them: each beats the coordinator once a
second with a ``Ping`` that carries its host's ranks' states, as
``ringmaster.coordinator.host_agent`` does, over a channel of its own."""

from __future__ import annotations

import asyncio
import time

import grpc

from ringmaster.proto.auth import call_metadata
from ringmaster.coordinator.host_liveness import BEAT_INTERVAL_S, METADATA_KEY, format_beat
from ringmaster.proto import ringmaster_pb2 as pb

PING = "/ringmaster.Coordinator/Ping"


class SimulatedAgent:
    """A host's agent: a channel of its own, and a ``Ping`` every beat interval carrying the
    host's ranks' states, as ``ringmaster.coordinator.host_agent`` sends it."""

    def __init__(self, host: str, ranks, address: str, secret: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.ping = self.channel.unary_unary(PING, request_serializer=pb.Empty.SerializeToString,
                                             response_deserializer=pb.Empty.FromString)
        self.metadata = call_metadata(secret) + (
            (METADATA_KEY, format_beat(host, 200000 + ranks[0], {rank: (100000 + rank, "S") for rank in ranks})),)
        self.sent = self.answered = 0

    async def beats(self) -> None:
        while True:
            started = time.monotonic()
            self.sent += 1
            try:
                await self.ping(pb.Empty(), metadata=self.metadata, timeout=2 * BEAT_INTERVAL_S)
                self.answered += 1
            except grpc.RpcError:
                pass
            await asyncio.sleep(max(0.0, BEAT_INTERVAL_S - (time.monotonic() - started)))


def agents_of(ranks, per_host: int, hosts, size: int, address: str, secret: str):
    """The agents of the hosts whose first rank a worker holds: of its direct ``ranks`` (hosts of
    ``per_host``), and of its ``hosts`` ((first rank, ranks, real) each)."""
    agents = [SimulatedAgent(f"sim{rank // per_host}", list(range(rank, min(rank + per_host, size))),
                             address, secret) for rank in ranks if rank % per_host == 0]
    agents += [SimulatedAgent(f"sim{first // per_host}", list(range(first, first + per_host)), address, secret)
               for first, per_host, _ in hosts]
    return agents
