"""Top-k selection for residual gradient compression (ringmaster.worker.compression.selection):
exactness of trimmed top-k, the k..2k range and threshold reuse of the binary search, the
sampled search's bound and fallbacks, degenerate inputs. Single process, a few seconds."""

from __future__ import annotations

import math

import pytest
import torch

from ringmaster.worker.compression import selection as sel

METHODS = {
    "exact": lambda v, k: sel.topk_exact(v, k),
    "trimmed": lambda v, k: sel.trimmed_topk(v, k),
    "threshold": lambda v, k: sel.threshold_binary_search(v, k)[0],
    "sampled": lambda v, k: sel.sampled_threshold_search(v, k, generator=torch.Generator().manual_seed(0)),
}


def randn(n, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def assert_valid(values, indices, low, high):
    """``low``..``high`` distinct ascending int64 indices, none of them smaller in
    magnitude than any index left out."""
    assert indices.dtype == torch.int64 and indices.dim() == 1
    assert low <= indices.numel() <= high, (indices.numel(), low, high)
    assert torch.all(indices[1:] > indices[:-1]), "indices must be strictly ascending"
    if 0 < indices.numel() < values.numel():
        chosen = torch.zeros(values.numel(), dtype=torch.bool)
        chosen[indices] = True
        magnitudes = values.abs()
        assert magnitudes[chosen].min() >= magnitudes[~chosen].max()


def topk_magnitudes(values, k):
    return torch.topk(values.abs(), min(k, values.numel())).values.sort().values


@pytest.fixture(params=["one chunk", "small chunks"])
def chunking(request, monkeypatch):
    """Run a test with whole-tensor passes (as on a GPU) and with many uneven CPU chunks."""
    monkeypatch.setattr(sel, "_CPU_CHUNK", 1 << 30 if request.param == "one chunk" else 4096)


@pytest.mark.parametrize("n", [1, 2, 17, 1000, 4099, 100_003])
def test_trimmed_topk_selects_the_same_set_as_torch_topk(n, chunking):
    values = randn(n, seed=n, dtype=torch.float64)  # continuous: no ties
    for k in sorted({0, 1, 2, n // 1000, n // 100, n // 2, n - 1, n, n + 3}):
        indices = sel.trimmed_topk(values, k)
        assert_valid(values, indices, min(k, n), min(k, n))
        expected = torch.topk(values.abs(), min(k, n)).indices.sort().values
        assert torch.equal(indices, expected), (n, k)


def test_trimmed_topk_with_ties_selects_exactly_k_of_the_top_magnitudes(chunking):
    values = torch.randint(-4, 5, (20_000,), generator=torch.Generator().manual_seed(1)).float()
    for k in (1, 7, 1000, 2222, 5000, 19_999):
        indices = sel.trimmed_topk(values, k)
        assert_valid(values, indices, k, k)
        assert torch.equal(values[indices].abs().sort().values, topk_magnitudes(values, k))


def test_trimmed_topk_lowering_the_ratio_and_falling_back_below_the_mean():
    values = randn(50_000, seed=3)
    for k in (5, 500, 5000, 40_000):  # 40 000 is more than pass the mean: torch.topk on all
        assert torch.equal(values[sel.trimmed_topk(values, k)].abs().sort().values, topk_magnitudes(values, k))


@pytest.mark.parametrize("n", [10, 1000, 65_536, 300_001])
def test_threshold_binary_search_returns_k_to_2k_of_the_largest(n, chunking):
    values = randn(n, seed=n)
    for k in sorted({1, 2, max(1, n // 1000), n // 100 or 1, n // 10, n // 3}):
        indices, state = sel.threshold_binary_search(values, k)
        assert_valid(values, indices, k, 2 * k)
        assert state.searches == 1


def test_threshold_is_reused_for_five_calls_then_searched_again():
    values = randn(200_000, seed=4)
    k = 200
    indices, state = sel.threshold_binary_search(values, k)
    searched = state.threshold
    assert (state.searches, state.reuses, state.reuses_left) == (1, 0, sel.REUSE_INTERVAL)
    for call in range(1, sel.REUSE_INTERVAL + 1):
        shuffled = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(call))]
        again, same_state = sel.threshold_binary_search(shuffled, k, state)
        assert same_state is state and state.threshold == searched
        assert (state.searches, state.reuses) == (1, call)
        assert_valid(shuffled, again, indices.numel(), indices.numel())
    _, state = sel.threshold_binary_search(values, k, state)  # the sixth call after a search
    assert (state.searches, state.reuses, state.reuses_left) == (2, sel.REUSE_INTERVAL, sel.REUSE_INTERVAL)


def test_a_reused_threshold_outside_k_to_2k_searches_at_once():
    values = randn(200_000, seed=5)
    k = 200
    _, state = sel.threshold_binary_search(values, k)
    for scale in (3.0, 0.3):  # the old threshold now keeps far more than 2k, then fewer than k
        indices, state = sel.threshold_binary_search(values * scale, k, state)
        assert_valid(values * scale, indices, k, 2 * k)
        assert state.reuses == 0 and state.reuses_left == sel.REUSE_INTERVAL
    assert state.searches == 3


def test_threshold_search_falls_back_to_exactly_k_when_no_threshold_fits():
    outlier = randn(100_000, seed=6)
    outlier[123] = 1e9  # [k, 2k] spans far less than eps * (max - mean)
    ties = torch.randint(-3, 4, (100_000,), generator=torch.Generator().manual_seed(6)).double()
    for values, k in ((outlier, 50), (ties, 100), (ties, 60_000), (randn(1000, seed=7), 900)):
        indices, state = sel.threshold_binary_search(values, k)
        assert_valid(values, indices, k, k)
        assert torch.equal(values[indices].abs().sort().values, topk_magnitudes(values, k))
        assert state.threshold is None and state.reuses_left == 0  # nothing to reuse


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [1 << 21, (1 << 21) + 1001])
def test_sampled_search_returns_between_k_and_its_bound(seed, n):
    values = randn(n, seed=seed)
    for k, slack in ((n // 1000, 0.25), (n // 500, 0.0), (20_000, 0.25)):
        indices = sel.sampled_threshold_search(values, k, generator=torch.Generator().manual_seed(seed), slack=slack)
        assert_valid(values, indices, k, math.floor(2 * k * (1 + slack)))


def spy(monkeypatch, name, calls):
    """Replace ``sel.<name>`` by a wrapper that records ``name`` in ``calls``."""
    real = getattr(sel, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(sel, name, wrapper)


def test_sampled_search_falls_back_to_exact_selection(monkeypatch):
    fallbacks = []
    spy(monkeypatch, "trimmed_topk", fallbacks)
    n, k = 1 << 21, 2000

    # The sample finds no threshold: exactly k equal magnitudes among zeros.
    sparse = torch.zeros(n)
    sparse[torch.randperm(n, generator=torch.Generator().manual_seed(0))[:k]] = 1.0
    generator = torch.Generator().manual_seed(0)
    assert_valid(sparse, sel.sampled_threshold_search(sparse, k, generator=generator), k, k)
    assert len(fallbacks) == 1

    # Too many pass the estimate (20 000 ties at the k-th magnitude): top-k among them.
    tied = torch.zeros(n)
    tied[: 10 * k] = 1.0
    tied[10 * k: 11 * k] = torch.rand(k, generator=torch.Generator().manual_seed(1)) * 0.5
    assert_valid(tied, sel.sampled_threshold_search(tied, k, generator=generator), k, k)
    assert len(fallbacks) == 1

    # A sample too small to estimate well: estimates miss both ways, all results still hold.
    monkeypatch.setattr(sel, "MIN_SAMPLE_HITS", 2)
    trimmed_before, too_many = len(fallbacks), []
    spy(monkeypatch, "_topk_among", too_many)
    values = randn(n, seed=2)
    for seed in range(30):
        generator = torch.Generator().manual_seed(seed)
        indices = sel.sampled_threshold_search(values, k, sample_ratio=1e-4, generator=generator)
        assert_valid(values, indices, k, math.floor(2.5 * k))
    assert len(fallbacks) > trimmed_before and too_many


def test_sampled_search_on_a_small_tensor_is_the_full_search():
    values = randn(100_000, seed=8)
    assert torch.equal(sel.sampled_threshold_search(values, 100), sel.threshold_binary_search(values, 100)[0])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fill", [0.0, 0.75, -2.0])
def test_all_equal_magnitudes_give_exactly_k(method, fill, chunking):
    for n in (5, 3000, (1 << 21) + 3):
        values = torch.full((n,), fill)
        for k in (1, 3, n // 1000 + 1):
            assert_valid(values, METHODS[method](values, k), k, k)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_infinity_raises(method, bad, chunking):
    for n, k in ((10, 3), (1 << 21, 2000)):
        values = randn(n, seed=9)
        values[n // 2] = bad
        with pytest.raises(ValueError, match="NaN or infinity"):
            METHODS[method](values, k)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_float_dtype(method, dtype):
    values = randn(30_000, seed=10, dtype=dtype)
    for k in (1, 30, 3000):
        indices = METHODS[method](values, k)
        high = k if method in ("exact", "trimmed") else 2 * k
        assert_valid(values, indices, k, high)
        if method in ("exact", "trimmed"):
            assert torch.equal(values[indices].abs().sort().values, topk_magnitudes(values, k))


@pytest.mark.parametrize("method", METHODS)
def test_empty_tiny_and_k_bounds(method):
    empty = torch.empty(0)
    for k in (0, 1, 5):
        assert METHODS[method](empty, k).numel() == 0
    values = torch.tensor([0.5, -3.0, 2.0])
    assert METHODS[method](values, 0).numel() == 0
    assert METHODS[method](values, 1).tolist() == [1]
    assert METHODS[method](values, 3).tolist() == [0, 1, 2]
    assert METHODS[method](values, 10).tolist() == [0, 1, 2]


def test_clear_errors_for_bad_arguments():
    with pytest.raises(TypeError, match="floating-point"):
        sel.trimmed_topk(torch.arange(10), 2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        sel.select([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="1-D"):
        sel.threshold_binary_search(torch.zeros(4, 4), 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        sel.topk_exact(torch.zeros(4), -1)
    with pytest.raises(TypeError):
        sel.topk_exact(torch.zeros(4), 1.5)
    with pytest.raises(ValueError, match="unknown selection method"):
        sel.select(torch.zeros(4), 1, method="radix")
    with pytest.raises(ValueError, match="sample_ratio"):
        sel.sampled_threshold_search(torch.zeros(4), 1, sample_ratio=0)


def test_select_dispatches_by_method_and_by_size(monkeypatch):
    called = []
    for name in ("topk_exact", "trimmed_topk", "threshold_binary_search", "sampled_threshold_search"):
        spy(monkeypatch, name, called)
    monkeypatch.setattr(sel, "EXACT_BELOW", 1000)
    monkeypatch.setattr(sel, "SAMPLED_FROM", 10_000)
    values = randn(20_000, seed=11)
    for n, state, expected in ((999, None, "topk_exact"), (1000, None, "trimmed_topk"),
                               (9999, None, "trimmed_topk"), (10_000, None, "sampled_threshold_search"),
                               (10_000, sel.ThresholdState(), "threshold_binary_search")):
        called.clear()
        assert_valid(values[:n], sel.select(values[:n], 10, state=state), 10, 25)
        assert called[0] == expected, (n, called)
    state = sel.ThresholdState()
    for _ in range(3):
        assert_valid(values, sel.select(values, 20, method="threshold", state=state), 20, 40)
    assert (state.searches, state.reuses) == (1, 2)
    for method, expected in (("exact", "topk_exact"), ("trimmed", "trimmed_topk"),
                             ("sampled", "sampled_threshold_search")):
        called.clear()
        sel.select(values, 20, method=method)
        assert called[0] == expected
