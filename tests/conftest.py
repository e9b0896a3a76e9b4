"""Shared pytest set-up: tests marked ``cuda`` skip, with the reason, where no GPU is usable;
without a GPU, Triton (if installed) interprets its kernels on the CPU. A CUDA device given
as a parameter to a test without the mark is refused at collection, and so is a run without
pytest-timeout."""

from __future__ import annotations

import functools
import os

import pytest
import tiers


@functools.lru_cache(maxsize=None)
def gpu_missing_reason() -> str:
    """Why GPU tests cannot run here ("" when they can): torch CUDA and CuPy are both needed."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (CPU build or no device)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install -e '.[gpu-cuda12]' or '.[gpu-cuda13]')"
    return ""


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is not active: every test's time limit would be ignored "
                                "(pip install -e '.[test]', and do not pass -p no:timeout)")
    # Triton decides between compiling and interpreting when triton.language is first
    # imported, and torch may import it early: without a GPU, interpret from the start
    # (tests/test_gpu_compression.py runs compression's kernels so, as "triton").
    if gpu_missing_reason():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _is_cuda_device(value) -> bool:
    if isinstance(value, str):
        return value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit())
    return type(value).__name__ == "device" and getattr(value, "type", None) == "cuda"


def unmarked_cuda_parameters(items) -> list:
    """The collected tests given a CUDA device as a parameter without the ``cuda`` mark (the
    device check runs ``-m cuda``: those would run on no machine). tests/cuda_markers.py
    finds the rest, in the source."""
    return [item.nodeid for item in items if item.get_closest_marker("cuda") is None
            and any(_is_cuda_device(v) for v in getattr(getattr(item, "callspec", None), "params", {}).values())]


def mark_quick_tier(items) -> None:
    """Mark ``quick`` the tests tests/tiers.py names; a name that matches nothing is an error
    (only where the whole suite was collected: a run of one file collects less)."""
    names = tiers.quick_names()
    matched = set()
    for item in items:
        name = tiers.is_quick(item.nodeid, names)
        if name:
            item.add_marker(pytest.mark.quick)
            matched.add(name)
    collected_files = {item.nodeid.split("::")[0] for item in items}
    missing = [name for name in names if name not in matched and name.split("::")[0] in collected_files]
    if missing:
        raise pytest.UsageError("tests/tiers.py names tests that do not exist (renamed?): " + ", ".join(missing))


def pytest_collection_modifyitems(config, items):
    mark_quick_tier(items)
    unmarked = unmarked_cuda_parameters(items)
    if unmarked:
        raise pytest.UsageError("tests given a CUDA device without the cuda mark (mark them, e.g. "
                                "pytest.param('cuda', marks=pytest.mark.cuda)): " + ", ".join(unmarked))
    reason = gpu_missing_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the mark, not a parameter id that reads "cuda"
            item.add_marker(skip)
