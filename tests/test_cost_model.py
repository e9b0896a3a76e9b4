"""RedSync's cost model (worker/compression/cost_model.py): the formulas on hand-computed numbers, the
crossover against brute force, argument checks, and calibration on real ringrun jobs."""

import dataclasses
import json
import math
import pathlib
import random

import pytest
from mpijob import ringrun
from ringmaster.worker.compression import cost_model
from ringmaster.worker.compression.cost_model import CostModel, decision_log

pytestmark = pytest.mark.timeout(120)

JOBS = pathlib.Path(__file__).parent / "jobs"

#: alpha 1 ms, beta 1 ns/B, gamma1 10 ns, gamma2 0.1 ns, selection 2 ns per element, p = 4.
MODEL = CostModel(alpha=1e-3, beta=1e-9, gamma1=1e-8, gamma2=1e-10, select_s_per_element=2e-9, size=4)


def model(**changes):
    fields = {"alpha": 1e-3, "beta": 1e-9, "gamma1": 1e-8, "gamma2": 1e-10, "select_s_per_element": 2e-9,
              "size": 4}
    fields.update(changes)
    return CostModel(**fields)


# ---------------------------------------------------------------------------------------
# The formulas


def test_t_sparse_on_hand_computed_numbers():
    # k = 1000: select 2e-9*1e6 + log2(4)*1e-3 + 3*(1000*8 B)*1e-9 + 4*1000*1e-8
    assert MODEL.t_sparse(1_000_000, 0.001) == pytest.approx(2e-3 + 2e-3 + 2.4e-5 + 4e-5, rel=1e-12)
    # 2-byte values: 6 B per entry
    assert MODEL.t_sparse(1_000_000, 0.001, value_bytes=2) == pytest.approx(2e-3 + 2e-3 + 1.8e-5 + 4e-5, rel=1e-12)
    # quantized: 4 B per index plus one 4-byte value per message
    assert MODEL.t_sparse(1_000_000, 0.001, quantized=True) == pytest.approx(
        2e-3 + 2e-3 + 3 * 4004e-9 + 4e-5, rel=1e-12)
    # k = ceil(0.001 * 1500) = 2; p = 2: log2(p) = 1
    two = model(size=2)
    assert two.selected(1500, 0.001) == 2
    assert two.t_sparse(1500, 0.001) == pytest.approx(2e-9 * 1500 + 1e-3 + 1 * 16e-9 + 2 * 2 * 1e-8, rel=1e-12)
    # at least one entry, at most all of them
    assert MODEL.selected(1, 0.001) == 1 and MODEL.selected(10, 1.0) == 10


def test_t_dense_on_hand_computed_numbers():
    # 2*log2(4)*1e-3 + 2*(3/4)*1e6*4 B*1e-9 + (3/4)*1e6*1e-10
    assert MODEL.t_dense(1_000_000) == pytest.approx(4e-3 + 6e-3 + 7.5e-5, rel=1e-12)
    assert MODEL.t_dense(1_000_000, value_bytes=2) == pytest.approx(4e-3 + 3e-3 + 7.5e-5, rel=1e-12)
    assert model(size=2).t_dense(1000) == pytest.approx(2e-3 + 4000e-9 + 0.5 * 1000 * 1e-10, rel=1e-12)
    # p = 3: log2 as a real number
    assert model(size=3).t_dense(3000) == pytest.approx(
        2 * math.log2(3) * 1e-3 + 2 * 2 / 3 * 3000 * 4e-9 + 2 / 3 * 3000 * 1e-10, rel=1e-12)


def test_prefers_sparse_compares_the_two_formulas():
    assert MODEL.prefers_sparse(1_000_000, 0.001)  # 4.06 ms against 10.08 ms
    slow_select = model(select_s_per_element=1e-8)  # 12 ms of selection against 10 ms dense
    assert not slow_select.prefers_sparse(1_000_000, 0.001)
    for numel in (1, 10, 1000, 123_457, 10 ** 8):
        for m in (MODEL, slow_select, model(size=2), model(alpha=1e-9)):
            assert m.prefers_sparse(numel, 0.01) == (m.t_sparse(numel, 0.01) < m.t_dense(numel))


