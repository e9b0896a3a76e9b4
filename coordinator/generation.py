"""What the coordinator keeps for one generation of a job, built in one place.

A generation runs from the first registration until every rank has shut down (a
persistent daemon then waits for the job's next ``init()``) or until an elastic job re-forms
after losing a rank. Everything that belongs to one generation lives in a
:class:`Generation`, which :meth:`Generation.start` builds whole, so that what carries over
into the next generation is decided here and nowhere else:

- **nothing**, when every rank shut down cleanly: the next ``init()`` starts from the job's
  configuration, as the ranks do;
- **the autotuned fusion threshold and cycle time**, when an elastic job re-forms: the
  surviving ranks keep their runtime, and with it the rank-side half of the autotuner's
  choice (the ring/MPI crossover, the response cache switch), so the coordinator keeps its
  half.

The response sequence, the welcome, the stall trackers and any flush waiting for a cycle
start over in both cases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Dict, Optional

from ringmaster.common.config import Config
from ringmaster.coordinator.cache_stalls import CacheStalls
from ringmaster.coordinator.negotiation import Negotiator
from ringmaster.coordinator.plan_stalls import PlanStalls


@dataclasses.dataclass
class Generation:
    """The coordinator's state of one generation (see the module docstring).

    Attributes:
        negotiator: tensor readiness and fusion; holds the fusion threshold in force.
        plan_stalls: gradient plans that ranks wait in, from their heartbeats.
        cache_stalls: response-cache cycles that ranks wait in, from their heartbeats.
        cycle_time_ms: how long to wait for more ready tensors to fuse with (autotuning may change it).
        sequence: the number of the last response list sent.
        welcomed: every rank has registered and been welcomed.
        started: when the generation started (``time.monotonic``), for the start timeout.
        slow_cycle_warned: the last cache cycle warned about as slow (not stuck).
        flush_scheduled: a send of the ready responses waiting for the cycle time, if any.
        stall_warned: when stalls of each kind, set and missing ranks were last warned about
            (``stall_report.stall_key``), so that one late rank makes one warning.
    """

    negotiator: Negotiator
    plan_stalls: PlanStalls
    cache_stalls: CacheStalls
    cycle_time_ms: float
    sequence: int = 0
    welcomed: bool = False
    started: float = dataclasses.field(default_factory=time.monotonic)
    slow_cycle_warned: int = -1
    flush_scheduled: Optional[asyncio.TimerHandle] = None
    stall_warned: Dict[tuple, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def start(cls, size: int, config: Config, previous: Optional["Generation"] = None,
              keep_tuning: bool = False) -> "Generation":
        """A fresh generation of ``size`` ranks. ``previous`` (if any) stops waiting to flush;
        with ``keep_tuning`` its fusion threshold and cycle time carry over, otherwise the
        configuration's apply."""
        fusion_threshold_bytes, cycle_time_ms = config.fusion_threshold_bytes, config.cycle_time_ms
        if previous is not None:
            previous.cancel_flush()
            if keep_tuning:
                fusion_threshold_bytes = previous.negotiator.fusion_threshold_bytes
                cycle_time_ms = previous.cycle_time_ms
        # A rank waiting in a plan or a cache cycle is idle on its stream, so it sends a
        # heartbeat every interval: three missed ones make its report stale.
        stale_after_s = 3 * config.heartbeat_interval_s
        negotiator = Negotiator(size, fusion_threshold_bytes, max_pending_requests=config.max_pending_requests)
        return cls(negotiator=negotiator,
                   plan_stalls=PlanStalls(stale_after_s=stale_after_s),
                   cache_stalls=CacheStalls(stale_after_s=stale_after_s),
                   cycle_time_ms=cycle_time_ms)

    def cancel_flush(self) -> None:
        """Drop the send waiting for the cycle time, if any."""
        if self.flush_scheduled is not None:
            self.flush_scheduled.cancel()
            self.flush_scheduled = None
