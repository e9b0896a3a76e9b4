"""Autotuning (RINGMASTER_AUTOTUNE): the search, rank 0's sampling and log, and real jobs where
every rank must apply rank 0's settings at the same place in the order and results stay exact."""

import csv
import json
import pathlib

import pytest

from mpijob import mpirun
from ringmaster.common.config import Config, ConfigError, load_config
from ringmaster.coordinator.validation import request_problem, tuning_problem
from ringmaster.launch.cli import parse_args
from ringmaster.launch.environment import tuning_environment
from ringmaster.proto import ringmaster_pb2 as pb
from ringmaster.worker.runtime.autotune import (CSV_COLUMNS, Autotuner, reduced_bytes, search_space,
                                                setting_of, tuning_message)
from ringmaster.worker.runtime.autotune_search import CoordinateSearch, Dimension

JOB = (pathlib.Path(__file__).parent / "jobs" / "autotune_job.py").read_text()

DIMENSIONS = [Dimension("a", (1, 2, 3), 1), Dimension("b", ("x", "y"), "x"), Dimension("c", (0,), 0)]


def run_search(search, score_of):
    while not search.done:
        search.report(score_of(search.next_setting()))
    return search.best


# ------------------------------------------------------------------ the search
def test_search_finds_the_best_of_a_separable_score():
    search = CoordinateSearch(DIMENSIONS)
    best = run_search(search, lambda s: {1: 10, 2: 30, 3: 20}[s["a"]] + (5 if s["b"] == "y" else 0))
    assert best == {"a": 2, "b": "y", "c": 0}
    phases = [trial.phase for trial in search.trials]
    # baseline, a=2, a=3 (a=1 reused), b=y (b=x reused), then 2 x (defaults, choice); c has one value
    assert phases == ["baseline", "a", "a", "b", "confirm", "confirm", "confirm", "confirm"]
    assert [t.number for t in search.trials] == list(range(1, 9))


def test_search_keeps_the_defaults_when_nothing_beats_them_by_the_margin():
    search = CoordinateSearch(DIMENSIONS, margin=0.05)
    best = run_search(search, lambda s: 100 + (3 if s["a"] == 3 else 0))  # 3 % better: noise
    assert best == search.defaults
    assert "confirm" not in [t.phase for t in search.trials]


def test_confirmation_falls_back_to_the_defaults_when_the_gain_was_luck():
    scores = iter([100, 100, 150, 100] + [100] * 6)  # a=3 looked 50 % better once
    search = CoordinateSearch(DIMENSIONS, confirm=3)
    best = run_search(search, lambda s: next(scores))
    assert search.trials[2].setting["a"] == 3 and search.trials[2].score == 150
    assert best == search.defaults


def test_search_repeats_each_setting_and_reports_medians():
    search = CoordinateSearch([Dimension("a", (1, 2), 1)], repeats=3, confirm=0)
    samples = iter([1, 9, 2, 50, 60, 1])
    best = run_search(search, lambda s: next(samples))
    assert search.score({"a": 1}) == 2 and search.score({"a": 2}) == 50 and best == {"a": 2}
    assert len(search.trials) == 6


def test_search_interface_errors():
    with pytest.raises(ValueError, match="default 5 is not among"):
        Dimension("a", (1, 2), 5)
    search = CoordinateSearch([Dimension("a", (1,), 1)])
    assert search.next_setting() == {"a": 1} and search.next_setting() == {"a": 1}
    search.report(1.0)
    assert search.done and search.best == {"a": 1}
    with pytest.raises(RuntimeError, match="over"):
        search.report(2.0)


def test_search_space_follows_the_configuration():
    dims = {d.name: d for d in search_space(Config(fusion_threshold_bytes=3 << 20, cycle_time_ms=7), 2, True)}
    assert dims["fusion_threshold_bytes"].default == 3 << 20 and 3 << 20 in dims["fusion_threshold_bytes"].values
    assert dims["cycle_time_ms"].default == 7.0 and dims["cache_enabled"].values == (False, True)
    fixed = {d.name: d for d in search_space(Config(allreduce_algorithm="ring"), 4, False)}
    assert len(fixed["ring_min_bytes"].values) == 1 and fixed["cache_enabled"].values == (True,)


# ------------------------------------------------------- rank 0's sampling and log
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def allreduce_list(sequence, names, elements=1000):
    responses = [pb.Response(op_type=pb.ALLREDUCE, names=[name], dtype="float32",
                             shapes=[pb.TensorShape(dims=[elements])]) for name in names]
    return pb.ResponseList(sequence=sequence, responses=responses)


