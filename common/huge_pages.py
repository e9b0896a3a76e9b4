"""Ask torch to back its large CPU tensors with transparent huge pages (2 MiB).

Ranks on one host move gradients through Open MPI's shared memory transport, which
copies straight out of the sender's memory (CMA, ``process_vm_readv``): the kernel looks
up and pins every page of the sender's buffer, about 3,000 for a 12.6 MB gradient in
4 KiB pages and 7 in huge pages. The ring allreduce ran ~1.4 × slower on torch's
gradients than on NumPy's huge-page buffers of the same size (docs/benchmarks.md).
NumPy asks for huge pages for its large arrays by itself; torch does only when
``THP_MEM_ALLOC_ENABLE=1`` is in its environment, which it reads once, at its first
tensor allocation.

So ringmaster sets that variable to ``1`` unless the user set it already:
``ringrun`` for every rank it starts, and ``import ringmaster`` for the importing process
(which works under plain ``mpirun`` or ``srun`` when ringmaster is imported before the
first tensor is created). ``THP_MEM_ALLOC_ENABLE=0`` turns it off. With the kernel's
transparent huge pages set to ``never``, torch's request does nothing.
"""

from __future__ import annotations

import os
from typing import MutableMapping

#: torch's own switch (c10's CPU allocator): allocations of 2 MiB and more are advised
#: MADV_HUGEPAGE.
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def request_for_torch(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` in ``environ`` unless it holds a value already."""
    environ.setdefault(TORCH_HUGE_PAGES, "1")