def test_one_rank_or_ratio_one_never_prefers_sparse():
    one = model(size=1)
    zero_latency_network = model(alpha=1e-12, beta=1e-15, gamma1=1e-15, select_s_per_element=1e-15)
    for numel in (1, 1000, 10 ** 6, 10 ** 9, 10 ** 12):
        for ratio in (1e-6, 0.001, 0.5, 1.0):
            assert not one.prefers_sparse(numel, ratio)
        for m in (MODEL, zero_latency_network, model(size=64)):
            assert not m.prefers_sparse(numel, 1.0)
    assert one.t_dense(10 ** 6) == 0.0  # no communication, nothing to reduce
    assert one.crossover(0.001) is None and MODEL.crossover(1.0) is None


# ---------------------------------------------------------------------------------------
# crossover


def brute_force_crossover(m, ratio, limit, **kwargs):
    """Smallest n <= limit such that every size in [n, limit] prefers sparse (limit + 1 if none)."""
    answer = limit + 1
    for numel in range(limit, 0, -1):
        if not m.prefers_sparse(numel, ratio, **kwargs):
            break
        answer = numel
    return answer


def test_crossover_matches_brute_force_on_models_where_it_is_interesting():
    rng = random.Random(7)
    checked = 0
    while checked < 40:
        m = CostModel(alpha=10 ** rng.uniform(-9.5, -7), beta=10 ** rng.uniform(-10, -8.5),
                      gamma1=10 ** rng.uniform(-9, -7.5), gamma2=10 ** rng.uniform(-11, -9.5),
                      select_s_per_element=10 ** rng.uniform(-11, -9), size=rng.choice([2, 3, 4, 8]))
        ratio = rng.choice([0.05, 0.1, 0.25, 0.3, 0.5])
        quantized = rng.random() < 0.3
        found = m.crossover(ratio, quantized=quantized)
        if found is None or not 1 < found < 20_000:
            continue
        checked += 1
        # beyond 3x the crossover, sparse keeps winning (the margin grows on average)
        assert brute_force_crossover(m, ratio, 3 * found + 100, quantized=quantized) == found, (m, ratio)
        assert not m.prefers_sparse(found - 1, ratio, quantized=quantized)
        assert all(m.prefers_sparse(n, ratio, quantized=quantized)
                   for n in (found, 2 * found, 10 ** 6 + 7, 10 ** 9, 10 ** 12))


def test_crossover_extremes():
    assert MODEL.crossover(0.001) == 1  # latency favours one allgather; bandwidth favours sparse
    assert all(MODEL.prefers_sparse(n, 0.001) for n in (1, 17, 10 ** 4, 10 ** 7, 10 ** 10))
    # selection slower per element than dense transfer: sparse never wins for good
    slow_select = model(select_s_per_element=1e-8)
    assert slow_select.crossover(0.001) is None
    assert slow_select.prefers_sparse(10, 0.001) and not slow_select.prefers_sparse(10 ** 9, 0.001)
    # negligible latency: dense first, sparse from some size on
    low_latency = model(alpha=1e-10, size=2)
    n = low_latency.crossover(0.001)
    assert n is not None and n > 1
    assert not low_latency.prefers_sparse(n - 1, 0.001) and low_latency.prefers_sparse(n, 0.001)
    assert not low_latency.prefers_sparse(1, 0.001) and low_latency.prefers_sparse(10 ** 9, 0.001)


