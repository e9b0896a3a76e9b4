"""``ringmaster.lightning``: Lightning's ``Trainer`` on ringmaster (needs ``pip install 'ringmaster[lightning]'``).

::

    import lightning as L
    import ringmaster.lightning  # registers strategy="ringmaster"

    trainer = L.Trainer(strategy="ringmaster", accelerator="cpu", max_epochs=10)
    trainer.fit(model, train_loader)        # ringrun -np 4 python train.py

Importing this module imports ringmaster's worker (torch, MPI) and Lightning; the code lives
in ``ringmaster.worker.frontend.lightning`` (docs/api.md, "Lightning").
"""
# ruff: noqa: F401 - this module re-exports the strategy

from ringmaster.worker.frontend.lightning import RingmasterEnvironment, RingmasterStrategy

__all__ = ["RingmasterStrategy", "RingmasterEnvironment"]
