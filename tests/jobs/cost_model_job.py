"""Calibrate the RedSync cost model on a real job and print what every rank got.

Lines (each rank):
  MODEL <rank> <json of the CostModel fields, floats as float.hex() so equality is bit-exact>
  TIME <rank> <seconds calibrated() took>
  CACHED <rank> <True if a second calibrated() call returned the same object>
  DECISIONS <rank> <json: {numel: "sparse"/"dense"} at ratio 0.001 on a 1e3..1e9 grid>
  CROSSOVER <rank> <crossover(0.001) or None>
  DESCRIBE <rank> <describe()>
  DONE <rank> <failures> failures
Rank 0 also prints the decision table (lines starting with two spaces after the tag).
"""

import json
import logging
import time

from ringmaster.worker.compression import cost_model
from ringmaster.worker.frontend import calibration

import ringmaster as rm

rm.init()
# init() sets the "ringmaster" loggers to RINGMASTER_LOG_LEVEL (WARNING); show the calibration line.
logging.getLogger("ringmaster.compression").setLevel(logging.INFO)
RANK = rm.rank()
failures = 0

start = time.perf_counter()
model = calibration.calibrated()
elapsed = time.perf_counter() - start
again = calibration.calibrated()

fields = {name: (value.hex() if isinstance(value, float) else value) for name, value in model.as_dict().items()}
print(f"MODEL {RANK} {json.dumps(fields, sort_keys=True)}", flush=True)
print(f"TIME {RANK} {elapsed:.6f}", flush=True)
print(f"CACHED {RANK} {again is model}", flush=True)
grid = [10 ** e for e in range(3, 10)] + [3 * 10 ** e for e in range(3, 9)]
decisions = {n: ("sparse" if model.prefers_sparse(n, 0.001) else "dense") for n in sorted(grid)}
print(f"DECISIONS {RANK} {json.dumps(decisions)}", flush=True)
print(f"CROSSOVER {RANK} {model.crossover(0.001)}", flush=True)
print(f"DESCRIBE {RANK} {model.describe()}", flush=True)
if RANK == 0:
    print(cost_model.decision_log(model, {"bias": 512, "conv": 36_864, "fc1.weight": 4_194_304,
                                          "embedding": 100_000_000}, 0.001), flush=True)
rm.barrier()
print(f"DONE {RANK} {failures} failures", flush=True)
rm.shutdown()
