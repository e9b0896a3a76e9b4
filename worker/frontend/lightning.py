"""``RingmasterStrategy``: Lightning's ``Trainer`` on ringmaster, as Lightning 1.x's
``HorovodStrategy`` ran it on Horovod (``Trainer(strategy="ringmaster")``).

Users import it as ``ringmaster.lightning`` (``ringmaster/lightning.py`` re-exports this
module); importing it registers the strategy under the name ``"ringmaster"`` in Lightning's
``StrategyRegistry`` (Lightning 2.x has no entry-point group for strategies, so a strategy
from another package exists once its module is imported). Launch with ringrun, one process
per rank: ``ringrun -np 4 python train.py``.

What each of Lightning's calls becomes:

* ``setup``: ``rm.init()`` was already called when the strategy was made; the model goes to
  its device (CUDA device ``local_rank()`` when the accelerator is a GPU, else the CPU),
  rank 0's parameters are broadcast to every rank, and each optimizer is wrapped in
  ``rm.DistributedOptimizer`` (with ``backward_passes_per_step`` = the Trainer's
  ``accumulate_grad_batches``). The learning rate is not scaled: the averaged gradient of N
  ranks is the gradient of the N-times larger batch (scale it yourself, as with DDP).
* backward: gradients start their allreduces from autograd hooks while backward runs;
  ``post_backward`` waits for them (``optimizer.synchronize()``) on the backward pass that
  precedes an optimizer step, so gradient clipping and ``on_before_optimizer_step`` see the
  averaged gradients; the step itself then skips the second wait (``skip_synchronize``).
* data: Lightning puts a ``DistributedSampler`` (``num_replicas=size()``, ``rank=rank()``) on
  every dataloader, as it does for DDP (``is_distributed`` is True).
* ``reduce`` (``self.log(..., sync_dist=True)``): ``rm.allreduce`` with ``Average`` ("mean",
  the default), ``Sum``, ``Max`` or ``Min``; ``all_gather``: ``rm.allgather`` stacked to
  ``(size, *shape)``; ``broadcast``: ``rm.broadcast_object``; ``barrier``: ``rm.barrier``.
  Every rank makes these calls in the same order, as Lightning's loops do.
* ``teardown``: the gradient hooks of the optimizers ``setup`` wrapped are removed, so a second
  fit of the same module (``lr_find``, then ``fit``) reduces each gradient once, with the new
  optimizer's hooks only: it equals a fresh fit.
* checkpoints: written by rank 0 only (Lightning's ``is_global_zero``); on resume every rank
  reads the same file, so model and optimizer state agree without a broadcast.

The module fails on import, naming the ``lightning`` extra, where Lightning is not installed.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Optional, Union

import torch

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
except ImportError as error:  # the base install does not bring Lightning
    raise ImportError(f"ringmaster.lightning needs Lightning 2.x (the `lightning` package), which is not "
                      f"installed ({error}); install ringmaster's extra: pip install 'ringmaster[lightning]'"
                      ) from error

from ringmaster.worker.frontend import collectives
from ringmaster.worker.frontend.differentiable import allgather, allreduce
from ringmaster.worker.frontend.functions import broadcast_object, broadcast_parameters
from ringmaster.worker.frontend.optimizer import DistributedOptimizer
from ringmaster.worker.frontend.topology import cross_rank, init, is_initialized, local_rank, rank, size

__all__ = ["RingmasterStrategy", "RingmasterEnvironment"]

#: Lightning's names of a reduction (strings, or torch.distributed.ReduceOp's names) -> ringmaster's op.
_REDUCE_OPS = {"mean": collectives.Average, "avg": collectives.Average, "sum": collectives.Sum,
               "max": collectives.Max, "min": collectives.Min, "product": collectives.Product}


class RingmasterEnvironment(ClusterEnvironment):
    """Lightning's view of a ringrun job: ranks and sizes from ringmaster, processes started by ringrun.

    Lightning never needs an address or port of it (nothing of ``torch.distributed`` is set up).
    """

    @property
    def creates_processes_externally(self) -> bool:
        """True: ringrun (or mpirun, srun) started every rank."""
        return True

    @property
    def main_address(self) -> str:
        """Not used by ringmaster (its coordinator's address travels in the environment); ``""``."""
        return ""

    @property
    def main_port(self) -> int:
        """Not used by ringmaster; 0."""
        return 0

    @staticmethod
    def detect() -> bool:
        """Whether ringmaster is initialized in this process."""
        return is_initialized()

    def world_size(self) -> int:
        """The number of ranks, ``rm.size()``."""
        return size()

    def set_world_size(self, size: int) -> None:
        """Ignored: the job's size is ringrun's ``-np``."""

    def global_rank(self) -> int:
        """This process's rank, ``rm.rank()``."""
        return rank()

    def set_global_rank(self, rank: int) -> None:
        """Ignored: ranks are ringmaster's."""

    def local_rank(self) -> int:
        """This process's rank on its host, ``rm.local_rank()``."""
        return local_rank()

    def node_rank(self) -> int:
        """The index of this process's host, ``rm.cross_rank()``."""
        return cross_rank()


class RingmasterStrategy(ParallelStrategy):
    """Data-parallel training of a ``LightningModule`` over the ranks of a ringrun job.

    ``Trainer(strategy="ringmaster")`` (after ``import ringmaster.lightning``) or
    ``Trainer(strategy=RingmasterStrategy(compression=rm.Compression.fp16))``. Keyword
    arguments other than Lightning's own (``accelerator``, ``parallel_devices``,
    ``checkpoint_io``, ``precision_plugin``) go to ``rm.DistributedOptimizer`` (``compression``,
    ``op``, ``gradient_predivide_factor``, ``groups``, ...). Calls ``rm.init()`` if the script
    has not.
    """

    strategy_name = "ringmaster"

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None, precision_plugin=None,
                 **optimizer_options: Any) -> None:
        for name in ("named_parameters", "backward_passes_per_step"):
            if name in optimizer_options:
                raise ValueError(f"RingmasterStrategy sets DistributedOptimizer's {name} itself (from the module "
                                 f"and the Trainer's accumulate_grad_batches); do not pass {name}=")
        if not is_initialized():
            init()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=RingmasterEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._optimizer_options = optimizer_options
        self._skipping = contextlib.ExitStack()
        self._made = []  # the DistributedOptimizers setup() made: their hooks go at teardown()
        self._trainer = None
        rank_zero_only.rank = rank()

    # ------------------------------------------------------------------ where and who
    @property
    def root_device(self) -> torch.device:
        """CUDA device ``local_rank()`` (modulo the GPUs Lightning was given) on a GPU accelerator, else the CPU."""
        devices = self.parallel_devices or []
        if devices and devices[0].type == "cuda":
            return devices[local_rank() % len(devices)]
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """True: Lightning adds a DistributedSampler to the dataloaders and syncs logged metrics."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """One shard per rank: ``num_replicas=size()``, ``rank=rank()``."""
        return {"num_replicas": size(), "rank": rank()}

    def model_to_device(self) -> None:
        """Move the model to :attr:`root_device` (pinning the CUDA device first)."""
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training
    def setup(self, trainer) -> None:
        """Lightning's setup, then rank 0's parameters on every rank and the optimizers wrapped."""
        super().setup(trainer)
        self._trainer = trainer
        if trainer.state.fn != TrainerFn.FITTING:  # validate, test, predict: no optimizers
            return
        assert self.lightning_module is not None
        broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        accumulate = trainer.accumulate_grad_batches
        wrapped = []
        for optimizer in self.optimizers:
            optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if not hasattr(optimizer, "_ringmaster_base"):
                original = optimizer
                with warnings.catch_warnings():  # the schedulers are moved over just below
                    warnings.filterwarnings("ignore", message="this optimizer's step.. was wrapped on the instance")
                    optimizer = DistributedOptimizer(original, named_parameters=self._named_parameters(original),
                                                     backward_passes_per_step=accumulate, **self._optimizer_options)
                self._move_schedulers(original, optimizer)
                self._made.append(optimizer)
            wrapped.append(optimizer)
            # The wait happens in post_backward, before clipping; the step must not wait again.
            self._skipping.enter_context(optimizer.skip_synchronize())
        self.optimizers = wrapped

    def _move_schedulers(self, original, wrapped) -> None:
        """Point the LR schedulers made on ``original`` (in ``configure_optimizers``) at ``wrapped``.

        Both share their parameter groups, so the learning rates a scheduler sets reach either;
        but torch's schedulers count the steps of the optimizer they were made on (a wrapper
        of its ``step`` on the instance) and warn when it never steps. ``wrapped`` gets the
        same counting wrapper.
        """
        schedulers = [config.scheduler for config in self.lr_scheduler_configs
                      if getattr(config.scheduler, "optimizer", None) is original]
        if not schedulers:
            return
        step = type(wrapped).step
        reference = weakref.ref(wrapped)

        def counted_step(*args, **kwargs):
            optimizer = reference()
            optimizer._opt_called = True
            return step(optimizer, *args, **kwargs)

        counted_step._wrapped_by_lr_sched = True  # what torch's schedulers look for
        wrapped.step = counted_step
        wrapped._opt_called = getattr(original, "_opt_called", False)
        for scheduler in schedulers:
            scheduler.optimizer = wrapped

    def _named_parameters(self, optimizer) -> list:
        """The module's (name, parameter) pairs that ``optimizer`` updates."""
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [(name, p) for name, p in self.lightning_module.named_parameters() if id(p) in owned]

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """After the backward pass that an optimizer step follows: wait for the averaged gradients."""
        trainer = self._trainer
        if trainer is not None and self.lightning_module.automatic_optimization:
            loop = trainer.fit_loop.epoch_loop
            if loop._should_accumulate():  # a backward pass only accumulating: nothing to reduce yet
                return
        for optimizer in self.optimizers:
            if hasattr(optimizer, "_ringmaster_base"):
                optimizer.synchronize()

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Any] = "mean") -> Union[torch.Tensor, Any]:
        """The allreduce of ``tensor`` over all ranks (``reduce_op``: "mean" (default), "sum", "max",
        "min" or a ``torch.distributed.ReduceOp`` of those); anything but a tensor is returned as is."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is not None:
            raise ValueError("RingmasterStrategy.reduce: process groups are not supported (group="
                             f"{group!r}); reduce over all ranks (group=None)")
        name = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
        op = _REDUCE_OPS.get(name)
        if op is None:
            raise ValueError(f"RingmasterStrategy.reduce on rank {rank()}: unknown reduce_op {reduce_op!r}; "
                             f"use one of {sorted(_REDUCE_OPS)}")
        if op is collectives.Average and not tensor.is_floating_point():
            tensor = tensor.float()  # a mean of integers is not an integer
        return allreduce(tensor, op=op)

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor``, stacked: shape ``(size(), *tensor.shape)``."""
        if group is not None:
            raise ValueError(f"RingmasterStrategy.all_gather: process groups are not supported (group={group!r})")
        gathered = allgather(tensor.unsqueeze(0) if sync_grads else tensor.detach().unsqueeze(0))
        return gathered

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable object) on every rank."""
        return broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        """Wait until every rank has reached this barrier."""
        collectives.barrier()

    # ------------------------------------------------------------------ the end
    def teardown(self) -> None:
        """Leave ``skip_synchronize``, remove the gradient hooks of the optimizers ``setup`` wrapped
        (a later fit of the same module, after ``lr_find``, wraps new ones), then Lightning's
        teardown. ringmaster stays initialized (a later ``trainer.test`` uses it); ``rm.shutdown()``
        runs at exit."""
        self._skipping.close()
        self._skipping = contextlib.ExitStack()
        for optimizer in self._made:
            optimizer.remove_hooks()
        self._made = []
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register the strategy as ``"ringmaster"``."""
        strategy_registry.register(cls.strategy_name, cls, description="ringmaster's ring allreduce over MPI",
                                   override=True)


RingmasterStrategy.register_strategies(StrategyRegistry)
