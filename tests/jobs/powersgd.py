"""Compression.powersgd in DistributedOptimizer against one process running the same algorithm.

Run under mpirun. Every rank computes every rank's gradients, and runs PowerSGD as written
in the paper (Vogels et al. 2019, Algorithm 1, with torch's choices: plain averaging until
start_iter, 1-D tensors and small matrices averaged as they are, Gram-Schmidt for rank <= 2
and QR above) on them in one process: the trained weights must match. Also: the bytes per
step, a checkpoint (stopping and resuming from the optimizer's state dict equals not
stopping), and misuse refused with the fix. Prints ``FAIL`` lines, then ``DONE``.
"""

import torch

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)
report = TALLY.report


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 48),
                               torch.nn.ReLU(), torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(step, r):
    generator = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(5, 2, 6, 6, generator=generator), torch.randint(0, 4, (5,), generator=generator)


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def orthonormal(m):
    """Columns made orthonormal: Gram-Schmidt for up to two columns, else QR's Q."""
    m = m.clone()
    if m.shape[1] > 2:
        return torch.linalg.qr(m).Q
    for i in range(m.shape[1]):
        m[:, i] = m[:, i] / m[:, i].norm()
        for j in range(i + 1, m.shape[1]):
            m[:, j] = m[:, j] - (m[:, i] * m[:, j]).sum() * m[:, i]
    return m


class Reference:
    """PowerSGD over SIZE simulated ranks in one process."""

    def __init__(self, rank, start_iter, names_shapes, seed=0):
        self.rank, self.start_iter, self.step = rank, start_iter, 0
        self.errors = {}  # (name, rank) -> error matrix
        self.qs = {}
        self.generator = torch.Generator().manual_seed(seed)
        self.compressed = {}
        for name, shape in names_shapes:
            n = shape[0]
            m = int(torch.Size(shape).numel()) // n if len(shape) > 1 else 0
            r = min(rank, n, m) if m else 0
            self.compressed[name] = len(shape) > 1 and (n + m) * r * 2 < n * m

    def average(self, per_rank):
        """per_rank: a list (by rank) of {name: gradient}; returns {name: averaged gradient}."""
        out = {}
        self.step += 1
        for name in per_rank[0]:
            grads = [g[name] for g in per_rank]
            if self.step <= self.start_iter or not self.compressed[name]:
                out[name] = sum(grads) / SIZE
                continue
            ms = [g.reshape(g.shape[0], -1) + self.errors.get((name, i), 0) for i, g in enumerate(grads)]
            if name not in self.qs:
                self.qs[name] = torch.randn(ms[0].shape[1], min(self.rank, *ms[0].shape), generator=self.generator)
            q = orthonormal(self.qs[name])
            p = orthonormal(sum(m @ q for m in ms))
            q = sum(m.t() @ p for m in ms) / SIZE
            self.qs[name] = q
            approx = p @ q.t()
            for i, m in enumerate(ms):
                self.errors[(name, i)] = m - approx
            out[name] = approx.reshape(grads[0].shape)
        return out


def train(rank, start_iter, steps, momentum):
    model, twin = make_model(), make_model()
    compression = rm.Compression.powersgd(rank=rank, start_iter=start_iter, min_compression_rate=2)
    optimizer = rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                        named_parameters=model.named_parameters(), compression=compression)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=momentum)
    reference = Reference(rank, start_iter, [(n, p.shape) for n, p in twin.named_parameters()])
    sent = []
    for step in range(steps):
        x, y = batch(step, RANK)
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        rm.bytes_sent(reset=True)
        optimizer.step()
        sent.append(rm.bytes_sent(reset=True)["total"])
        per_rank = []
        for r in range(SIZE):
            twin.zero_grad()
            loss_of(twin, *batch(step, r)).backward()
            per_rank.append({n: p.grad.clone() for n, p in twin.named_parameters()})
        averaged = reference.average(per_rank)
        for n, p in twin.named_parameters():
            p.grad = averaged[n]
        twin_optimizer.step()
        with torch.no_grad():
            difference = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))
        report(f"rank={rank} start_iter={start_iter} step {step}: weights equal the one-process reference",
               difference < 1e-5, f"max difference {difference:.3g}")
    compressed = [n for n, c in reference.compressed.items() if c]
    report(f"rank={rank}: the large matrices are compressed, vectors and small ones not",
           compressed == ["2.weight", "4.weight"], str(compressed))
    return model, sent, twin


model, sent, twin = train(rank=2, start_iter=2, steps=6, momentum=0.9)
train(rank=3, start_iter=0, steps=3, momentum=0.0)  # QR; compressed from the first step



def resumed(stop_at, steps, keep_compressor_state=True):
    """Train ``steps`` steps, stopping after ``stop_at`` into a checkpoint of this rank (model and
    optimizer state through torch.save) and resuming from it with a new model, optimizer and compressor."""
    import io

    def build(model):
        compression = rm.Compression.powersgd(rank=2, start_iter=2, min_compression_rate=2)
        return rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=compression)

    model = make_model()
    optimizer = build(model)
    for step in range(steps):
        if step == stop_at:
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
            saved.seek(0)
            checkpoint = torch.load(saved, weights_only=False)
            if not keep_compressor_state:
                checkpoint["optimizer"].pop("ringmaster.powersgd")
            model = make_model()
            model.load_state_dict(checkpoint["model"])
            optimizer = build(model)
            optimizer.load_state_dict(checkpoint["optimizer"])
        x, y = batch(step, RANK)
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        optimizer.step()
    return model


def difference_of(a, b):
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


straight = resumed(None, 6)
exact = difference_of(straight, resumed(3, 6))
report("stop and resume from the state dict equals not stopping", exact <= 1e-7, f"max difference {exact:.3g}")
lost = difference_of(straight, resumed(3, 6, keep_compressor_state=False))
report("without the compressor's state it does not (the check can fail)", lost > 1e-4, f"{lost:.3g}")

# Bytes per step: one fused allreduce before start_iter, then two of P (+ uncompressed) and Q.
shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
dense = sum(p.numel() for p in model.parameters())
uncompressed = dense - 48 * 64 - 32 * 48
low_rank = uncompressed + 2 * (48 + 64) + 2 * (32 + 48)
expected = [dense] * 2 + [low_rank] * 4
ratios = [s / sent[0] for s in sent]
report("bytes per step: the dense buffer, then P and Q", all(abs(r - e / dense) < 0.01 for r, e in
                                                             zip(ratios, expected)),
       f"sent {sent}, expected in proportion to {expected}")
if RANK == 0:
    print(f"BYTES dense {sent[0]} powersgd {sent[-1]} per step", flush=True)

# Misuse: the fix is named.
for kwargs, fix in [({"rank": 0}, "positive integer"), ({"start_iter": -1}, ">= 0")]:
    try:
        rm.Compression.powersgd(**kwargs)
        report(f"powersgd {kwargs} refused", False, "no error")
    except ValueError as error:
        report(f"powersgd {kwargs} refused", fix in str(error), str(error))
try:
    rm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                            compression=rm.Compression.powersgd(rank=1), op=rm.Sum)
    report("powersgd with op=Sum refused", False, "no error")
except ValueError as error:
    report("powersgd with op=Sum refused", "op=ringmaster.Average" in str(error), str(error))
try:
    rm.allreduce(torch.ones(3), compression=rm.Compression.powersgd())
    report("powersgd in allreduce refused", False, "no error")
except TypeError as error:
    report("powersgd in allreduce refused", "DistributedOptimizer" in str(error), str(error))

TALLY.done()
rm.shutdown()
