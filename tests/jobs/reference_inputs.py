"""Seeded per-rank inputs and their single-process reductions, shared by the collectives jobs.

Every rank rebuilds every rank's input from a seed, so each can compute the expected result
of a collective locally with plain torch.
"""

import torch


def rank_input(rank, shape, dtype, op_name="Sum", salt=0):
    """Rank ``rank``'s input: small integers for Product (exact products), N(0,1) for floats."""
    generator = torch.Generator().manual_seed(1000 * rank + 7 * salt + len(shape))
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if op_name == "Product":  # keep products small and exact enough
        values = torch.randint(1, 3, shape, generator=generator)
        return values.to(dtype) if not dtype.is_floating_point else (values.double() * 0.5 + 0.5).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    high = 50 if dtype == torch.uint8 else 1000
    return torch.randint(0, high, shape, generator=generator).to(dtype)


def reference(inputs, op_name, dtype, size):
    """The reduction of ``inputs`` (one per rank) as ringmaster defines it; integer Average truncates."""
    if dtype == torch.bool:
        stacked = torch.stack(inputs)
        return stacked.any(0) if op_name in ("Sum", "Max") else stacked.all(0)
    stacked = torch.stack([t.double() for t in inputs])
    result = {"Sum": lambda s: s.sum(0), "Average": lambda s: s.sum(0), "Min": lambda s: s.min(0).values,
              "Max": lambda s: s.max(0).values, "Product": lambda s: s.prod(0)}[op_name](stacked)
    if op_name == "Average":
        result = result / size if dtype.is_floating_point else torch.trunc(result / size)
    if not dtype.is_floating_point:
        result = result.to(torch.int64).to(dtype)  # wrap like the dtype does (uint8 sums)
    return result.to(dtype)


def alltoall_case(rank, size):
    """An uneven alltoall: (every rank's input, rank ``rank``'s splits, what ``rank`` must receive, its
    received splits). Rank r sends ``(r + dst) % 3`` rows of 2 to rank dst."""
    def splits_of(source):
        return [(source + dst) % 3 for dst in range(size)]

    inputs = [torch.arange(sum(splits_of(r)) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r for r in range(size)]
    parts = []
    for source in range(size):
        start = sum(splits_of(source)[:rank])
        parts.append(inputs[source][start:start + splits_of(source)[rank]])
    received = [splits_of(source)[rank] for source in range(size)]
    return inputs, splits_of(rank), torch.cat(parts), received
