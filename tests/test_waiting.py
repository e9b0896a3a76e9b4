"""ringmaster.ops.waiting: how a wait paces its tests of an MPI request, per thread.

The request is a stand-in with MPI.Request's ``Test()``; ``time.sleep`` is recorded rather
than slept, so these tests check which pauses a wait takes, not how long they last.
"""

from __future__ import annotations

import contextlib
import threading

import pytest

from ringmaster.ops import waiting

pytestmark = pytest.mark.timeout(30)


class Request:
    """Completes at its ``tests``-th call of Test() (never, if None)."""

    def __init__(self, tests=None):
        self.remaining = tests

    def Test(self):  # noqa: N802 - MPI.Request's name
        if self.remaining is None:
            return False
        self.remaining -= 1
        return self.remaining <= 0


@pytest.fixture
def pauses(monkeypatch):
    """The pauses waits on any thread take, per thread name; the spin window is skipped."""
    taken = {}
    lock = threading.Lock()

    def sleep(seconds):
        with lock:
            taken.setdefault(threading.current_thread().name, []).append(seconds)

    monkeypatch.setattr(waiting.time, "sleep", sleep)
    monkeypatch.setattr(waiting, "SPIN_S", 0.0)
    return taken


def test_a_wait_pauses_longer_and_longer_up_to_the_limit(pauses):
    waiting.wait(Request(tests=40))
    taken = pauses[threading.current_thread().name]
    assert taken[0] == waiting.FIRST_PAUSE_S
    assert taken == sorted(taken)
    assert max(taken) == waiting.LONGEST_PAUSE_S


def test_an_eager_wait_keeps_its_pauses_short_and_the_setting_ends_with_the_block(pauses):
    me = threading.current_thread().name
    with waiting.eagerly():
        waiting.wait(Request(tests=40))
    eager = pauses.pop(me)
    assert len(eager) == 38 and max(eager) == waiting.EAGER_LONGEST_PAUSE_S
    waiting.wait(Request(tests=40))
    assert max(pauses[me]) == waiting.LONGEST_PAUSE_S


def test_the_setting_is_restored_after_an_error_and_when_nested(pauses):
    me = threading.current_thread().name
    with pytest.raises(RuntimeError):
        with waiting.eagerly():
            with waiting.eagerly():
                pass
            waiting.wait(Request(tests=40))
            raise RuntimeError("the step failed")
    assert max(pauses.pop(me)) == waiting.EAGER_LONGEST_PAUSE_S
    waiting.wait(Request(tests=40))
    assert max(pauses[me]) == waiting.LONGEST_PAUSE_S


def test_eagerness_belongs_to_the_thread_that_asked_for_it(pauses):
    """The training loop waits eagerly in step(); the background thread keeps its long pauses meanwhile."""
    started, done = threading.Event(), threading.Event()

    def background():
        started.wait(10)
        waiting.wait(Request(tests=40))
        done.set()

    thread = threading.Thread(target=background, name="background")
    thread.start()
    with waiting.eagerly():
        started.set()
        assert done.wait(10)
        waiting.wait(Request(tests=40))
    thread.join(10)
    assert max(pauses["background"]) == waiting.LONGEST_PAUSE_S
    assert max(pauses[threading.current_thread().name]) == waiting.EAGER_LONGEST_PAUSE_S


@pytest.mark.parametrize("eager", [False, True], ids=["patient", "eager"])
def test_a_long_wait_ends_with_the_jobs_error(pauses, eager):
    """A wait for a peer that will never come raises the runtime's fatal error, eager or not."""
    error = RuntimeError("rank 1 died")
    checks = []

    def check():
        checks.append(len(pauses[threading.current_thread().name]))
        return error if len(checks) == 3 else None

    waiting.set_abort_check(check)
    try:
        with waiting.eagerly() if eager else contextlib.nullcontext():
            with pytest.raises(RuntimeError, match="rank 1 died"):
                waiting.wait(Request(tests=None))
    finally:
        waiting.set_abort_check(None)
    # Asked about as often either way: once per LONGEST_PAUSE_S of pauses, give or take one.
    slept = sum(pauses[threading.current_thread().name])
    assert slept == pytest.approx(3 * waiting.LONGEST_PAUSE_S, rel=0.5)
