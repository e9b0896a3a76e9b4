"""Keep a ringmaster job running, collectives and all, until a test lets it end.

    ringrun ... python tests/jobs/cluster_hold.py STOP_FILE LIMIT_S

Every rank prints ``READY <rank> <hostname> <pid>``, then all ranks allreduce a stop flag
every 50 ms until the file STOP_FILE exists (exit 0) or LIMIT_S seconds have passed (exit 3).
The flag is reduced with Max, so all ranks leave in the same round and shut down cleanly.
"""

import os
import socket
import sys
import time

import torch

import ringmaster as rm

stop_file, limit_s = sys.argv[1], float(sys.argv[2])
rm.init()
print("READY", rm.rank(), socket.gethostname(), os.getpid(), flush=True)
deadline = time.monotonic() + limit_s
while True:
    stop = os.path.exists(stop_file) or time.monotonic() > deadline
    if rm.allreduce(torch.tensor([float(stop)]), op=rm.Max).item():
        break
    time.sleep(0.05)
rm.shutdown()
sys.exit(0 if os.path.exists(stop_file) else 3)
