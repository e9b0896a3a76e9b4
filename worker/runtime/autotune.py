"""Autotuning (``RINGMASTER_AUTOTUNE=1``): rank 0 tunes four knobs during the first steps; every rank follows.

The knobs: the fusion threshold and the cycle time (both used by the coordinator; the
cycle time also by each rank's outbox), the ring/MPI crossover of ``allreduce`` "auto"
(``ops.choose_algorithm``'s table, scaled) and whether the response cache is used.

**Who decides.** Rank 0's background thread measures; it alone runs the search
(:class:`~ringmaster.worker.runtime.autotune_search.CoordinateSearch`). A *sample* starts
where a setting takes effect and ends at the end of the first response list after which
one tensor name has been reduced ``RINGMASTER_AUTOTUNE_STEPS_PER_SAMPLE`` times in it
(about that many training steps, as Horovod's autotuner counts them), or after
:data:`FALLBACK_RESPONSES_PER_STEP` × that many responses when names never repeat. Its
score is the bytes allreduced (and reduce-scattered) in it, as the responses say, over its
wall time on rank 0: bytes reduced per second, which for a training loop is proportional to
its throughput. The first ``RINGMASTER_AUTOTUNE_WARMUP_SAMPLES`` samples are discarded.

**How a choice reaches every rank at the same place in the order (invariant 1).** Rank 0
sends its next setting to the coordinator as a ``Tuning`` message. The coordinator sends
what is ready (fused under the old threshold), switches its fusion threshold and cycle
time, and puts the setting, as an ``AUTOTUNE`` response, in a response list of its own.
Every rank runs that list at the same place in the one order, and there sets its
crossover, its outbox's cycle time and (through the runtime's ``set_cache_enabled``, when
there is one) its response cache. Responses before it ran with the old settings on every
rank, those after it with the new: the same collectives, split and fused the same way, with
the same algorithm. Rank 0 starts the new sample at that response too, so what it measures
is exactly what ran under the setting; between sending and that response it measures
nothing. The last setting is sent with ``final`` set; after it nothing is measured or sent.

The gradient plan of ``DistributedOptimizer`` (after its second step) reduces over its own
communicator without response lists: its buckets are fixed at 4 MiB and use the table's
crossover, so tuning neither sees nor changes them. What it tunes is everything that is
still negotiated (``RINGMASTER_GRADIENT_PLAN=0`` training, custom loops, model-parallel
layers, metrics).

**The log** (``RINGMASTER_AUTOTUNE_LOG``, written by rank 0, one row per sample as it
ends, then the choice): ``trial, phase, fusion_threshold_bytes, cycle_time_ms,
ring_min_bytes, cache_enabled, bytes, seconds, score_bytes_per_s``. ``phase`` is
``warmup``, ``baseline``, the knob being searched, ``confirm``, or ``final`` for the last
row (its score is the chosen setting's median).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

from ringmaster import ops
from ringmaster.common.config import Config
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.proto.operations import ops_where, response_bytes
from ringmaster.worker.runtime.autotune_search import CoordinateSearch, Dimension, Setting
from ringmaster.worker.runtime import timeline

log = logging.getLogger("ringmaster.worker")

KIB = 1024
MIB = 1024 * KIB

#: The values searched (the configured value is always added and is the default). Fusion:
#: from one small bucket to the default 64 MiB and above. Cycle: 0 sends every request at
#: once, 5 ms waits for a whole backward pass to fuse. Crossover: the smallest allreduce the
#: ring runs, for float32-like data (the table's other rows scale with it; ops/allreduce.py
#: measured 1 MiB as the tie point in isolation, the ring far ahead in training).
FUSION_VALUES = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB)
CYCLE_VALUES_MS = (0.0, 0.5, 1.0, 2.5, 5.0)
RING_MIN_VALUES = (256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)

#: Without a repeating name, a sample ends after this many responses per step.
FALLBACK_RESPONSES_PER_STEP = 64

CSV_COLUMNS = ("trial", "phase", "fusion_threshold_bytes", "cycle_time_ms", "ring_min_bytes", "cache_enabled",
               "bytes", "seconds", "score_bytes_per_s")


def search_space(config: Config, size: int, cache_toggle: bool) -> List[Dimension]:
    """The knobs to tune for this job: fusion, cycle time, crossover (only with ``auto``), cache (if it can be
    toggled)."""
    def with_default(values, default):
        return tuple(sorted(set(values) | {default}))

    table = ops.ring_min_bytes(size, "float32", "sum")
    dimensions = [
        Dimension("fusion_threshold_bytes", with_default(FUSION_VALUES, config.fusion_threshold_bytes),
                  config.fusion_threshold_bytes),
        Dimension("cycle_time_ms", with_default(CYCLE_VALUES_MS, float(config.cycle_time_ms)),
                  float(config.cycle_time_ms)),
        Dimension("ring_min_bytes", with_default(RING_MIN_VALUES, table) if config.allreduce_algorithm == "auto"
                  and size > 1 else (table,), table),
        Dimension("cache_enabled", (False, True) if cache_toggle else (True,), True),
    ]
    return dimensions


def tuning_message(trial: int, setting: Setting, final: bool = False) -> pb.Tuning:
    """``setting`` as the protocol's ``Tuning``."""
    return pb.Tuning(trial=trial, fusion_threshold_bytes=int(setting["fusion_threshold_bytes"]),
                     cycle_time_ms=float(setting["cycle_time_ms"]), ring_min_bytes=int(setting["ring_min_bytes"]),
                     cache_enabled=bool(setting["cache_enabled"]), final=final)