def test_rank0_samples_scores_sends_and_logs(tmp_path):
    log_path = tmp_path / "tune.csv"
    config = Config(autotune=True, autotune_log=str(log_path), autotune_warmup_samples=1,
                    autotune_steps_per_sample=2)
    sent, cycles, clock = [], [], FakeClock()
    tuner = Autotuner(0, 2, config, send=sent.append, set_cycle_time=cycles.append, clock=clock)
    sequence = 0

    def steps(count, seconds_each):
        nonlocal sequence
        for _ in range(count):
            sequence += 1
            clock.now += seconds_each
            tuner.observe(allreduce_list(sequence, ["w", "b"]))

    steps(2, 1.0)  # warmup sample
    assert not sent
    steps(2, 0.5)  # trial 1: the defaults, 2 x 8000 bytes in 1 s
    assert len(sent) == 1 and sent[0].tuning.trial == 2
    steps(3, 0.5)  # nothing is measured until the AUTOTUNE response comes up
    tuner.apply(sent[0].tuning, sequence)
    assert cycles == [sent[0].tuning.cycle_time_ms / 1000] and tuner.applied[0].trial == 2
    while tuner.active and len(sent) < 100:
        if sent[-1].tuning.final:
            tuner.apply(sent[-1].tuning, sequence)
            break
        steps(2, 0.5)
        tuner.apply(sent[-1].tuning, sequence)
    assert sent[-1].tuning.final and not tuner.active
    rows = list(csv.reader(log_path.open()))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert rows[1][:2] == ["0", "warmup"] and float(rows[1][-1]) == pytest.approx(16000 / 2.0)
    assert rows[2][:2] == ["1", "baseline"] and rows[2][6:8] == ["16000", "1.000000"]
    assert float(rows[2][8]) == pytest.approx(16000.0)
    assert [int(r[0]) for r in rows[2:-1]] == list(range(1, len(rows) - 2))
    assert rows[-1][1] == "final" and rows[-1][0] == ""
    assert setting_of(sent[-1].tuning) == {"fusion_threshold_bytes": int(rows[-1][2]),
                                           "cycle_time_ms": float(rows[-1][3]),
                                           "ring_min_bytes": int(rows[-1][4]), "cache_enabled": rows[-1][5] == "1"}
    steps(5, 1.0)  # after the final choice nothing is measured or sent
    assert sent[-1].tuning.final and len(rows) == len(list(csv.reader(log_path.open())))


def test_other_ranks_only_apply(tmp_path):
    config = Config(autotune=True, autotune_log=str(tmp_path / "x.csv"), autotune_warmup_samples=0,
                    autotune_steps_per_sample=1)
    sent, cache = [], []
    tuner = Autotuner(1, 2, config, send=sent.append, set_cycle_time=lambda s: None, set_cache_enabled=cache.append)
    for sequence in range(1, 20):
        tuner.observe(allreduce_list(sequence, ["w"]))
    setting = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 0.5, "ring_min_bytes": 4 << 20,
               "cache_enabled": False}
    tuner.apply(tuning_message(2, setting), 20)
    assert not sent and not (tmp_path / "x.csv").exists()
    assert cache == [False] and tuner.ring_scale == 4.0 and tuner.applied[0].sequence == 20


def test_reduced_bytes_counts_reductions_only():
    assert reduced_bytes(allreduce_list(1, ["a", "b"], 10).responses[0]) == 40
    assert reduced_bytes(pb.Response(op_type=pb.ALLGATHER, dtype="float32", shapes=[pb.TensorShape(dims=[9])])) == 0
    assert reduced_bytes(pb.Response(op_type=pb.ALLREDUCE, dtype="float64", error_kind=pb.MISMATCH,
                                     shapes=[pb.TensorShape(dims=[9])])) == 0


