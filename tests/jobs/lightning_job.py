"""Lightning's Trainer on ringmaster (``ringmaster.lightning``), checked by tests/test_lightning.py.

``train DIR`` (2 ranks under ringrun): ``fit`` 2 epochs with ``strategy="ringmaster"`` (batch
BATCH per rank), a checkpoint per epoch through ModelCheckpoint, a validation metric
logged with ``sync_dist=True`` whose value differs per rank; the same fit again with half the
batch and ``accumulate_grad_batches=2``; ``trainer.test``; the strategy's collectives;
``lr_find`` then ``fit`` against a fresh ``fit``; then a ``fit`` in which rank 1 raises at its
third step, which ends the job.

``resume DIR`` (1 rank under ringrun): the reference, plain Lightning (its default strategy) on one
process with the 2 × BATCH batch from the same initial weights, 3 epochs. Lightning shuffles a
training set it shards (as for DDP): rank r's batch i is ``perm[r::2][i*BATCH:(i+1)*BATCH]`` of
the epoch's permutation ``perm`` (DistributedSampler, seed 0 and the epoch), so the two ranks'
batches i together are ``perm[i*2*BATCH:(i+1)*2*BATCH]``, the reference's batch i when it
draws from a DistributedSampler of one replica with the same seed. The comparison thus also
checks that each rank trained on its own half. the 2-rank checkpoint is compared
with its weights after epoch 2, then resumed at 1 rank with ``strategy="ringmaster"`` for the
third epoch and compared with its weights after epoch 3.

Each process prints ``KEY rank value`` lines; the test compares them.
"""

import copy
import os
import pathlib
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ringmaster as rm
import ringmaster.lightning  # noqa: F401 - registers strategy="ringmaster"

BATCH = 8          # per rank at 2 ranks; the single process takes 2 × BATCH
SAMPLES = 64       # a multiple of 2 × BATCH: no padding by DistributedSampler
FAIL_MESSAGE = "rank 1 fails on purpose at its third step"


def data(seed: int, samples: int = SAMPLES):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=generator)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


class Regression(L.LightningModule):
    """A small MLP on a regression, SGD with momentum and a learning rate decayed every 3 steps;
    logs a validation value that differs per rank."""

    def __init__(self, fail_rank: int = -1):
        super().__init__()
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.fail_rank = fail_rank

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and batch_idx == 2:
            raise RuntimeError(FAIL_MESSAGE)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        # 1 on rank 0, 11 on rank 1: the mean over ranks is 6, no rank's own value.
        self.log("rank_value", torch.tensor(10.0 * self.global_rank + 1), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        # Made on the optimizer before the strategy wraps it: the strategy moves it over.
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Snapshots(Callback):
    """The module's weights at the end of each training epoch."""

    def __init__(self):
        self.weights = {}

    def on_train_epoch_end(self, trainer, module):
        self.weights[trainer.current_epoch] = copy.deepcopy(module.state_dict())


class RankedCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, saying which rank writes."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        print(f"WROTE {rm.rank()} {pathlib.Path(path).name}", flush=True)
        super().save_checkpoint(checkpoint, path, storage_options)


def loader(dataset, batch):
    return DataLoader(dataset, batch_size=batch, shuffle=False)


def reference_loader(dataset, batch):
    """The whole data set per epoch, in the order Lightning's DistributedSampler gives the ranks together."""
    return DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=0))


def trainer(**options):
    """A quiet Trainer on the CPU; it writes checkpoints only where a ModelCheckpoint is given."""
    checkpoints = any(isinstance(callback, ModelCheckpoint) for callback in options.get("callbacks", ()))
    options.setdefault("enable_checkpointing", checkpoints)
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, deterministic=True, **options)


def max_difference(a, b):
    return max(float((a[key] - b[key]).abs().max()) for key in a)