def setting_of(tuning: pb.Tuning) -> Setting:
    """The setting a ``Tuning`` carries."""
    return {"fusion_threshold_bytes": int(tuning.fusion_threshold_bytes),
            "cycle_time_ms": float(tuning.cycle_time_ms), "ring_min_bytes": int(tuning.ring_min_bytes),
            "cache_enabled": bool(tuning.cache_enabled)}


def reduced_bytes(response: pb.Response) -> int:
    """Bytes an allreduce or reducescatter response reduces (0 for anything else)."""
    if response.error_kind != pb.NO_ERROR or response.op_type not in _REDUCTIONS:
        return 0
    return response_bytes(response)


_REDUCTIONS = ops_where(lambda spec: spec.reduces)
#: Responses that are control, not a step's work.
_CONTROL_OPS = ops_where(lambda spec: spec.control)


def _is_lateness_probe(response: pb.Response) -> bool:
    """A straggler report's probe (frontend/lateness_probes.py): a barrier under a new name each
    time, answered without MPI. It is no step of training: counted, it would end samples that
    reduced nothing."""
    return bool(response.names) and all(name.startswith(timeline.UNRECORDED_PREFIX) for name in response.names)


@dataclasses.dataclass
class Applied:
    """One AUTOTUNE response as this rank ran it: where in the order, and what it set."""

    sequence: int       # the response list's number
    trial: int
    setting: Setting
    final: bool


