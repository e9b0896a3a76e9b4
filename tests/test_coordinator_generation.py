"""What survives from one generation of a job to the next in the coordinator
(coordinator/generation.py): nothing after a clean end, the autotuned fusion threshold and
cycle time after an elastic re-form; the response sequence, welcome, stall trackers and a
waiting flush start over in both cases."""

from __future__ import annotations

import pytest

from ringmaster.common.config import Config
from ringmaster.coordinator.generation import Generation


class FakeTimer:
    """Stands for the asyncio TimerHandle of a flush waiting for the cycle time."""

    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


def tuned_generation(config: Config) -> tuple[Generation, FakeTimer]:
    generation = Generation.start(4, config)
    generation.negotiator.fusion_threshold_bytes = 1 << 20  # as rank 0's autotuner sets them
    generation.cycle_time_ms = 7.5
    generation.sequence, generation.welcomed, generation.slow_cycle_warned = 12, True, 3
    generation.flush_scheduled = timer = FakeTimer()
    return generation, timer


@pytest.mark.parametrize("keep_tuning", [False, True])
def test_a_new_generation_starts_over_and_keeps_tuning_only_when_asked(keep_tuning):
    config = Config(fusion_threshold_bytes=64 << 20, cycle_time_ms=1.0)
    previous, timer = tuned_generation(config)
    fresh = Generation.start(3, config, previous, keep_tuning=keep_tuning)
    assert timer.cancelled and previous.flush_scheduled is None
    assert fresh.sequence == 0 and not fresh.welcomed and fresh.slow_cycle_warned == -1
    assert fresh.flush_scheduled is None and fresh.started >= previous.started
    assert fresh.negotiator is not previous.negotiator and fresh.plan_stalls is not previous.plan_stalls
    assert fresh.cache_stalls is not previous.cache_stalls
    if keep_tuning:
        assert fresh.negotiator.fusion_threshold_bytes == 1 << 20 and fresh.cycle_time_ms == 7.5
    else:
        assert fresh.negotiator.fusion_threshold_bytes == 64 << 20 and fresh.cycle_time_ms == 1.0


def test_the_first_generation_takes_the_configuration():
    config = Config(fusion_threshold_bytes=123456, cycle_time_ms=2.5, max_pending_requests=77)
    generation = Generation.start(2, config)
    assert generation.negotiator.fusion_threshold_bytes == 123456 and generation.cycle_time_ms == 2.5
    assert generation.sequence == 0 and not generation.welcomed


def test_long_rank_lists_are_written_as_runs_short_ones_as_lists():
    from ringmaster.coordinator.stall_report import ranks_text

    assert ranks_text([1, 2]) == "[1, 2]" and ranks_text([]) == "[]"
    assert ranks_text(list(range(1023))) == "[0-1022] (1023 ranks)"
    assert ranks_text([0, 1, 2, 5, 7, 8, 9, 10, 11, 20]) == "[0-2, 5, 7-11, 20] (10 ranks)"
