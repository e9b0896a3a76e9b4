"""The runtime room: the in-process machinery behind ``rm.init()``.

What lives here: the process's runtime and its start and end (:mod:`.lifecycle`); finding
and talking to the coordinator (:mod:`.bootstrap`, :mod:`.client`, :mod:`.outbox`); the
background thread that runs the coordinator's response lists over MPI (:mod:`.executor`)
and the gradient plan it runs (:mod:`.gradient_plan`); the tensor table's handles
(:mod:`.handles`), process sets (:mod:`.process_sets`), the crossing from torch tensors to
NumPy arrays (:mod:`.tensors`), the timeline, the exceptions and stack dumps.

It may import ``ringmaster.ops``, ``ringmaster.proto`` (what the protocol means, shared
with the coordinator: auth, the op specs, the dtype table), ``ringmaster.common`` and, for
the executor's wire codecs, ``ringmaster.worker.compression``; never ``ringmaster.coordinator``. It never imports
``ringmaster.worker.frontend``, nor ``ringmaster`` or ``ringmaster.worker``, which re-export
the frontend (``tests/test_layout.py`` checks this).
"""
