"""The response cache's driver: a caller waiting on a hit never starts a cycle it does not need.

A rank whose training loop has moved on may hold its GIL in a blocking call (mpi4py's
pickle-based ``comm.allreduce`` does), so its cache thread cannot enter a cycle until the
others arrive there too; a caller that started a cycle after its hit had already run would
wait for that rank for ever (seen as 8-rank jobs hanging in ``bench/small_collectives.py``).
"""

import threading
import time
import types

import pytest
from mpi4py import MPI

from ringmaster.worker.runtime.cache_protocol import Hit
from ringmaster.worker.runtime.response_cache import ResponseCache


class CountingComm:
    def __init__(self):
        self.cycles = 0

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Iallreduce(self, vector, result, op=None):
        self.cycles += 1
        return MPI.REQUEST_NULL


class IdleExecutor:
    def lower_priority(self):
        pass


@pytest.mark.timeout(30)
def test_a_caller_whose_hit_ran_in_the_threads_cycle_starts_no_cycle():
    comm = CountingComm()
    cache = ResponseCache(comm, IdleExecutor(), 4, 1 << 20, 0.001, negotiate=lambda requests: None,
                          on_fatal=lambda error: None)  # its thread is not started: the test plays it
    ran = threading.Event()
    handle = types.SimpleNamespace(done=ran.is_set)
    cache.protocol.pending[0] = Hit(entry=types.SimpleNamespace(handle=handle), requests=[], since=time.monotonic())
    cache._driver.acquire()  # the cache's thread is running a cycle
    caller = threading.Thread(target=cache.drive, args=(handle,))
    caller.start()
    time.sleep(0.2)          # the caller waits for that cycle to end
    ran.set()                # the cycle ran the caller's hit
    cache.protocol.pending.clear()
    cache._driver.release()
    caller.join(10)
    assert not caller.is_alive()
    assert comm.cycles == 0, "drive() started a cycle after its hit had run"

