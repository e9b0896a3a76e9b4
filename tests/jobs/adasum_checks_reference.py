"""The reference of Adasum's pairwise tree, as ringmaster defines it (``ringmaster.ops.adasum``),
in float64 NumPy: the result of ranks [lo, hi) is ``pair(lower half's, upper half's)`` over
the largest power of two P <= N ranks, after each rank r >= P was combined into rank r - P."""

import numpy as np


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ab, aa, bb = a @ b, a @ a, b @ b
    return (1 - ab / (2 * aa) if aa > 0 else 1.0) * a + (1 - ab / (2 * bb) if bb > 0 else 1.0) * b


def tree(vectors) -> np.ndarray:
    """Adasum of ``vectors`` (one per rank of the set, in rank order), as ringmaster defines it."""
    n = len(vectors)
    power = 1 << (n.bit_length() - 1)
    folded = [pair(vectors[r], vectors[r + power]) if r + power < n else vectors[r] for r in range(power)]

    def combine(lo, hi):
        if hi - lo == 1:
            return folded[lo]
        middle = (lo + hi) // 2
        return pair(combine(lo, middle), combine(middle, hi))

    return combine(0, power)
