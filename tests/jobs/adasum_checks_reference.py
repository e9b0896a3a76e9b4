"""The reference of Adasum's pairwise tree, as ringmaster defines it (``ringmaster.ops.adasum``),
in float64 NumPy: over the largest power of two P <= N places, place r holds rank r combined
with rank r + P where that exists; the result of places [lo, hi) is ``pair`` of its lower
half's and its upper half's, weighted by the ranks each holds (equal weights: Adasum itself).

Also what the tree must give whatever its shape: :func:`expected_sum` for orthogonal
gradients, :func:`expected_mean` for parallel ones, and Horovod's own closeness test."""

import math

import numpy as np


def pair(a: np.ndarray, b: np.ndarray, m: int = 1, n: int = 1) -> np.ndarray:
    """``a`` (the result of ``m`` ranks) and ``b`` (of ``n``) combined."""
    ab, aa, bb = a @ b, a @ a, b @ b
    return ((1 - m / (m + n) * ab / aa if aa > 0 else 1.0) * a
            + (1 - n / (m + n) * ab / bb if bb > 0 else 1.0) * b)


def tree(vectors) -> np.ndarray:
    """Adasum of ``vectors`` (one per rank of the set, in rank order), as ringmaster defines it."""
    vectors = [np.asarray(v, dtype=np.float64) for v in vectors]
    n = len(vectors)
    power = 1 << (n.bit_length() - 1)
    folded = [(pair(vectors[r], vectors[r + power]), 2) if r + power < n else (vectors[r], 1) for r in range(power)]

    def combine(lo, hi):
        if hi - lo == 1:
            return folded[lo]
        middle = (lo + hi) // 2
        (a, m), (b, k) = combine(lo, middle), combine(middle, hi)
        return pair(a, b, m, k), m + k

    return combine(0, power)[0]


def expected_sum(vectors) -> np.ndarray:
    """What Adasum gives for mutually orthogonal gradients."""
    return np.sum(np.asarray(vectors, dtype=np.float64), axis=0)


def expected_mean(vectors) -> np.ndarray:
    """What Adasum gives for parallel gradients."""
    return np.mean(np.asarray(vectors, dtype=np.float64), axis=0)


def horovod_close(dtype, expected: np.ndarray, got: np.ndarray) -> tuple:
    """Horovod's test_adasum_pytorch criterion: |got - expected| / |expected| / 100 < eps of
    ``dtype``; (ok, detail)."""
    ratio = float(np.linalg.norm(expected - np.asarray(got, np.float64)) / np.linalg.norm(expected) / 100.0)
    eps = float(np.finfo(dtype).eps)
    return ratio < eps, f"difference ratio {ratio:.3g} >= eps {eps:.3g}"


def horovod_cases(test: str, size: int, largest: bool = True):
    """The inputs and expected results of Horovod's Adasum test ``test`` (``orthogonal``,
    ``parallel``, ``stability``, ``stability 2``; test/parallel/test_adasum_pytorch.py) at
    ``size`` ranks, drawn as Horovod draws them (seed 2, float32 then float16): a list of
    (dtype, every rank's vector rounded to dtype as float64, expected). The stability cases are
    parallel gradients scaled near the dtype's smallest normal value, and from it up to the
    square root of its largest. Horovod expects the sum of orthogonal gradients and the mean
    of parallel ones. ``largest=False`` leaves out the cases of 2^19 values (drawn all the
    same: the others stay Horovod's)."""
    legacy = np.random.RandomState(2)
    cases = []
    for dtype in (np.float32, np.float16):
        if test in ("orthogonal", "parallel"):
            for n in [size * 20 - (17 if test == "orthogonal" else 13), size * 2 + 1, size + 2, 2 ** 19]:
                if test == "orthogonal":
                    a = legacy.normal(0, 1, (n, size))
                else:
                    a, r = legacy.normal(0, 1, (n, 1)), legacy.normal(0, 1, (size, 1))
                if n == 2 ** 19 and not largest:
                    continue  # drawn all the same, so that the later draws are Horovod's
                q = np.linalg.qr(a)[0] if test == "orthogonal" else a @ r.T
                cases.append((dtype, q.astype(dtype).astype(np.float64)))
        elif test == "stability":
            a = legacy.normal(0, float(np.finfo(dtype).tiny), (1024, 1))
            cases.append((dtype, (a @ legacy.normal(0, 1, (size, 1)).T).astype(dtype).astype(np.float64)))
        elif test == "stability 2":
            low, high = float(np.finfo(dtype).tiny), math.sqrt(float(np.finfo(dtype).max))
            a = legacy.normal(0, 1, (1024, 1))
            scales = np.array([high ** ((i + 1) / size) * low ** ((size - i - 1) / size) for i in range(size)])
            legacy.shuffle(scales)
            cases.append((dtype, (a @ scales.reshape(1, size)).astype(dtype).astype(np.float64)))
        else:
            raise ValueError(test)
    return [(dtype, [q[:, r] for r in range(size)], q.sum(axis=1) / (1 if test == "orthogonal" else size))
            for dtype, q in cases]


HOROVOD_TESTS = ("orthogonal", "parallel", "stability", "stability 2")
