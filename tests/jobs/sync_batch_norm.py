"""SyncBatchNorm on every rank vs torch.nn.BatchNorm on one process over the concatenated batch.

Every rank builds the same global batches and takes its own (uneven) rows; outputs, input
gradients, summed weight/bias gradients and running statistics must match the reference
after several training steps, and eval mode must then agree too.
"""

import sys

import torch

import ringmaster as rm

rm.init()
RANK, SIZE = rm.rank(), rm.size()
REFERENCE = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
failures = 0
worst = {}  # case: largest error seen


def check(case, what, got, want, tolerance):
    global failures
    if got.shape != want.shape:
        failures += 1
        print(f"FAIL {case}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}", flush=True)
        return
    if not got.numel():
        return
    error = (got.double() - want.double()).abs().max().item() / (1 + want.double().abs().max().item())
    worst[case] = max(worst.get(case, 0.0), error)
    if not error <= tolerance:
        failures += 1
        print(f"FAIL {case}: {what} differs by {error:.2e} (relative to 1 + its largest value)", flush=True)


def rows_per_rank(pattern):
    """Batch rows of every rank: even, uneven, or with rank 1 empty."""
    if pattern == "even":
        return [3] * SIZE
    if pattern == "uneven":
        return [2 + 3 * r for r in range(SIZE)]
    return [0 if r == 1 else 4 + r for r in range(SIZE)]


def run_case(case, dims, pattern, dtype=torch.float32, steps=3, **options):
    channels = 3
    generator = torch.Generator().manual_seed(len(case))
    reference = REFERENCE[dims](channels, **options).to(dtype)
    synced = rm.SyncBatchNorm(channels, **options).to(dtype)
    if reference.affine:
        with torch.no_grad():
            for module in (reference, synced):
                module.weight.copy_(1 + 0.5 * torch.randn(channels, generator=torch.Generator().manual_seed(1)))
                module.bias.copy_(torch.randn(channels, generator=torch.Generator().manual_seed(2)))
    rows = rows_per_rank(pattern)
    mine = slice(sum(rows[:RANK]), sum(rows[:RANK + 1]))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    for step in range(steps):
        shape = (sum(rows), channels, *[4 - d for d in range(dims - 2)])
        batch = 3 * torch.randn(shape, generator=generator, dtype=dtype) + 2
        weights = torch.randn(shape, generator=generator, dtype=dtype)  # loss = sum(output * weights)

        full = batch.clone().requires_grad_()
        want = reference(full)
        (want * weights).sum().backward()
        local = batch[mine].clone().requires_grad_()
        got = synced(local)
        (got * weights[mine]).sum().backward()

        check(case, f"step {step} output", got, want[mine], tolerance)
        check(case, f"step {step} input gradient", local.grad, full.grad[mine], tolerance)
        if reference.affine:
            for name in ("weight", "bias"):
                summed = rm.allreduce(getattr(synced, name).grad, op=rm.Sum)
                check(case, f"step {step} {name} gradient", summed, getattr(reference, name).grad, tolerance)
                with torch.no_grad():  # an SGD step on both, so later steps see new parameters
                    getattr(synced, name).sub_(0.1 * summed)
                    getattr(reference, name).sub_(0.1 * getattr(reference, name).grad)
                getattr(synced, name).grad = None
                getattr(reference, name).grad = None
        if reference.track_running_stats:
            check(case, f"step {step} running_mean", synced.running_mean, reference.running_mean, tolerance)
            check(case, f"step {step} running_var", synced.running_var, reference.running_var, tolerance)
            check(case, f"step {step} num_batches_tracked", synced.num_batches_tracked,
                  reference.num_batches_tracked, 0)

    synced.eval()
    reference.eval()
    batch = torch.randn(sum(rows), channels, *[2] * (dims - 2), generator=generator, dtype=dtype)
    with torch.no_grad():  # without running statistics, eval normalizes each rank's batch alone
        want = reference(batch)[mine] if reference.track_running_stats else reference(batch[mine])
        check(case, "eval output", synced(batch[mine]), want, tolerance)


run_case("2-D even", 2, "even")
run_case("2-D uneven", 2, "uneven")
run_case("3-D uneven momentum=None", 3, "uneven", momentum=None)
run_case("4-D uneven affine=False", 4, "uneven", affine=False)
run_case("4-D rank 1 empty", 4, "empty", momentum=0.3)
run_case("5-D uneven float64", 5, "uneven", dtype=torch.float64)
run_case("3-D no running stats", 3, "uneven", track_running_stats=False)

# One value per channel over the whole job: every rank refuses, none waits in backward.
try:
    rm.SyncBatchNorm(2)(torch.randn(1 if RANK == 0 else 0, 2))
    failures += 1
    print("FAIL a single value per channel was accepted", flush=True)
except ValueError as error:
    if "more than 1 value per channel" not in str(error):
        failures += 1
        print(f"FAIL unexpected error: {error}", flush=True)

if RANK == 0:
    print("worst errors:", ", ".join(f"{case} {error:.1e}" for case, error in worst.items()), flush=True)
print(f"DONE rank {RANK} of {SIZE}, {failures} failures", flush=True)
rm.shutdown()
sys.exit(1 if failures else 0)