def test_crossover_is_monotone_in_the_ratio():
    ratios = [1e-5, 1e-4, 3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.5, 0.9, 1.0]
    models = [MODEL, model(alpha=1e-10, size=2), model(alpha=1e-9, size=8), model(alpha=3e-9, gamma1=5e-8),
              model(select_s_per_element=5e-9, size=2), model(alpha=1e-6, beta=1e-10, size=16)]
    for m in models:
        for quantized in (False, True):
            values = [m.crossover(r, quantized=quantized) for r in ratios]
            as_numbers = [math.inf if v is None else v for v in values]
            assert as_numbers == sorted(as_numbers), (m, quantized, values)
    # and in the other direction: more latency helps the single allgather round
    alphas = [1e-10, 1e-9, 1e-8, 1e-7, 1e-3]
    values = [model(alpha=a, size=2).crossover(0.01) for a in alphas]
    assert values == sorted(values, reverse=True) and values[-1] == 1


def test_crossover_is_pure_and_deterministic():
    m = model(alpha=1e-10, size=2)
    assert len({m.crossover(0.001) for _ in range(5)}) == 1
    assert m == model(alpha=1e-10, size=2) and hash(m) == hash(model(alpha=1e-10, size=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.alpha = 1.0


# ---------------------------------------------------------------------------------------
# describe, decision_log, argument checks


def test_describe_states_every_parameter_with_units():
    text = MODEL.describe()
    for fragment in ("p=4", "alpha=1000.000 us", "beta=1.0000 ns/byte", "1 GB/s", "gamma1=10.000 ns",
                     "gamma2=0.1000 ns", "selection=2.000 ns per element", "ratio 0.001",
                     "sparse allgather is preferred at every size"):
        assert fragment in text, (fragment, text)
    assert "\n" not in text
    assert "from" in model(alpha=1e-10, size=2).describe()
    assert "dense allreduce is preferred" in model(select_s_per_element=1e-8).describe()
    assert "dense allreduce is preferred" in model(size=1).describe()


def test_decision_log_is_a_table_of_every_tensor():
    slow_select = model(select_s_per_element=1e-8)
    text = decision_log(slow_select, {"bias": 10, "fc.weight": 10 ** 8}, 0.001)
    lines = text.splitlines()
    assert "p=4" in lines[0] and "ratio=0.001" in lines[0] and "1 of 2 tensors sparse" in lines[0]
    assert lines[1].split() == ["tensor", "elements", "dense", "ms", "sparse", "ms", "choice"]
    assert lines[2].split()[0] == "bias" and lines[2].split()[-1] == "sparse"
    assert lines[3].split()[0] == "fc.weight" and lines[3].split()[1] == "100,000,000"
    assert lines[3].split()[-1] == "dense"
    assert float(lines[3].split()[2]) == pytest.approx(slow_select.t_dense(10 ** 8) * 1e3, rel=1e-3)
    assert "quantized" in decision_log(MODEL, {"w": 5}, 0.01, quantized=True)
    assert len(decision_log(MODEL, {}, 0.01).splitlines()) == 2


@pytest.mark.parametrize("field, value", [
    ("alpha", 0.0), ("alpha", -1e-3), ("beta", -1e-9), ("beta", 0), ("gamma1", float("nan")),
    ("gamma2", float("inf")), ("select_s_per_element", 0.0), ("size", 0), ("size", -2), ("size", 2.5),
])
def test_bad_parameters_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        model(**{field: value})


def test_bad_parameter_types_raise_type_errors():
    with pytest.raises(TypeError, match="alpha"):
        model(alpha="1ms")
    with pytest.raises(TypeError, match="size"):
        model(size=True)


@pytest.mark.parametrize("ratio", [0, 0.0, -0.001, 1.5, float("nan"), float("inf")])
def test_bad_ratio_raises_naming_it(ratio):
    for call in (lambda: MODEL.t_sparse(1000, ratio), lambda: MODEL.prefers_sparse(1000, ratio),
                 lambda: MODEL.crossover(ratio), lambda: MODEL.describe(ratio),
                 lambda: decision_log(MODEL, {"w": 10}, ratio)):
        with pytest.raises(ValueError, match="ratio"):
            call()
    with pytest.raises(TypeError, match="ratio"):
        MODEL.prefers_sparse(1000, "0.1")


def test_bad_sizes_raise_naming_the_argument():
    for numel in (0, -5, 2.5):
        with pytest.raises(ValueError, match="numel"):
            MODEL.t_dense(numel)
        with pytest.raises(ValueError, match="numel"):
            MODEL.prefers_sparse(numel, 0.01)
    for value_bytes in (0, -4):
        with pytest.raises(ValueError, match="value_bytes"):
            MODEL.t_sparse(100, 0.01, value_bytes=value_bytes)
        with pytest.raises(ValueError, match="value_bytes"):
            MODEL.t_dense(100, value_bytes=value_bytes)
    with pytest.raises(ValueError, match="named_sizes\\['bias'\\]"):
        decision_log(MODEL, {"bias": 0}, 0.01)
    with pytest.raises(TypeError, match="CostModel"):
        decision_log({"alpha": 1}, {"w": 1}, 0.01)


# ---------------------------------------------------------------------------------------
# Calibration: the fit (pure), then real jobs


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_fit_recovers_alpha_and_beta_from_the_two_allreduce_times(p):
    truth = model(size=p, alpha=7e-4, beta=2e-9, gamma2=3e-10, gamma1=6e-9, select_s_per_element=2.5e-9)
    n = cost_model.LARGE_ELEMENTS
    t_small, t_large = truth.t_dense(1), truth.t_dense(n)
    t_add = truth.gamma2 * cost_model.GAMMA_ELEMENTS
    t_scatter = truth.gamma1 * cost_model.SCATTER_ENTRIES
    t_select = [truth.select_s_per_element * size for size in cost_model.SELECT_SIZES]
    fitted = cost_model._fit(p, t_small, t_large, t_add, t_scatter, t_select)
    for field in ("alpha", "beta", "gamma1", "gamma2", "select_s_per_element"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-9), field
    assert fitted.size == p


def test_fit_keeps_parameters_positive_under_noise():
    # the large allreduce measured no slower than the small one (noise): beta is floored
    fitted = cost_model._fit(2, 2e-3, 1.9e-3, 1e-4, 5e-4, [2e-3, 8e-3])
    assert fitted.beta == cost_model.MIN_PER_UNIT and fitted.alpha > 0
    one = cost_model._fit(1, 5e-5, 3e-3, 1e-4, 5e-4, [2e-3, 8e-3])
    assert one.size == 1 and one.alpha == 5e-5 and one.beta > 0


def parse(result, np):
    assert result.returncode == 0, result.output[-4000:]
    done = result.lines_starting("DONE ")
    assert sorted(done) == sorted(f"{r} 0 failures" for r in range(np)), result.output[-4000:]

    def per_rank(tag):
        values = {}
        for line in result.lines_starting(tag + " "):
            rank, _, rest = line.partition(" ")
            values[int(rank)] = rest
        assert sorted(values) == list(range(np)), (tag, result.output[-4000:])
        return values

    return {tag: per_rank(tag) for tag in ("MODEL", "TIME", "CACHED", "DECISIONS", "CROSSOVER", "DESCRIBE")}


@pytest.mark.parametrize("np", [2, 4])
def test_calibration_on_a_real_job(np):
    args = ["--oversubscribe"] if np > 2 else []
    result = ringrun(np, (JOBS / "cost_model_job.py").read_text(), timeout=100, ringrun_args=args)
    lines = parse(result, np)

    # every rank has the bit-identical model (floats printed as float.hex())
    models = set(lines["MODEL"].values())
    assert len(models) == 1, lines["MODEL"]
    fields = json.loads(models.pop())
    params = {k: (float.fromhex(v) if isinstance(v, str) else v) for k, v in fields.items()}
    assert params["size"] == np
    for name in ("alpha", "beta", "gamma1", "gamma2", "select_s_per_element"):
        assert params[name] > 0, (name, params)
    # alpha is the data's latency without the coordinator round trip: on shared memory it
    # can be lost in timing noise and sit at the floor.
    assert cost_model.MIN_ALPHA <= params["alpha"] < 50e-3, params
    assert 1e-12 < params["beta"] < 1e-6, params
    assert 1e-11 < params["gamma1"] < 1e-5, params        # 10 ps .. 10 us per scattered entry
    assert 1e-13 < params["gamma2"] < 1e-6, params        # 0.1 ps .. 1 us per added element
    assert 1e-12 < params["select_s_per_element"] < 1e-6, params
    m = CostModel(**params)

    # fast enough, run once per job (second calibrated() call returns the cached object)
    assert all(float(t) < 5.0 for t in lines["TIME"].values()), lines["TIME"]
    assert set(lines["CACHED"].values()) == {"True"}

    # decisions: the same on every rank, recomputed here identically, and consistent with
    # crossover(): dense below it, sparse from it on
    assert len(set(lines["DECISIONS"].values())) == 1 and len(set(lines["CROSSOVER"].values())) == 1
    decisions = {int(n): choice for n, choice in json.loads(lines["DECISIONS"][0]).items()}
    assert decisions == {n: ("sparse" if m.prefers_sparse(n, 0.001) else "dense") for n in decisions}
    crossover = m.crossover(0.001)
    assert lines["CROSSOVER"][0] == str(crossover)
    if crossover is not None:
        assert all((choice == "sparse") == (n >= crossover) for n, choice in decisions.items()), decisions
    # Which side wins for large tensors is the machine's answer, not ringmaster's: per
    # element the dense allreduce moves 2(p-1)/p * 4 B, the sparse path pays its selection.
    # On this project's 2-core VM the two are close at both sizes and the answer changes
    # from run to run, so it is not asserted: at 2 ranks dense 4 B at 1-2 GB/s against 3-4 ns
    # of selection; at 4 oversubscribed ranks, with torch's huge pages (common/huge_pages.py),
    # beta 0.75-1.03 ns/B, so dense 4.6-6.3 ns per element against 4.2-5.2 ns of selection.
    # No assertion that 1e3 elements go dense: in RedSync's model one allgather round
    # (log2(p)*alpha, ~1 ms here) against the allreduce's two makes sparse the cheaper
    # choice for small tensors too (see worker/compression/cost_model.py); crossover is 1 on this machine.

    # describe() on every rank, logged once at INFO, by rank 0 only
    assert len(set(lines["DESCRIBE"].values())) == 1 and "ns/byte" in lines["DESCRIBE"][0]
    logged = [line for line in result.output.splitlines() if "RedSync cost model" in line and "INFO" in line]
    assert len(logged) == 1 and logged[0].startswith("[0]: "), logged
    # rank 0 printed the decision table
    assert "tensors sparse" in result.stdout and "fc1.weight" in result.stdout


def test_fixed_sparse_cost_keeps_small_tensors_dense_and_moves_the_crossover():
    """Without a per-tensor cost Eq. 1 sends the smallest tensors sparse; with it they go dense."""
    plain = model(size=2)
    assert plain.prefers_sparse(100, 0.001)
    fixed = model(size=2, sparse_fixed_s=2e-3)
    assert fixed.t_sparse(100, 0.001) == pytest.approx(plain.t_sparse(100, 0.001) + 2e-3)
    assert not fixed.prefers_sparse(100, 0.001)
    cross = fixed.crossover(0.001)
    assert cross is not None and cross > 1
    assert not fixed.prefers_sparse(cross - 1, 0.001) and fixed.prefers_sparse(cross, 0.001)
    assert all(fixed.prefers_sparse(m, 0.001) for m in (cross, 2 * cross, 10 * cross))
    assert "fixed per sparse tensor" in fixed.describe()
    with pytest.raises(ValueError, match="sparse_fixed_s"):
        model(sparse_fixed_s=-1.0)
