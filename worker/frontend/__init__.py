"""The frontend room: the torch-facing API that ``import ringmaster as rm`` exposes.

What lives here: ``horovod.torch``'s surface — the collectives (:mod:`.collectives`, with
the out-of-place ones as autograd functions in :mod:`.differentiable`), ``init`` and the
rank queries (:mod:`.topology`), broadcasting parameters, optimizer state and objects
(:mod:`.functions`), sparse allreduce (:mod:`.sparse`), ``SyncBatchNorm``
(:mod:`.sync_batch_norm`), the build queries (:mod:`.build_info`) — and
``DistributedOptimizer`` (:mod:`.optimizer`), with the calibration of the compression cost
model it may ask for (:mod:`.calibration`). Its code runs on the user's thread: it checks
arguments, submits work to the runtime and waits on handles.

It may import ``ringmaster.worker.runtime``, ``ringmaster.worker.compression``,
``ringmaster.ops``, ``ringmaster.proto`` and ``ringmaster.common``. Nothing in ringmaster
imports it except ``ringmaster.worker``, the public API (``tests/test_layout.py`` checks
this).
"""
