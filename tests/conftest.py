"""Shared pytest set-up: tests marked ``cuda`` skip, with the reason, where no GPU is usable;
without a GPU, Triton (if installed) interprets its kernels on the CPU."""

from __future__ import annotations

import functools
import os

import pytest


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
    # Triton decides between compiling and interpreting when triton.language is first
    # imported, and torch may import it early: without a GPU, interpret from the start
    # (tests/test_gpu_compression.py runs compression's kernels so, as "triton").
    if gpu_missing_reason():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    reason = gpu_missing_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
