"""torch.optim.Optimizer's methods and torch.amp.GradScaler on DistributedOptimizer and ZeroOptimizer.

Run under mpirun as ``optimizer_methods.py DEVICE [methods] [amp]``. Every case trains a seeded
small model on per-rank batches with the ringmaster optimizer (``dist``: DistributedOptimizer,
``zero``: ZeroOptimizer with 100-byte buckets) and, in the same process, a plain torch copy on
the batches of every rank together (the single-process reference), then compares parameters.

``methods``: ``add_param_group`` (progressive unfreezing), step hooks (the optimizer's and
torch's global ones: one call each per step, as torch), state-dict hooks, ``zero_grad`` with
``set_to_none`` True and False, ``load_state_dict`` with other groups (refused, as torch) and
with other hyperparameters (taken, as torch), an LR scheduler, ``swa_utils`` (AveragedModel +
SWALR). ``amp``: GradScaler's plain recipe, an overflow on one rank (every rank skips the same
step and the scale backs off alike), ``unscale_`` + clipping. Prints ``CASES <section> <n>``
and ``DONE <cases> cases, <failures> failures``.
"""

import sys
import warnings

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ringmaster as rm
from job_report import Tally

rm.init()
RANK, SIZE = rm.rank(), rm.size()
torch.set_num_threads(1)
TALLY = Tally(RANK)
DEVICE = sys.argv[1]
if DEVICE != "cpu":  # each rank's GPU, several ranks sharing one where there are fewer
    torch.cuda.set_device(rm.local_rank() % torch.cuda.device_count())
SECTIONS = sys.argv[2:] or ["methods", "amp"]
KINDS = ("dist", "zero")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.fc1 = nn.Linear(13, 7)
        self.fc2 = nn.Linear(7, 3)
        self.to(DEVICE)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batches(steps, rank):
    generator = torch.Generator().manual_seed(200 + rank)
    return [(torch.randn(8, 13, generator=generator).to(DEVICE), torch.randn(8, 3, generator=generator).to(DEVICE))
            for _ in range(steps)]


def everyone(steps):
    """Each step's (this rank's batch, every rank's batches together)."""
    mine = batches(steps, RANK)
    each = [batches(steps, r) for r in range(SIZE)]
    together = [(torch.cat([each[r][s][0] for r in range(SIZE)]), torch.cat([each[r][s][1] for r in range(SIZE)]))
                for s in range(steps)]
    return list(zip(mine, together))


def wrap(kind, optimizer, model):
    if kind == "dist":
        return rm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    return rm.ZeroOptimizer(optimizer, named_parameters=model.named_parameters(), bucket_bytes=100)


def difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def loss_of(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def train_pair(kind, make, steps, each_step=None, build=None):
    """The ringmaster copy and the reference trained side by side; ``each_step(step, opt, ref_opt)``
    runs before each step's backward; ``build(kind, model)`` makes (opt, ref_opt) instead of ``make``."""
    model, reference = Net(), Net()
    if build is not None:
        opt, ref_opt = build(kind, model, reference)
    else:
        opt, ref_opt = wrap(kind, make(model), model), make(reference)
    for step, (mine, together) in enumerate(everyone(steps)):
        if each_step is not None:
            each_step(step, opt, ref_opt, model, reference)
        for o, m, batch in ((opt, model, mine), (ref_opt, reference, together)):
            o.zero_grad()
            loss_of(m, batch).backward()
            o.step()
    if kind == "zero":
        opt.wait_parameters()
    return model, reference, opt, ref_opt


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def methods():
    for kind in KINDS:
        # add_param_group: fc1 frozen for 3 steps, then unfrozen and added with its own lr.
        def unfreeze(step, opt, ref_opt, model, reference):
            if step == 3:
                for o, m in ((opt, model), (ref_opt, reference)):
                    m.fc1.requires_grad_(True)
                    o.add_param_group({"params": list(m.fc1.parameters()), "lr": 0.05})

        def frozen(kind, model, reference):
            for m in (model, reference):
                m.fc1.requires_grad_(False)
            return (wrap(kind, torch.optim.SGD(model.fc2.parameters(), lr=0.1, momentum=0.9), model),
                    torch.optim.SGD(reference.fc2.parameters(), lr=0.1, momentum=0.9))

        start = Net().fc1.weight.detach().clone()
        model, reference, opt, _ = train_pair(kind, None, 7, unfreeze, frozen)
        moved = (model.fc1.weight.detach() - start).abs().max().item()
        diff = difference(model, reference)
        TALLY.report(f"{kind} add_param_group equals one process", diff <= 1e-5 and moved > 1e-3,
                     f"difference {diff:.3g}, added layer moved {moved:.3g}")

        # Step hooks: the optimizer's own, and torch's global ones, once per step each.
        calls = {"dist": [], "ref": []}

        def hooked(kind, model, reference):
            opt, ref_opt = wrap(kind, adam(model), model), adam(reference)
            for name, o in (("dist", opt), ("ref", ref_opt)):
                o.register_step_pre_hook(lambda o, a, k, name=name: calls[name].append(("pre", o)))
                o.register_step_post_hook(lambda o, a, k, name=name: calls[name].append(("post", o)))
            return opt, ref_opt

        seen = []
        handle = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(o))
        try:
            model, reference, opt, ref_opt = train_pair(kind, None, 4, build=hooked)
        finally:
            handle.remove()
        mine = [what for what, o in calls["dist"] if o is opt]
        TALLY.report(f"{kind} step hooks run once per step, as torch's",
                     mine == [what for what, _ in calls["ref"]] and len(mine) == 8
                     and seen.count(opt) == 4 and seen.count(ref_opt) == 4 and len(seen) == 8,
                     f"own {mine}, global: {seen.count(opt)} on it of {len(seen)}")
        TALLY.report(f"{kind} step hooks: same parameters", difference(model, reference) <= 1e-5,
                     f"{difference(model, reference):.3g}")

        # State-dict hooks: a post hook adds a key, a load pre hook changes the lr, a post hook counts.
        model, reference, opt, ref_opt = train_pair(kind, adam, 2)
        loaded = []
        for o in (opt, ref_opt):
            o.register_state_dict_post_hook(lambda o, sd: {**sd, "note": "hooked"})
            o.register_load_state_dict_pre_hook(
                lambda o, sd: {**sd, "param_groups": [{**g, "lr": 0.002} for g in sd["param_groups"]]})
            o.register_load_state_dict_post_hook(lambda o: loaded.append(o))
        ref_state = ref_opt.state_dict()
        if kind == "zero":
            opt.consolidate_state_dict(to=0)
        state = opt.state_dict() if kind == "dist" or RANK == 0 else None
        if state is not None:
            TALLY.report(f"{kind} state_dict post hook", state.get("note") == "hooked", str(sorted(state)))
        ref_opt.load_state_dict(ref_state)
        opt.load_state_dict(ref_state)
        TALLY.report(f"{kind} load_state_dict hooks", loaded == [ref_opt, opt] and all(
            g["lr"] == 0.002 for g in opt.param_groups), str([g["lr"] for g in opt.param_groups]))

        # zero_grad(set_to_none=...), as torch's.
        for set_to_none in (True, False):
            opt.zero_grad()
            loss_of(model, everyone(1)[0][0]).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            grads = [p.grad for p in model.parameters()]
            ok = all(g is None for g in grads) if set_to_none else all(
                g is not None and not g.any() for g in grads)
            TALLY.report(f"{kind} zero_grad(set_to_none={set_to_none})", ok, str([None if g is None else
                                                                                 g.abs().sum().item() for g in grads]))

        # load_state_dict with other parameter groups: refused, as torch refuses it.
        two_groups = torch.optim.Adam([{"params": reference.fc1.parameters()},
                                       {"params": reference.fc2.parameters()}], lr=0.01)
        try:
            opt.load_state_dict(two_groups.state_dict())
        except ValueError as error:
            TALLY.report(f"{kind} load_state_dict of other groups refused", "group" in str(error), str(error))
        else:
            TALLY.report(f"{kind} load_state_dict of other groups refused", False, "no error")

        # An LR scheduler on the returned optimizer, and no warning about its order.
        def scheduled(kind, model, reference):
            opt, ref_opt = wrap(kind, adam(model), model), adam(reference)
            schedulers.extend([torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)])
            return opt, ref_opt

        def schedule(step, *_):
            if step:
                for scheduler in schedulers:
                    scheduler.step()

        schedulers = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, reference, opt, _ = train_pair(kind, None, 6, schedule, scheduled)
        order = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        TALLY.report(f"{kind} StepLR equals one process", difference(model, reference) <= 1e-5 and not order
                     and abs(opt.param_groups[0]["lr"] - 0.0025) < 1e-12,
                     f"{difference(model, reference):.3g} lr {opt.param_groups[0]['lr']} {order}")

        # swa_utils: AveragedModel updated each step from the third, SWALR on the optimizer.
        averaged = {}

        def swa(kind, model, reference):
            opt = wrap(kind, torch.optim.SGD(model.parameters(), lr=0.1), model)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            for name, m, o in (("mine", model, opt), ("ref", reference, ref_opt)):
                averaged[name] = (m, torch.optim.swa_utils.AveragedModel(m),
                                  torch.optim.swa_utils.SWALR(o, swa_lr=0.02, anneal_epochs=2))
            return opt, ref_opt

        def average(step, *_):
            if step >= 2:
                for m, swa_model, swa_lr in averaged.values():
                    swa_model.update_parameters(m)
                    swa_lr.step()

        train_pair(kind, None, 6, average, swa)
        diff = max((a - b).abs().max().item() for a, b in zip(averaged["mine"][1].parameters(),
                                                               averaged["ref"][1].parameters()))
        TALLY.report(f"{kind} swa_utils AveragedModel + SWALR equal one process", diff <= 1e-5, f"{diff:.3g}")