def train(folder: pathlib.Path):
    model = Regression()
    checkpoints = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)
    fit = trainer(strategy="ringmaster", max_epochs=2, callbacks=[checkpoints], plugins=[RankedCheckpointIO()])
    rank = rm.rank()  # the strategy called rm.init()
    print(f"STRATEGY {rank} {type(fit.strategy).__name__} {fit.world_size} {fit.global_rank}", flush=True)
    fit.fit(model, loader(data(0), BATCH), loader(data(1, 16), BATCH))
    print(f"SAMPLER {rank} {type(fit.train_dataloader.sampler).__name__} {len(fit.train_dataloader)}", flush=True)
    print(f"METRIC {rank} {float(fit.callback_metrics['rank_value'])}", flush=True)
    print(f"FILES {rank} {' '.join(sorted(p.name for p in folder.iterdir()))}", flush=True)
    fit.strategy.barrier()
    # Half the batch, 2 backward passes per step: the same steps (each rank's two half batches are its batch).
    accumulated = Regression()
    half = trainer(strategy="ringmaster", max_epochs=2, accumulate_grad_batches=2)
    half.fit(accumulated, loader(data(0), BATCH // 2))
    difference = max_difference(accumulated.state_dict(), model.state_dict())
    print(f"ACCUMULATE_DIFF {rank} {difference!r}", flush=True)
    result = fit.test(model, loader(data(2, 32), BATCH), verbose=False)
    print(f"TEST {rank} {result[0]['test_loss']!r}", flush=True)
    strategy = fit.strategy  # what Lightning's callbacks and loops call
    gathered = strategy.all_gather(torch.tensor([rank + 1.0]))
    print(f"GATHER {rank} {tuple(gathered.shape)} {gathered.flatten().tolist()}", flush=True)
    print(f"BROADCAST {rank} {strategy.broadcast({'from': rank}, src=1)}", flush=True)
    one = torch.tensor(rank + 1.0)
    print(f"REDUCE {rank} {strategy.reduce(one).item()} {strategy.reduce(one, reduce_op='sum').item()} "
          f"{strategy.reduce(one, reduce_op=ReduceOp.MAX).item()} {strategy.reduce_boolean_decision(rank == 0)} "
          f"{strategy.reduce_boolean_decision(rank == 0, all=False)}", flush=True)
    # lr_find, then fit with the same Trainer and module: equal to a fresh fit, and no hook left
    # by lr_find's optimizer on the parameters (each has its fit's DistributedOptimizer's one only).
    from lightning.pytorch.tuner import Tuner

    fresh = Regression()
    trainer(strategy="ringmaster", max_epochs=1).fit(fresh, loader(data(0), BATCH))
    tuned = Regression()
    tuning = trainer(strategy="ringmaster", max_epochs=1)
    Tuner(tuning).lr_find(tuned, train_dataloaders=loader(data(0), BATCH), num_training=4, update_attr=False)
    tuning.fit(tuned, loader(data(0), BATCH))
    hooks = max(len(p._post_accumulate_grad_hooks or {}) for p in tuned.parameters())
    print(f"LR_FIND_DIFF {rank} {max_difference(tuned.state_dict(), fresh.state_dict())!r} {hooks}", flush=True)
    failing = trainer(strategy="ringmaster", max_epochs=1)
    failing.fit(Regression(fail_rank=1), loader(data(0), BATCH))
    print(f"NOT REACHED {rank}", flush=True)


def resume(folder: pathlib.Path):
    rm.init()
    rank = rm.rank()
    snapshots = Snapshots()
    reference = Regression()
    trainer(max_epochs=3, callbacks=[snapshots]).fit(reference, reference_loader(data(0), 2 * BATCH))
    saved = torch.load(folder / "epoch=1.ckpt", weights_only=False)["state_dict"]
    print(f"FIT_DIFF {rank} {max_difference(saved, snapshots.weights[1])!r}", flush=True)
    checkpointed = Regression()
    checkpointed.load_state_dict(saved)
    test_loss = trainer().test(checkpointed, loader(data(2, 32), 32), verbose=False)[0]["test_loss"]
    print(f"TEST_REFERENCE {rank} {test_loss!r}", flush=True)
    resumed = Regression()
    again = trainer(strategy="ringmaster", max_epochs=3)
    again.fit(resumed, loader(data(0), 2 * BATCH), ckpt_path=str(folder / "epoch=1.ckpt"))
    print(f"RESUMED {rank} {again.current_epoch} {type(again.strategy).__name__} {again.world_size}", flush=True)
    print(f"RESUME_DIFF {rank} {max_difference(resumed.state_dict(), snapshots.weights[2])!r}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    {"train": train, "resume": resume}[sys.argv[1]](pathlib.Path(sys.argv[2]))
