"""Markers and the backend/rank choices every multi-rank test uses.

- Host tests run everywhere on PYHIPA2A_TEST_RANKS ranks (default 4).
- Tests marked `gpu` run on the GPU backend (hip or cuda, whichever finds a
  device) on PYHIPA2A_TEST_GPU_RANKS ranks (default: one per visible GPU);
  they are skipped, with the reason, where no GPU is present.
"""
from __future__ import annotations

import pytest

from tests.mpi_harness import gpu_count


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU (hip or cuda backend); skipped where none is present")


def pytest_collection_modifyitems(config, items):
    if gpu_count():
        return
    skip = pytest.mark.skip(reason="no GPU: hip and cuda backends found no device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


