"""HybridParallel's refusals, its shards' place beside the data-parallel helpers, and its wire formats.

Sections (``sys.argv[1:]``, default all); each prints ``CASES <section> <count>``:

* ``errors``: a classifier layer that cannot be sharded, a chain of Linear layers that does
  not fit, a set of one rank, features whose output does not match the first Linear (on
  every rank, and when only one rank's does not), a bad scheme or compression: each a clear
  error naming the layer, the rank and the fix, and the job goes on afterwards;
* ``local``: ``broadcast_parameters(model.state_dict())`` leaves the shards as they are,
  ``broadcast_optimizer_state`` keeps each rank's state of its shards, ``DistributedOptimizer``
  reduces only the features' gradients;
* ``compression``: bytes this rank sends for one step (forward and backward) with fp16 and
  8-bit activations against none, per scheme, as ``rm.bytes_sent()`` counts them, and the
  logits and gradients they give against the uncompressed ones.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import ringmaster as rm
from job_report import Tally
from ringmaster.worker.frontend.local_parameters import is_local

rm.init()
torch.set_num_threads(1)
RANK, SIZE = rm.rank(), rm.size()
SECTIONS = sys.argv[1:] or ["errors", "local", "compression"]
tally = Tally(RANK)


def expect_error(case, kind, words, build):
    """``build()`` raises ``kind`` whose message holds every one of ``words``."""
    try:
        build()
    except kind as error:
        missing = [word for word in words if word not in str(error)]
        tally.report(case, not missing, f"{missing} not in: {error}")
        return
    except Exception as error:  # noqa: BLE001 - the wrong kind is a failure too
        tally.report(case, False, f"raised {type(error).__name__}: {error}")
        return
    tally.report(case, False, "raised nothing")


def small(seed=0, classifier_layers=None):
    torch.manual_seed(seed)
    features = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    classifier = nn.Sequential(*(classifier_layers or [nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 5)]))
    return features, classifier


def works(case, model, rows=4, features_in=6):
    """A forward and backward through ``model`` completes on every rank (nothing left half-negotiated)."""
    x = torch.randn(rows, features_in)
    out = model(x)
    out.sum().backward()
    tally.report(case, out.shape == (rows, 5), f"shape {tuple(out.shape)}")


# ================================================================== errors
def errors():
    hp = rm.parallel.HybridParallel
    for layer, words in [
        (nn.Softmax(dim=1), ["classifier[1] (Softmax)", "cannot be sharded", "mixes features", "Move it into"]),
        (nn.BatchNorm1d(10), ["classifier[1] (BatchNorm1d)", "cannot be sharded"]),
        (nn.Sequential(nn.ReLU()), ["classifier[1] (Sequential)", "cannot be sharded", "nn.Linear"]),
        (nn.PReLU(), ["classifier[1] (PReLU)", "element-wise layers without parameters"]),
    ]:
        words = [f"on rank {RANK}", *words]
        layers = [nn.Linear(8, 10), layer, nn.Linear(10, 5)]
        expect_error(f"errors: {type(layer).__name__} in the classifier", ValueError, words,
                     lambda: hp(*small(classifier_layers=layers)))
    expect_error("errors: Linear chain", ValueError, ["classifier[2] (Linear)", "takes 9 input features", "gives 10"],
                 lambda: hp(*small(classifier_layers=[nn.Linear(8, 10), nn.ReLU(), nn.Linear(9, 5)])))
    expect_error("errors: no Linear", ValueError, ["no nn.Linear"],
                 lambda: hp(*small(classifier_layers=[nn.ReLU()])))
    expect_error("errors: not a Sequential", TypeError, ["nn.Sequential"],
                 lambda: hp(small()[0], nn.Linear(8, 5)))
    expect_error("errors: scheme", ValueError, ["scheme='d'", "'a'", "'b'", "'c'"],
                 lambda: hp(*small(), scheme="d"))
    expect_error("errors: variable batch with scheme a", ValueError, ["scheme 'a' has one round"],
                 lambda: hp(*small(), scheme="a", variable_batch=True))
    expect_error("errors: compression", TypeError, [f"rank {RANK}", "compression=", "Compression.int8"],
                 lambda: hp(*small(), compression=rm.Compression.topk(0.1)))

    # a set of one rank, on every rank (each its own set)
    singles = [rm.add_process_set([rank]) for rank in range(SIZE)]
    expect_error("errors: a set of one rank", ValueError,
                 [f"rank {RANK}", "has one rank", "at least 2 members", "nn.Sequential(features, classifier)"],
                 lambda: hp(*small(), process_set=singles[RANK]))
    for single in singles:
        rm.remove_process_set(single)

    # features whose output does not fit the first Linear: every rank raises, naming the layer
    flat = rm.parallel.HybridParallel(nn.Sequential(nn.Conv2d(1, 2, 3)), nn.Sequential(nn.Linear(8, 5)))
    expect_error("errors: features not flattened", ValueError,
                 ["classifier[0] (Linear)", "takes (batch, 8)", "4-d", "nn.Flatten()", f"on rank {RANK}"],
                 lambda: flat(torch.randn(3, 1, 4, 4)))
    # only the last rank's output is too wide: every rank raises, naming that rank
    uneven = rm.parallel.HybridParallel(nn.Sequential(nn.Flatten()), nn.Sequential(nn.Linear(4, 5)))
    side = 3 if RANK == SIZE - 1 else 2
    expect_error("errors: one rank's features do not fit", ValueError,
                 ["classifier[0] (Linear)", f"rank {SIZE - 1}: 2-d, 9 features"],
                 lambda: uneven(torch.randn(2, 1, side, side)))

    variable = hp(*small(), scheme="c", variable_batch=True)
    expect_error("errors: variable batch through model(x)", RuntimeError, ["model.train_step(x, target"],
                 lambda: variable(torch.randn(4, 6)).sum().backward())
    with torch.no_grad():
        tally.report("errors: variable batch model(x) without grad", variable(torch.randn(4, 6)).shape == (4, 5))
    expect_error("errors: train_step without the shards' optimizer", ValueError, ["optimizer"],
                 lambda: variable.train_step(torch.randn(4, 6), torch.zeros(4, dtype=torch.long), F.cross_entropy,
                                             torch.optim.SGD(variable.features.parameters(), lr=0.1)))
    works("errors: the job goes on", hp(*small()))


# =================================================================== local
def local():
    torch.manual_seed(RANK)  # every rank builds another model: the first rank's is the one trained
    features, classifier = small(seed=RANK)
    first_weight = classifier[0].weight.detach().clone()
    first_weight = rm.broadcast(first_weight, root_rank=0, name="first weight")
    model = rm.parallel.HybridParallel(features, classifier, scheme="b")
    full = model.full_state_dict()
    tally.report("local: the first rank's classifier is the model's",
                 torch.equal(full["classifier.0.weight"], first_weight))
    shard = model.classifier[0].weight
    tally.report("local: the shards are marked, the features not",
                 is_local(shard) and not any(is_local(p) for p in model.features.parameters()))
    before = shard.detach().clone()
    rm.broadcast_parameters(model.state_dict(), root_rank=0)
    tally.report("local: broadcast_parameters(state_dict()) leaves the shards", torch.equal(shard.detach(), before))
    rm.broadcast_parameters(model.named_parameters(), root_rank=0)
    tally.report("local: broadcast_parameters(named_parameters()) leaves the shards",
                 torch.equal(shard.detach(), before))

    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(RANK))
    F.cross_entropy(model(x), torch.arange(4) % 5).backward()
    shard_grad = shard.grad.clone()
    features_grad = model.features[0].weight.grad.clone()
    optimizer.step()
    averaged = rm.allreduce(features_grad, name="features grad")
    tally.report("local: the features' gradient is averaged",
                 torch.allclose(model.features[0].weight.grad, averaged, atol=1e-6))
    tally.report("local: the shard's gradient is left as it is", torch.equal(shard.grad, shard_grad))
    momentum = optimizer.state[shard]["momentum_buffer"].clone()
    rm.broadcast_optimizer_state(optimizer, root_rank=0)
    tally.report("local: broadcast_optimizer_state keeps this rank's shard state",
                 torch.equal(optimizer.state[shard]["momentum_buffer"], momentum))
    features_momentum = optimizer.state[model.features[0].weight]["momentum_buffer"]
    root_momentum = rm.broadcast(features_momentum, root_rank=0, name="features momentum")
    tally.report("local: broadcast_optimizer_state still broadcasts the features' state",
                 torch.equal(features_momentum, root_momentum))


# ============================================================= compression
def one_step(model, x, y):
    """(bytes this rank sent, logits, the features' gradient, the first shard's gradient) for one step."""
    model.zero_grad()
    rm.barrier()
    rm.bytes_sent(reset=True)
    logits = model(x)
    F.cross_entropy(logits, y).backward()
    sent = rm.bytes_sent()["total"]
    return sent, logits.detach(), model.features[0].weight.grad.clone(), model.classifier[0].weight.grad.clone()


def compression():
    generator = torch.Generator().manual_seed(100 + RANK)
    x, y = torch.randn(24, 64, generator=generator), torch.randint(0, 10, (24,), generator=generator)
    for scheme in ("a", "b", "c"):
        results = {}
        for name in ("none", "fp16", "int8", "linear8"):
            torch.manual_seed(0)
            features = nn.Sequential(nn.Linear(64, 256), nn.ReLU())
            classifier = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
            model = rm.parallel.HybridParallel(features, classifier, scheme=scheme,
                                               compression=None if name == "none" else getattr(rm.Compression, name))
            results[name] = one_step(model, x, y)
        dense = results["none"][0]
        for name, (low, high) in {"fp16": (1.9, 2.0), "int8": (3.9, 4.0), "linear8": (3.9, 4.0)}.items():
            ratio = dense / results[name][0]
            tally.report(f"compression: scheme {scheme} {name} sends {low}-{high} x fewer bytes",
                         low <= ratio <= high, f"{dense} vs {results[name][0]} bytes: {ratio:.3f} x")
            for what, index, tolerance in (("logits", 1, 0.05), ("features' gradient", 2, 0.1),
                                           ("shard gradient", 3, 0.1)):
                exact, approximate = results["none"][index], results[name][index]
                error = float((approximate - exact).norm() / exact.norm())
                tally.report(f"compression: scheme {scheme} {name} {what} within {tolerance:.0%}", error <= tolerance,
                             f"relative error {error:.4f}")


# ==================================================================== main
for section in SECTIONS:
    before = tally.cases
    {"errors": errors, "local": local, "compression": compression}[section]()
    print(f"CASES {section} {tally.cases - before}", flush=True)
rm.barrier()
tally.done()
