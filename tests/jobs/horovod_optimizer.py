"""DistributedOptimizer as Horovod 0.28's: sparse gradients stay sparse, and its warning text.

Run under ``mpirun`` on any number of ranks (the tests use 2, 3 and 4). Sections:

* ``sparse``: an ``nn.Embedding(sparse=True)`` trained by ``torch.optim.SparseAdam`` (and,
  mixed with a dense layer, by SGD) through ``DistributedOptimizer``, with and without
  ``sparse_as_dense``, with ``op=Average`` and ``Sum``, in the global set and in the set of
  even or odd ranks (sets of one rank at 2 ranks, of two and one at 3). Every member rebuilds
  every member's batch from seeds; the single-process reference trains a copy of the model on
  them with plain torch, its gradient being the members' losses summed (``Sum``) or averaged
  (``Average``). Checked after each step: the gradient the optimizer saw is sparse and equals
  the reference's; after the last, the parameters equal the reference's and every member's.
  With ``sparse_as_dense``, one member also skips the embedding in one step (its gradient is
  then reduced as zeros and still handed back sparse).
* ``warning``: ``step()`` after ``synchronize()`` outside ``skip_synchronize()`` warns with
  Horovod's text (then ringmaster's explanation); inside it, no warning.

Prints ``FAIL`` lines, ``CASES <section> <count>``, then ``DONE``.
"""

import copy
import sys
import warnings
import zlib

import torch
from torch import nn

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
tally = Tally(RANK)
SECTIONS = sys.argv[1:] or ["sparse", "warning"]

EVEN = rm.add_process_set(list(range(0, SIZE, 2)))
ODD = rm.add_process_set(list(range(1, SIZE, 2)))
SETS = [("global", rm.global_process_set, list(range(SIZE))),
        ("even", EVEN, list(range(0, SIZE, 2))),
        ("odd", ODD, list(range(1, SIZE, 2)))]
MY_SETS = [(name, ps, members) for name, ps, members in SETS if RANK in members]

VOCABULARY, WIDTH, TOKENS, BATCH, STEPS = 30, 4, 3, 2, 4
HOROVOD_TEXT = "optimizer.step() called without optimizer.skip_synchronize()"


def run(case, body):
    try:
        body()
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        tally.report(case, False, f"raised {type(error).__name__}: {error}")


class Model(nn.Module):
    def __init__(self, head: bool):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH, sparse=True)
        self.head = nn.Linear(WIDTH, 2) if head else None
        self.projection = torch.randn(WIDTH, 2, generator=torch.Generator().manual_seed(3))

    def forward(self, tokens, use_embedding=True):
        hidden = self.embedding(tokens).sum(1) if use_embedding else torch.zeros(len(tokens), WIDTH)
        return self.head(hidden) if self.head is not None else hidden @ self.projection


def batch(case, step, member):
    """``member``'s batch at ``step``: the same on every rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{case}|{step}|{member}".encode()))
    return (torch.randint(0, VOCABULARY, (BATCH, TOKENS), generator=generator),
            torch.randn(BATCH, 2, generator=generator))


def sparse_case(set_name, ps, members, optimizer_name, sparse_as_dense, op_name, groups=None, skip=None):
    """Train through DistributedOptimizer and, alongside, the reference; ``skip = (step, member)``:
    that member does not use the embedding at that step."""
    case = (f"sparse {optimizer_name} sparse_as_dense={sparse_as_dense} op={op_name} groups={groups} "
            f"skip={skip} set={set_name}")
    torch.manual_seed(11)
    model = Model(head=optimizer_name == "SGD")
    reference = copy.deepcopy(model)

    def make(module):
        if optimizer_name == "SparseAdam":
            return torch.optim.SparseAdam(module.parameters(), lr=0.05)
        return torch.optim.SGD(module.parameters(), lr=0.2)

    op = {"Average": rm.Average, "Sum": rm.Sum}[op_name]
    optimizer = rm.DistributedOptimizer(make(model), named_parameters=model.named_parameters(),
                                        sparse_as_dense=sparse_as_dense, op=op, groups=groups, process_set=ps)
    reference_optimizer = make(reference)
    for step in range(STEPS):
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        uses = {m: skip != (step, m) for m in members}
        tokens, target = batch(case, step, RANK)
        if uses[RANK] or model.head is not None:
            nn.functional.mse_loss(model(tokens, uses[RANK]), target).backward()
        total = 0
        for m in members:
            member_tokens, member_target = batch(case, step, m)
            total = total + nn.functional.mse_loss(reference(member_tokens, uses[m]), member_target)
        (total if op_name == "Sum" else total / len(members)).backward()
        optimizer.step()
        reference_optimizer.step()
        grad, expected = model.embedding.weight.grad, reference.embedding.weight.grad
        tally.report(f"{case}: step {step}: the optimizer got a sparse gradient", grad is not None and grad.is_sparse,
                     f"layout {None if grad is None else grad.layout}")
        if grad is not None:
            difference = (grad.to_dense() - expected.to_dense()).abs().max().item()
            tally.report(f"{case}: step {step}: gradient equals the reference's", difference <= 1e-5,
                         f"max difference {difference:.3g}")
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    tally.report(f"{case}: parameters equal the reference's", worst <= 1e-5, f"max difference {worst:.3g}")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).unsqueeze(0)
    gathered = rm.allgather(flat, process_set=ps)
    tally.report(f"{case}: identical on every member", all(torch.equal(row, gathered[0]) for row in gathered))


def sparse_section():
    for set_name, ps, members in MY_SETS:
        for sparse_as_dense in (False, True):
            for op_name in ("Average", "Sum"):
                run(f"sparse SparseAdam {set_name}",
                    lambda: sparse_case(set_name, ps, members, "SparseAdam", sparse_as_dense, op_name))
            run(f"sparse SGD {set_name}", lambda: sparse_case(set_name, ps, members, "SGD", sparse_as_dense, "Average"))
        if len(members) > 1:  # a member without a gradient: its zeros are reduced with the others' gradients
            run(f"sparse skip {set_name}", lambda: sparse_case(set_name, ps, members, "SparseAdam", True, "Average",
                                                               skip=(2, members[0])))
        run(f"sparse group {set_name}", lambda: sparse_case(set_name, ps, members, "SGD", True, "Average", groups=1))


def warning_section():
    torch.manual_seed(5)
    model = nn.Linear(3, 2)
    reference = copy.deepcopy(model)
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(8)
    for step, skip in enumerate((False, True, False)):
        x = torch.randn(SIZE, 3, generator=generator)
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        model(x[RANK:RANK + 1]).sum().backward()
        (reference(x).sum() / SIZE).backward()
        optimizer.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        reference_optimizer.step()
        messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        if skip:
            tally.report(f"warning: step {step} inside skip_synchronize(): no warning", not messages, str(messages))
        else:
            tally.report(f"warning: step {step}: Horovod's text", any(HOROVOD_TEXT in m for m in messages),
                         str(messages))
            tally.report(f"warning: step {step}: Horovod's text first, then ringmaster's explanation",
                         any(m.startswith(HOROVOD_TEXT) and "reduced" in m for m in messages), str(messages))
    # averaged twice is still the average: the parameters equal the reference's
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    tally.report("warning: parameters equal the reference's", worst <= 1e-6, f"max difference {worst:.3g}")


for section in SECTIONS:
    before = tally.cases
    {"sparse": sparse_section, "warning": lambda: run("warning", warning_section)}[section]()
    print(f"CASES {section} {tally.cases - before}", flush=True)
rm.barrier()
rm.remove_process_set(ODD)
rm.remove_process_set(EVEN)
tally.done()
