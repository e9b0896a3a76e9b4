"""``DistributedOptimizer(op=Adasum)``: each rank steps on its own gradients, and the
parameters' changes are combined with Adasum, as Horovod's Adasum optimizer does.

Adasum (``ringmaster.ops.adasum``) combines vectors by their dot products, so what it
combines matters: Horovod combines each rank's *update* (the step its optimizer would take
alone, learning rate and momentum included), not the raw gradients. ``step()`` here:

1. remembers every parameter ``p`` it updates (``start``);
2. runs the wrapped optimizer's step on this rank's gradients (a parameter without a
   gradient does not change: its update is zero, which Adasum leaves out);
3. reduces ``delta = p - start`` of every parameter with ``op=Adasum``, as one grouped
   allreduce (one collective per step; each parameter is still combined on its own);
   ``compression`` on the wire: ``Compression.fp16`` halves it;
4. sets ``p = start + adasum(deltas)``.

Every rank ends with the same parameters. Optimizer state (momentum, Adam's moments) stays
each rank's own, built from its own gradients, as in Horovod. The learning rate is not to
be scaled by the number of ranks (docs/api.md, "Adasum").
"""

from __future__ import annotations

import contextlib

import torch

from ringmaster.worker.frontend import collectives
from ringmaster.worker.frontend.local_parameters import is_local

_NAME_PREFIX = "DistributedOptimizer.Adasum."


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class (see the module docstring)."""

    def _setup_adasum(self, parameter_names, compression, backward_passes_per_step, process_set) -> None:
        self._process_set = process_set
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._parameter_names = parameter_names
        ordered = [p for group in self.param_groups for p in group["params"]]
        # A model-parallel shard (rm.parallel.HybridParallel) is this rank's alone.
        self._requires_update = [p for p in ordered if p.requires_grad and not is_local(p)]

    def step(self, closure=None):
        """Step on this rank's gradients, then combine every parameter's change with Adasum."""
        process_set = self._process_set
        if not (process_set.included() and process_set.size() > 1):
            return super(self._ringmaster_base, self).step(closure)  # alone: nothing to combine
        with torch.no_grad():
            starts = [p.detach().clone() for p in self._requires_update]
        loss = super(self._ringmaster_base, self).step(closure)
        with torch.no_grad():
            compressed = [self._compression.compress(p.detach() - start)
                          for p, start in zip(self._requires_update, starts)]
            # One group: one collective per step, each parameter combined on its own inside it.
            handle = collectives.submit_allreduce(
                [tensor.contiguous() for tensor, _ in compressed], what="DistributedOptimizer(op=Adasum).step",
                single=False, in_place=True, name=_NAME_PREFIX + "step", op=collectives.Adasum, flush=True,
                process_set=process_set)
            for p, start, (_, context), combined in zip(self._requires_update, starts, compressed,
                                                        collectives.synchronize(handle)):
                p.copy_(start.add_(self._compression.decompress(combined, context).to(start.dtype)))
        return loss

    def add_param_group(self, param_group: dict) -> None:
        """As torch's: the group's parameters' changes are combined from the next ``step()`` on.
        Every rank adds the same groups in the same order."""
        super(self._ringmaster_base, self).add_param_group(param_group)
        self._requires_update.extend(p for p in self.param_groups[-1]["params"] if p.requires_grad and not is_local(p))

    def synchronize(self) -> None:
        """Nothing to do: with Adasum the parameters' changes are combined inside ``step()``
        (Horovod's Adasum optimizer does the same)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Accepted for scripts written for ``op=Average``; ``step()`` combines the changes
        either way."""
        yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Gradients accumulate locally until ``step()`` in any case; kept for Horovod's API."""
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive int, got {passes!r}")
        self.backward_passes_per_step = passes

    def local_step(self, closure=None):
        """The wrapped optimizer's own step, combining nothing (``broadcast_optimizer_state``
        uses it to create a fresh optimizer's state)."""
        return super(self._ringmaster_base, self).step(closure)
