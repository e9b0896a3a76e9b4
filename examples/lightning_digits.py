"""Train the handwritten-digit classifier with Lightning's Trainer on ringmaster (``strategy="ringmaster"``).

    pip install 'ringmaster[lightning,examples]'
    ringrun -np 2 python examples/lightning_digits.py
    ringrun -np 2 python examples/lightning_digits.py --epochs 5 --checkpoint-dir digits-ckpt
    ringrun -np 2 python examples/lightning_digits.py --epochs 10 --checkpoint-dir digits-ckpt --resume

The same data and model as examples/pytorch_digits.py, written as a LightningModule. The
strategy does what that script does by hand: it wraps the optimizer in
``rm.DistributedOptimizer``, gives every rank its shard of the training set (a
``DistributedSampler``, reshuffled each epoch), broadcasts rank 0's initial weights, averages
the logged metrics over the ranks (``sync_dist=True``) and lets rank 0 alone write the
checkpoints. The learning rate is scaled by the number of ranks here, because the global
batch is that many times larger; the strategy does not scale it.
"""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import ringmaster as rm
import ringmaster.lightning  # noqa: F401 - registers Trainer(strategy="ringmaster")
from pytorch_digits import MOMENTUM, create_model, load_data  # examples/pytorch_digits.py


class DigitsModule(L.LightningModule):
    """The digits MLP, its loss, its metrics and its optimizer."""

    def __init__(self, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.model = create_model()

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def _evaluate(self, batch, stage: str):
        images, labels = batch
        logits = self.model(images)
        self.log(f"{stage}_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log(f"{stage}_accuracy", (logits.argmax(dim=1) == labels).float().mean(), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=MOMENTUM)


class EpochReport(L.Callback):
    """Rank 0 prints one line per epoch: the metrics, already averaged over the ranks."""

    def on_train_epoch_end(self, trainer, module):  # after the epoch's validation
        if trainer.is_global_zero:
            metrics = trainer.callback_metrics
            print(f"epoch {trainer.current_epoch + 1}: loss {float(metrics['train_loss']):.4f}  "
                  f"validation accuracy {float(metrics['val_accuracy']):.3f} (mean of {trainer.world_size} ranks)",
                  flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="train until this epoch (also when resuming)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="for one rank; multiplied by the number of ranks")
    parser.add_argument("--seed", type=int, default=42, help="the initial weights and the shuffling of each epoch")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="rank 0 writes last.ckpt here after each epoch")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/last.ckpt, if it exists")
    args = parser.parse_args()
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir DIR")

    torch.set_num_threads(1)  # the ranks share the machine's cores
    L.seed_everything(args.seed, verbose=False)
    callbacks = [EpochReport()]
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, save_top_k=0))
    trainer = L.Trainer(strategy="ringmaster", max_epochs=args.epochs, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(callbacks[1:]),
                        num_sanity_val_steps=0)
    train_set, test_set = load_data()
    module = DigitsModule(lr=args.lr * rm.size())  # the strategy called rm.init()
    resume_from = None
    if args.resume and os.path.exists(os.path.join(args.checkpoint_dir, "last.ckpt")):
        resume_from = os.path.join(args.checkpoint_dir, "last.ckpt")
    # No sampler here: the strategy puts a DistributedSampler on each loader, shuffling this one.
    trainer.fit(module, DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
                DataLoader(test_set, batch_size=256), ckpt_path=resume_from)
    result = trainer.test(module, DataLoader(test_set, batch_size=256), verbose=False)
    if trainer.is_global_zero:
        print(f"final test accuracy {result[0]['test_accuracy']:.3f} on {trainer.world_size} ranks", flush=True)


if __name__ == "__main__":
    main()
