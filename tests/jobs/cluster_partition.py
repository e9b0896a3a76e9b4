"""A training loop for the partition tests (tests/test_partitions.py): a 1 MiB allreduce every
20 ms, as in issue 46, each result checked against the sum every rank contributes.

``python cluster_partition.py STEPS [SLOW_RANK SLOW_S [PAUSE_STEP PAUSE_S]]``: prints ``READY
rank host pid`` once, ``STEP rank n`` every 10 steps, ``DONE rank`` at the end; rank SLOW_RANK
(if given) sleeps SLOW_S before each allreduce, as a straggler does, and PAUSE_S more before
step PAUSE_STEP (in ``pause_here``, which its stack then shows).
"""

import os
import socket
import sys
import time

import torch

import ringmaster as rm

steps = int(sys.argv[1])
slow_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
slow_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
pause_step = int(sys.argv[4]) if len(sys.argv) > 4 else -1
pause_s = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0


def pause_here(seconds: float) -> None:
    time.sleep(seconds)


rm.init()
rank, size = rm.rank(), rm.size()
print(f"READY {rank} {socket.gethostname()} {os.getpid()}", flush=True)
tensor = torch.full((256 * 1024,), float(rank + 1))  # 1 MiB of float32
expected = size * (size + 1) / 2
for step in range(steps):
    if rank == slow_rank:
        time.sleep(slow_s)
        if step == pause_step:
            pause_here(pause_s)
    result = rm.allreduce(tensor, op=rm.Sum)  # unnamed: negotiated every step, never a cache hit
    assert float(result[0]) == expected and float(result[-1]) == expected, (step, float(result[0]), expected)
    if step % 10 == 0:
        print(f"STEP {rank} {step}", flush=True)
    time.sleep(0.02)
print(f"DONE {rank}", flush=True)
rm.shutdown()
