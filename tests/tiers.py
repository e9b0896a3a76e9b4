"""The suite's fast tier (``python -m pytest -m quick``): the inner loop's run, a few minutes on
2 cores, touching every room. tests/conftest.py marks the tests named here ``quick``; what the
tier holds and what it costs is in docs/testing.md.

Each entry is a test file (every test in it) or a test's node id without its parameters (every
parametrization of it). A name that matches no collected test is an error, so that a renamed
test cannot drop out of the tier unseen.
"""

from __future__ import annotations

#: room -> the tests that stand for it: in-process files whole, and the one or two multi-rank
#: jobs that cross it end to end.
QUICK = {
    "proto and the coordinator": [
        "tests/test_protocol.py",
        "tests/test_coordinator_negotiation.py",
        "tests/test_coordinator_validation.py",
        "tests/test_coordinator_generation.py",
        "tests/test_host_liveness.py",
    ],
    "the worker's runtime": [
        "tests/test_cache_schedules.py",
        "tests/test_waiting.py",
        "tests/test_stream_writer.py",
        "tests/test_response_cache.py::test_cached_collectives_equal_the_negotiated_ones",
    ],
    "the frontend": [
        "tests/test_collectives.py::test_collectives_match_the_single_process_reference",
        "tests/test_optimizer.py::test_distributed_optimizer_equals_one_process_on_the_whole_batch",
        "tests/test_failures.py::test_a_stall_warning_names_the_missing_rank",
    ],
    "compression": [
        "tests/test_quantization.py",
        "tests/test_selection.py",
        "tests/test_cost_model.py",
        "tests/test_compression.py::test_int8_and_linear8_allreduce_move_a_quarter_of_the_bytes",
    ],
    "ops": [
        "tests/test_ops_collectives.py::test_allreduce_every_op_dtype_length",
    ],
    "launch": [
        "tests/test_launch_command.py",
        "tests/test_launch_hosts.py",
        "tests/test_config.py",
        "tests/test_examples.py::test_quick_start_runs_and_ranks_agree",
    ],
    "layout, docs and the harness": [
        "tests/test_layout.py",
        "tests/test_docs.py",
        "tests/test_readme.py",
        "tests/test_pytest_config.py",
        "tests/test_warm_pool.py",
    ],
}


def quick_names() -> list:
    return [name for names in QUICK.values() for name in names]


def is_quick(nodeid: str, names) -> str:
    """The entry of ``names`` that ``nodeid`` falls under ("" if none)."""
    base = nodeid.split("[", 1)[0]
    for name in names:
        if base == name or base.startswith(name + "::") or (name.endswith(".py") and base.startswith(name)):
            return name
    return ""
