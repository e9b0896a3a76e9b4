"""``rm.parallel``: model parallelism beside ``DistributedOptimizer``'s data parallelism.

* :class:`HybridParallel` — data-parallel features, model-parallel classifier (Krizhevsky,
  "One weird trick for parallelizing convolutional neural networks"), schemes (a), (b), (c),
  variable batch size, activations in fp16 or 8 bits;
* :func:`scale_learning_rate`, :func:`scale_weight_decay` — the paper's section 5 rules for
  a batch ``k`` times larger.
"""
# ruff: noqa: F401 - this module re-exports rm.parallel's names

from ringmaster.worker.frontend.hybrid import HybridParallel
from ringmaster.worker.frontend.scaling_rules import scale_learning_rate, scale_weight_decay

__all__ = ["HybridParallel", "scale_learning_rate", "scale_weight_decay"]