# ------------------------------------------------------------ settings and checks
@pytest.mark.parametrize("variable,value,words", [
    ("RINGMASTER_AUTOTUNE", "maybe", ["RINGMASTER_AUTOTUNE", "1 or 0"]),
    ("RINGMASTER_AUTOTUNE_LOG", "/no/such/dir/t.csv", ["RINGMASTER_AUTOTUNE_LOG", "does not exist"]),
    ("RINGMASTER_AUTOTUNE_STEPS_PER_SAMPLE", "0", ["RINGMASTER_AUTOTUNE_STEPS_PER_SAMPLE", ">= 1"]),
    ("RINGMASTER_AUTOTUNE_WARMUP_SAMPLES", "-1", ["RINGMASTER_AUTOTUNE_WARMUP_SAMPLES", ">= 0"]),
])
def test_bad_autotune_settings_name_the_variable(variable, value, words):
    with pytest.raises(ConfigError) as caught:
        load_config({variable: value})
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_ringrun_flags_set_the_variables(tmp_path):
    args = parse_args(["--autotune", "--autotune-log-file", str(tmp_path / "a.csv"), "--autotune-warmup-samples", "0",
                       "--autotune-steps-per-sample", "4", "python", "x.py"])
    env = tuning_environment({name: getattr(args, name) for name in (
        "autotune", "autotune_log_file", "autotune_warmup_samples", "autotune_steps_per_sample")})
    config = load_config(env)
    assert config.autotune and config.autotune_log == str(tmp_path / "a.csv")
    assert config.autotune_warmup_samples == 0 and config.autotune_steps_per_sample == 4


def test_the_coordinator_takes_tuning_from_rank_0_only():
    good = tuning_message(3, {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 1.0, "ring_min_bytes": 0,
                              "cache_enabled": True})
    assert tuning_problem(good, 0) is None
    assert "rank 0" in tuning_problem(good, 1).describe()
    assert tuning_problem(pb.Tuning(cycle_time_ms=float("nan")), 0).field == "cycle_time_ms"
    assert tuning_problem(pb.Tuning(fusion_threshold_bytes=-1), 0).field == "fusion_threshold_bytes"
    request = pb.TensorRequest(name="t", op_type=pb.AUTOTUNE, dtype="float32")
    assert "Tuning message" in request_problem(request, size=2, max_group_size=10).describe()


# ------------------------------------------------------------------- real jobs
@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 4])
def test_every_rank_applies_rank0s_settings_at_the_same_place_and_results_stay_exact(np, tmp_path):
    log_path = tmp_path / "autotune.csv"
    result = mpirun(np, JOB, timeout=140, env={
        "RINGMASTER_AUTOTUNE": "1", "RINGMASTER_AUTOTUNE_LOG": str(log_path),
        "RINGMASTER_AUTOTUNE_WARMUP_SAMPLES": "1", "RINGMASTER_AUTOTUNE_STEPS_PER_SAMPLE": "1"})
    assert not [line for line in result.stdout.splitlines() if line.startswith("FAIL")], result.output[-3000:]
    done = result.lines_starting("DONE")
    assert len(done) == np and all(line.endswith("0 failures, final True") for line in done), result.output[-3000:]
    applied = result.lines_starting("APPLIED")
    assert len(applied) == np and len(set(applied)) == 1, applied  # same settings, same list numbers
    history = json.loads(applied[0])
    assert len(history) >= 5 and history[-1][3] is True
    assert [entry[1] for entry in history[:-1]] == list(range(2, len(history) + 1))
    crossovers = {entry[2]["ring_min_bytes"] for entry in history}
    fusions = {entry[2]["fusion_threshold_bytes"] for entry in history}
    assert len(crossovers) >= 3 and len(fusions) >= 3  # the job really ran under several settings
    rows = list(csv.DictReader(log_path.open()))
    assert rows[0]["phase"] == "warmup" and rows[-1]["phase"] == "final"
    trials = [row for row in rows if row["phase"] not in ("warmup", "final")]
    assert [int(row["trial"]) for row in trials] == list(range(1, len(trials) + 1))
    assert all(float(row["score_bytes_per_s"]) > 0 and int(row["bytes"]) > 0 for row in trials)
    final = history[-1][2]
    assert (int(rows[-1]["fusion_threshold_bytes"]), int(rows[-1]["ring_min_bytes"])) == (
        final["fusion_threshold_bytes"], final["ring_min_bytes"])
    assert result.returncode == 0


def test_the_cache_knob_is_searched_only_where_there_is_a_cache():
    from types import SimpleNamespace

    from ringmaster.worker.runtime.autotune import attach

    def runtime(cache):
        return SimpleNamespace(rank=1, size=2, config=Config(autotune=True), cache=cache,
                               executor=SimpleNamespace(autotune=None), set_cache_enabled=lambda on: None,
                               outbox=SimpleNamespace(put_control=lambda m: None, set_cycle_time=lambda s: None))

    without, with_cache = runtime(None), runtime(object())
    attach(without)
    attach(with_cache)
    assert {d.name: d for d in without.executor.autotune.search.dimensions}["cache_enabled"].values == (True,)
    assert {d.name: d for d in with_cache.executor.autotune.search.dimensions}["cache_enabled"].values == (False, True)
