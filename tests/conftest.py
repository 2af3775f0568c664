"""Markers and the backend/rank choices every multi-rank test uses.

- Host tests run everywhere on PYHIPA2A_TEST_RANKS ranks (default 4).
- Tests marked `gpu` run on the GPU backend (hip or cuda, whichever finds a
  device) on PYHIPA2A_TEST_GPU_RANKS ranks (default: one per visible GPU);
  they are skipped, with the reason, where no GPU is present.
"""
from __future__ import annotations

import os
from functools import lru_cache

import pytest


@lru_cache(maxsize=1)
def gpu_count() -> int:
    from pyhipa2a.runtime import _make
    for name in ("hip", "cuda"):
        try:
            n = _make(name).device_count()
        except Exception:
            continue
        if n:
            return n
    return 0


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU (hip or cuda backend); skipped where none is present")


def pytest_collection_modifyitems(config, items):
    if gpu_count():
        return
    skip = pytest.mark.skip(reason="no GPU: hip and cuda backends found no device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def host_ranks() -> int:
    return int(os.environ.get("PYHIPA2A_TEST_RANKS", "4"))


def gpu_ranks() -> int:
    return int(os.environ.get("PYHIPA2A_TEST_GPU_RANKS", "0")) or gpu_count()


# Parametrize a test over backends: host always, the GPU where one exists.
BACKENDS = [pytest.param("host", id="host"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def ranks_for(backend: str) -> int:
    return host_ranks() if backend == "host" else gpu_ranks()


def env_backend(backend: str):
    """PYHIPA2A_BACKEND for the job: 'host', or None to let the library find the GPU."""
    return "host" if backend == "host" else None
