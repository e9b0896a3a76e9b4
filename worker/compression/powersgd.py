"""PowerSGD: rank-``r`` gradient compression with error feedback (Vogels, Karimireddy and
Jaggi, NeurIPS 2019), as torch's ``ddp_comm_hooks.powerSGD_hook`` runs it.

Per step, over every gradient of the optimizer at once:

1. **Plain allreduce until ``start_iter``.** The first ``start_iter`` steps average every
   gradient, fused in one buffer: early training is sensitive to compression error.
2. **Which gradients are compressed.** A gradient is viewed as a matrix ``M`` of ``n`` rows
   (its first dimension) by ``m`` columns (the rest); it is compressed when
   ``(n + m) * r * min_compression_rate < n * m``. 1-D tensors (biases, norms) and small
   matrices go uncompressed.
3. **Error feedback.** ``M += E``, the part of the earlier steps' gradients not yet sent.
4. **Power iteration, warm-started.** ``Q`` (``m x r``) is the last step's ``Q`` (drawn once
   from ``seed``'s standard normal, the same on every rank), orthogonalized. ``P = M Q``.
5. **Allreduce one** (a sum): every ``P``, with the uncompressed gradients beside them, in
   one buffer. The uncompressed ones are divided by the number of ranks: their average.
6. ``P`` is orthogonalized (Gram-Schmidt for ``r <= 2``, else QR, as torch chooses);
   ``Q = M^T P``.
7. **Allreduce two** (a sum): every ``Q`` in one buffer, divided by the number of ranks.
8. **Decompress.** ``M~ = P Q^T`` is the averaged gradient; ``E = M - M~`` stays here.

So each step makes two allreduces whatever the number of tensors, of
``sum(n r) + uncompressed`` and ``sum(m r)`` values. This module communicates nothing:
``DistributedOptimizer`` runs :meth:`PowerSGDCompressor.begin_step`, allreduces what it
returns, hands the sum to :meth:`~PowerSGDCompressor.between`, allreduces that, and calls
:meth:`~PowerSGDCompressor.end_step` (``worker/frontend/low_rank.py``). Every rank computes
the same ``Q`` and ``P`` from the same sums, so the results are identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

#: Ranks up to this are orthogonalized by Gram-Schmidt, higher ones by QR (torch's rule:
#: Gram-Schmidt is cheaper for one or two columns).
GRAM_SCHMIDT_MAX_RANK = 2


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of the 2-D ``matrix`` orthonormal, in place."""
    columns = matrix.shape[1]
    if columns <= GRAM_SCHMIDT_MAX_RANK:
        for i in range(columns):
            column = matrix[:, i:i + 1]
            column /= torch.linalg.vector_norm(column) + epsilon
            if i + 1 < columns:
                rest = matrix[:, i + 1:]
                rest -= torch.sum(column * rest, dim=0, keepdim=True) * column
    else:
        matrix.copy_(torch.linalg.qr(matrix).Q)


def should_compress(rows: int, columns: int, rank: int, min_compression_rate: float) -> bool:
    """Whether a ``rows x columns`` matrix is worth sending as rank-``rank`` factors."""
    return (rows + columns) * rank * min_compression_rate < rows * columns


@dataclass
class _Step:
    """One step between :meth:`begin_step` and :meth:`end_step`."""

    gradients: Dict[str, torch.Tensor]
    size: int
    dense: List[str]                           # gradients sent as they are
    compressed: List[str]                      # gradients sent as P and Q
    matrices: Dict[str, torch.Tensor] = field(default_factory=dict)
    ps: Dict[str, torch.Tensor] = field(default_factory=dict)