def amp():
    autocast_dtype = torch.float16
    for kind in KINDS:
        for clip in (None, 0.05):
            for overflow_step in (None, 2):
                model, reference = Net(), Net()
                opt, ref_opt = wrap(kind, adam(model), model), adam(reference)
                scalers = [torch.amp.GradScaler(DEVICE, init_scale=1024.0) for _ in range(2)]
                skipped = []
                for step, (mine, together) in enumerate(everyone(6)):
                    for o, m, batch, scaler, me in ((opt, model, mine, scalers[0], True),
                                                    (ref_opt, reference, together, scalers[1], False)):
                        o.zero_grad()
                        with torch.autocast(DEVICE, dtype=autocast_dtype):
                            loss = loss_of(m, batch)
                        if step == overflow_step:
                            # Rank 1's gradients overflow; one process sees the same in its combined batch.
                            if not me or RANK == 1:
                                loss = loss * float("inf")
                        before = [p.detach().clone() for p in m.parameters()]
                        scaler.scale(loss).backward()
                        if clip is not None:
                            scaler.unscale_(o)
                            if me and kind == "zero":
                                o.clip_grad_norm_(clip)
                            else:
                                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                        scaler.step(o)
                        scaler.update()
                        if me:
                            if kind == "zero":
                                o.wait_parameters()
                            if all(torch.equal(a, p.detach()) for a, p in zip(before, m.parameters())):
                                skipped.append(step)
                if kind == "zero":
                    opt.wait_parameters()
                case = f"{kind} GradScaler clip={clip} overflow={overflow_step}"
                diff = difference(model, reference)
                TALLY.report(f"{case}: equals one process", diff <= 1e-3, f"{diff:.3g}")
                everyone_skipped = rm.allgather_object(skipped, name=f"skipped.{case}")
                TALLY.report(f"{case}: every rank skips the same steps",
                             all(s == ([overflow_step] if overflow_step is not None else []) for s in everyone_skipped),
                             str(everyone_skipped))
                scales = rm.allgather_object(scalers[0].get_scale(), name=f"scale.{case}")
                TALLY.report(f"{case}: the scale agrees on every rank and with one process",
                             all(s == scalers[1].get_scale() for s in scales), f"{scales} vs {scalers[1].get_scale()}")
                flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
                gathered = rm.allgather(flat.reshape(1, -1), name=f"weights.{case}")
                TALLY.report(f"{case}: equal weights on every rank", bool((gathered - gathered[0]).abs().max() == 0))


for section, run in (("methods", methods), ("amp", amp)):
    if section in SECTIONS:
        before = TALLY.cases
        run()
        print(f"CASES {section} {TALLY.cases - before}", flush=True)

TALLY.done()
rm.shutdown()
