"""The one outbox writer of the coordinator's and the aggregators' streams, and the daemons' start."""

import asyncio
import os
import subprocess
import sys

from ringmaster.common.daemon import write_address
from ringmaster.coordinator.stream_writer import CLOSE, coalesced, write_outbox


class Context:
    """A gRPC servicer context that records writes, or fails from the ``fail_at``-th on."""

    def __init__(self, fail_at=None):
        self.written = []
        self.fail_at = fail_at

    async def write(self, data):
        if self.fail_at is not None and len(self.written) >= self.fail_at:
            raise RuntimeError("the peer went away")
        self.written.append(data)


class Counted:
    unread_bytes = 0


def _queue(*items):
    queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_each_message_on_its_own_until_close_and_the_unread_bytes_counted_down():
    async def run():
        counted, context = Counted(), Context()
        counted.unread_bytes = 9
        await write_outbox(_queue(b"ab", b"cde", b"fghi", CLOSE, b"after"), context, counted=counted)
        return counted, context
    counted, context = asyncio.run(run())
    assert context.written == [b"ab", b"cde", b"fghi"] and counted.unread_bytes == 0


def test_coalesced_writes_join_what_queued_up_to_the_limit():
    async def run():
        context = Context()
        await write_outbox(_queue(b"aa", b"bb", b"cc", b"dddddd", b"e", CLOSE), context, coalesce_limit=6)
        return context
    assert asyncio.run(run()).written == [b"aabbcc", b"dddddd", b"e"]


def test_a_failed_write_ends_the_writer():
    async def run():
        context = Context(fail_at=1)
        await write_outbox(_queue(b"a", b"b", b"c"), context)
        return context
    assert asyncio.run(asyncio.wait_for(run(), 5)).written == [b"a"]


def test_coalesced_ends_at_its_end_marker_even_behind_other_messages():
    async def run():
        return [data async for data in coalesced(_queue(b"x", b"y", None, b"z"), 100, end=None)]
    assert asyncio.run(asyncio.wait_for(run(), 5)) == [b"xy"]


def test_the_address_file_is_written_whole(tmp_path):
    path = tmp_path / "address"
    write_address(str(path), "127.0.0.1:5000")
    assert path.read_text() == "127.0.0.1:5000\n" and os.listdir(tmp_path) == ["address"]


def test_both_daemons_refuse_to_run_without_the_job_token():
    env = {key: value for key, value in os.environ.items() if not key.startswith("RINGMASTER_")}
    for module, name, args in [("ringmaster.coordinator", "coordinator", ["--size", "2"]),
                               ("ringmaster.coordinator.aggregator", "host aggregator", ["--upstream", "127.0.0.1:1"])]:
        result = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 2, result.stderr
        assert f"ringmaster {name}: error: RINGMASTER_SECRET is not set" in result.stderr, result.stderr
        bad = subprocess.run([sys.executable, "-m", module, *args], env={**env, "RINGMASTER_SECRET": "s",
                                                                          "RINGMASTER_CYCLE_TIME": "-1"},
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and f"ringmaster {name}: error: RINGMASTER_CYCLE_TIME='-1'" in bad.stderr