class PowerSGDCompressor:
    """``Compression.powersgd(rank=1, start_iter=1000, min_compression_rate=2.0)``: PowerSGD for
    ``DistributedOptimizer`` (see the module docstring), one instance per optimizer.

    Args:
        rank: columns of ``P`` and ``Q`` (the approximation's rank; torch's
            ``matrix_approximation_rank``). Higher is more exact and sends more.
        start_iter: steps of plain averaging before compression starts (torch's
            ``start_powerSGD_iter``).
        min_compression_rate: a matrix is compressed only if this many times smaller as factors.
        use_error_feedback: keep what was not sent and add it to the next step's gradient.
        warm_start: start each step's power iteration from the last step's ``Q``.
        orthogonalization_epsilon: added to each column's norm (against all-zero columns).
        seed: the first ``Q``'s random numbers (equal on every rank).
    """

    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2.0,
                 use_error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 seed: int = 0):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"Compression.powersgd: rank must be a positive integer, got {rank!r}")
        if not isinstance(start_iter, int) or isinstance(start_iter, bool) or start_iter < 0:
            raise ValueError(f"Compression.powersgd: start_iter must be an integer >= 0, got {start_iter!r}")
        if not min_compression_rate > 0:
            raise ValueError(f"Compression.powersgd: min_compression_rate must be positive, got "
                             f"{min_compression_rate!r}")
        if not orthogonalization_epsilon >= 0:
            raise ValueError(f"Compression.powersgd: orthogonalization_epsilon must be >= 0, got "
                             f"{orthogonalization_epsilon!r}")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.epsilon = float(orthogonalization_epsilon)
        self.seed = seed
        self.iteration = 0                        # steps finished
        self.errors: Dict[str, torch.Tensor] = {}
        self.qs: Dict[str, torch.Tensor] = {}
        self._generator = torch.Generator().manual_seed(seed)
        self._step: Optional[_Step] = None

    def __repr__(self) -> str:
        return (f"Compression.powersgd(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate:g})")

    def state_dict(self, rank: int) -> dict:
        """What a checkpoint needs to resume exactly: the step count, the ``Q`` of every matrix and
        the random state (equal on every rank), and this rank's error feedback, under ``rank``."""
        return {"iteration": self.iteration, "qs": {n: q.clone() for n, q in self.qs.items()},
                "generator": self._generator.get_state(),
                "errors": {rank: {n: e.clone() for n, e in self.errors.items()}}}

    def load_state_dict(self, state: dict, rank: int) -> None:
        """Take :meth:`state_dict`'s state; the error feedback saved for ``rank`` if there is one
        (a checkpoint of another rank's state leaves this rank's own errors as they are)."""
        self.iteration = int(state["iteration"])
        self.qs = {n: q.clone() for n, q in state["qs"].items()}
        self._generator.set_state(state["generator"])
        errors = state["errors"].get(rank)
        if errors is not None:
            self.errors = {n: e.clone() for n, e in errors.items()}

    def _rank_of(self, matrix: torch.Tensor) -> int:
        return min(self.rank, *matrix.shape)

    def compressed(self, name: str, gradient: torch.Tensor) -> bool:
        """Whether ``gradient`` (of parameter ``name``) travels as factors once compression has started."""
        if gradient.dim() < 2:
            return False
        rows = gradient.shape[0]
        columns = gradient.numel() // max(rows, 1)
        return rows > 0 and columns > 0 and should_compress(rows, columns, min(self.rank, rows, columns),
                                                            self.min_compression_rate)

    def begin_step(self, gradients: Dict[str, torch.Tensor], size: int) -> torch.Tensor:
        """Start a step over ``gradients`` (name -> dense gradient, the same names and shapes on
        every rank, in the same order) on ``size`` ranks; return the first buffer to sum-allreduce."""
        dtypes = {g.dtype for g in gradients.values()}
        if len(dtypes) > 1 or not all(d in (torch.float32, torch.float64) for d in dtypes):
            found = ", ".join(f"{name}: {g.dtype}" for name, g in gradients.items())
            raise TypeError(f"Compression.powersgd compresses float32 or float64 gradients, all of one dtype; "
                            f"got {found}. Cast the model (model.float()) or use Compression.none")
        names = list(gradients)
        if self.iteration < self.start_iter:
            self._step = _Step(gradients, size, dense=names, compressed=[])
            return _flat([gradients[n] for n in names])
        step = _Step(gradients, size, dense=[n for n in names if not self.compressed(n, gradients[n])],
                     compressed=[n for n in names if self.compressed(n, gradients[n])])
        for name in step.compressed:
            gradient = gradients[name]
            matrix = gradient.reshape(gradient.shape[0], -1)
            if self.use_error_feedback:
                error = self.errors.get(name)
                if error is not None:
                    matrix.add_(error)  # (a view of the gradient, which it changes)
            q = self.qs.get(name) if self.warm_start else None
            if q is None:
                q = torch.randn(matrix.shape[1], self._rank_of(matrix), generator=self._generator,
                                dtype=matrix.dtype).to(matrix.device)
                self.qs[name] = q
            orthogonalize(q, self.epsilon)
            step.matrices[name] = matrix
            step.ps[name] = matrix @ q
        self._step = step
        return _flat([gradients[n] for n in step.dense] + [step.ps[n] for n in step.compressed])

    def between(self, reduced: torch.Tensor) -> Optional[torch.Tensor]:
        """The sum of :meth:`begin_step`'s buffer over the ranks in; the second buffer to
        sum-allreduce out, or None when this step compresses nothing (it is then finished)."""
        step = self._step
        offset = 0
        for name in step.dense:
            gradient = step.gradients[name]
            gradient.copy_(reduced[offset:offset + gradient.numel()].view_as(gradient)).div_(step.size)
            offset += gradient.numel()
        if not step.compressed:
            self.end_step(None)
            return None
        for name in step.compressed:
            p = step.ps[name]
            p.copy_(reduced[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
            orthogonalize(p, self.epsilon)
            torch.matmul(step.matrices[name].t(), p, out=self.qs[name])
        return _flat([self.qs[n] for n in step.compressed])

    def end_step(self, reduced: Optional[torch.Tensor]) -> None:
        """The sum of :meth:`between`'s buffer in (None when it returned None): write the averaged
        gradients into the tensors :meth:`begin_step` was given, keep the errors."""
        step, self._step = self._step, None
        offset = 0
        for name in step.compressed:
            q = self.qs[name]
            q.copy_(reduced[offset:offset + q.numel()].view_as(q)).div_(step.size)
            offset += q.numel()
            matrix = step.matrices[name]
            if self.use_error_feedback:
                sent = matrix.clone()
            torch.matmul(step.ps[name], q.t(), out=matrix)
            if self.use_error_feedback:
                self.errors[name] = sent.sub_(matrix)
        if not self.warm_start:
            self.qs.clear()
        self.iteration += 1


def _flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor of ``tensors``' values in order."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])
