"""Symmetric heap under MPI: exchange, translate, fingerprint, exhaustion, self-test, teardown."""
from __future__ import annotations

import os

import pytest

from tests.mpi_harness import BACKENDS, env_backend, host_ranks, ranks_for, run_case
from pyhipa2a.runtime import get_backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_exchange", "case_fingerprint_mismatch", "case_exhausted",
                                  "case_self_test", "case_close_idempotent"])
def test_heap(case, backend):
    run_case(f"tests.cases.heap_cases:{case}", ranks_for(backend), env_backend(backend))


def shm_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("pyhipa2a-")}


def test_host_heap_leaves_no_shared_memory_files():
    before = shm_files()
    run_case("tests.cases.heap_cases:case_left_open", host_ranks(), "host")
    run_case("tests.cases.heap_cases:case_close_idempotent", host_ranks(), "host")
    assert shm_files() - before == set()


def test_self_test_eight_ranks():
    run_case("tests.cases.heap_cases:case_self_test", 8, "host", args=("1024",))


def test_unknown_backend_lists_choices(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'opencl'; choose one of: hip, cuda, host"):
        get_backend("opencl")
    monkeypatch.setenv("PYHIPA2A_BACKEND", "metal")
    with pytest.raises(ValueError, match="unknown backend 'metal'"):
        get_backend()