class Autotuner:
    """One per rank with ``RINGMASTER_AUTOTUNE=1``; runs on the background thread only.

    Args:
        rank, size: this rank and the job's size.
        config: the job's settings (defaults of the search, warmup, steps per sample, log path).
        send: sends a ``RankMessage`` to the coordinator (rank 0 only uses it).
        set_cycle_time: this rank's outbox cycle time, in seconds.
        set_cache_enabled: turns the response cache on or off; None when the runtime has none
            (then the cache is not part of the search).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, rank: int, size: int, config: Config, send: Callable[[pb.RankMessage], None],
                 set_cycle_time: Callable[[float], None],
                 set_cache_enabled: Optional[Callable[[bool], None]] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.rank = rank
        self._send = send
        self._set_cycle_time = set_cycle_time
        self._set_cache_enabled = set_cache_enabled
        self._clock = clock
        self._table_ring_min = ops.ring_min_bytes(size, "float32", "sum")
        self.ring_scale = 1.0                       # read by the executor for allreduce "auto"
        self.applied: List[Applied] = []            # every AUTOTUNE response this rank ran
        self.active = True                          # False once the final setting is applied
        self._warmup_left = config.autotune_warmup_samples
        self._steps_per_sample = config.autotune_steps_per_sample
        self.search = CoordinateSearch(search_space(config, size, set_cache_enabled is not None))
        self._trial = 0
        self._current: Setting = dict(self.search.defaults)
        self._measuring = rank == 0                  # rank 0: a sample is open
        self._observing = threading.Lock()
        self._log_path = config.autotune_log if rank == 0 else None
        self._log_rows = 0
        self._start_sample()

    # ----------------------------------------------------------- every rank
    def apply(self, tuning: pb.Tuning, sequence: int) -> None:
        """An AUTOTUNE response came up in the order: use its setting from here on."""
        setting = setting_of(tuning)
        self.ring_scale = setting["ring_min_bytes"] / self._table_ring_min if setting["ring_min_bytes"] else 1.0
        self._set_cycle_time(setting["cycle_time_ms"] / 1000.0)
        if self._set_cache_enabled is not None:
            self._set_cache_enabled(setting["cache_enabled"])
        self.applied.append(Applied(sequence, tuning.trial, setting, tuning.final))
        # Under observe()'s lock: a cached collective counted on another thread must see either
        # no open sample or the new one, never the new flag with the last sample's counts.
        with self._observing:
            self._current = setting
            if tuning.final:
                self.active = False
                self._measuring = False
                if self.rank == 0:
                    log.info("autotune: chose %s", setting)
            elif self.rank == 0 and tuning.trial == self._trial + 1:  # the setting rank 0 asked for last
                self._start_sample()
                self._measuring = True

    # ------------------------------------------------------------- rank 0
    def observe(self, response_list: pb.ResponseList) -> None:
        """Rank 0, after running a response list: count it into the open sample, maybe end it.

        Called by the background thread and by whichever thread runs the response cache's
        collectives, hence the lock.
        """
        if not self._measuring:
            return
        with self._observing:
            self._observe(response_list)

    def _observe(self, response_list) -> None:
        if not self._measuring:
            return
        for response in response_list.responses:
            if response.op_type in _CONTROL_OPS or _is_lateness_probe(response):
                continue
            self._bytes += reduced_bytes(response)
            self._responses += 1
            for name in response.names:
                count = self._name_counts.get(name, 0) + 1
                self._name_counts[name] = count
                if count > self._most_repeats:
                    self._most_repeats = count
        if (self._most_repeats >= self._steps_per_sample
                or self._responses >= FALLBACK_RESPONSES_PER_STEP * self._steps_per_sample):
            self._end_sample()

    def _start_sample(self) -> None:
        self._started = self._clock()
        self._bytes = 0
        self._responses = 0
        self._name_counts: Dict[str, int] = {}
        self._most_repeats = 0

    def _end_sample(self) -> None:
        seconds = max(self._clock() - self._started, 1e-9)
        score = self._bytes / seconds
        if self._warmup_left > 0:
            self._warmup_left -= 1
            self._write_row(0, "warmup", self._current, self._bytes, seconds, score)
            self._start_sample()
            return
        self._trial += 1  # trial 1 is the defaults, in force since init(): no message was needed
        phase = self.search.phase
        self.search.report(score)
        self._write_row(self._trial, phase, self._current, self._bytes, seconds, score)
        following = self.search.next_setting()
        self._measuring = False
        if following is None:
            best = self.search.best
            self._write_row("", "final", best, "", "", self.search.score(best))
            self._send(pb.RankMessage(tuning=tuning_message(self._trial + 1, best, final=True)))
        else:
            self._send(pb.RankMessage(tuning=tuning_message(self._trial + 1, following)))

    def _write_row(self, trial, phase, setting: Setting, nbytes, seconds, score) -> None:
        if self._log_path is None:
            return
        mode = "w" if self._log_rows == 0 else "a"
        with open(self._log_path, mode, newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            if self._log_rows == 0:
                writer.writerow(CSV_COLUMNS)
            writer.writerow([trial, phase, setting["fusion_threshold_bytes"], setting["cycle_time_ms"],
                             setting["ring_min_bytes"], int(bool(setting["cache_enabled"])), nbytes,
                             "" if seconds == "" else f"{seconds:.6f}", "" if score is None else f"{score:.1f}"])
        self._log_rows += 1


__all__ = ["attach", "Autotuner", "Applied", "search_space", "reduced_bytes", "tuning_message", "setting_of",
           "CSV_COLUMNS"]


def attach(runtime) -> None:
    """Give ``runtime``'s background thread an :class:`Autotuner` when ``RINGMASTER_AUTOTUNE`` is on.

    Called by ``Runtime.__init__`` before the background thread starts. The response cache
    takes part in the search when the runtime has a ``set_cache_enabled(bool)`` method (it
    is called on the background thread, at the AUTOTUNE response's place in the order) and
    a cache (``runtime.cache`` is None with ``RINGMASTER_CACHE_CAPACITY=0``: nothing to switch,
    so no samples are spent on it).
    """
    if not runtime.config.autotune:
        return
    toggle = getattr(runtime, "set_cache_enabled", None)
    if getattr(runtime, "cache", True) is None:
        toggle = None
    runtime.executor.autotune = Autotuner(
        runtime.rank, runtime.size, runtime.config, send=runtime.outbox.put_control,
        set_cycle_time=runtime.outbox.set_cycle_time, set_cache_enabled=toggle)
