"""The compression room: gradient compressors and the torch side of the codecs.

What lives here: the ``Compression`` namespace and the compressor interface
(:mod:`.compressors`); Dettmers' 8-bit codecs (:mod:`.quantization`; the runtime's executor
applies them on the wire); RedSync's residual gradient compression (:mod:`.rgc`, with the
message each rank sends in :mod:`.rgc_messages` and the state kept per tensor in
:mod:`.rgc_state`); top-k selection (:mod:`.selection`); PowerSGD's low-rank factors (:mod:`.powersgd`; the
frontend's ``low_rank`` runs its allreduces); and RedSync's cost model
(:mod:`.cost_model`; measuring it on the job is a collective, so that part lives in the
frontend's ``calibration``).

Tensor arithmetic that communicates nothing. It may import torch, ``ringmaster.ops`` and
``ringmaster.common``; it never imports ``ringmaster.worker.runtime`` or
``ringmaster.worker.frontend`` (both use it), nor ``ringmaster`` or ``ringmaster.worker``
(``tests/test_layout.py`` checks this).
"""
