"""dispatch(groups=G) (pyhipa2a.groups): the caller's expert group by group between wait_group and group_done, in
any order, each layout, against the oracle; what groups= refuses. Host backend at 1-4 ranks, and GPUs."""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, REPO, env_backend, ranks_for, run_case, run_mpi

CASE = "tests.cases.groups_cases:"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order,row_layout,G", [("forward", "packed", 4), ("reverse", "contiguous/8", 3),
                                                ("shuffled", "by_source", 8), ("shuffled", "contiguous", 1)])
def test_groups(order, row_layout, G, backend):
    run_case(CASE + "case_groups", ranks_for(backend), env_backend(backend), args=(order, row_layout, G),
             timeout=300)


@pytest.mark.parametrize("ranks", [1, 3])
def test_groups_at_other_world_sizes(ranks):
    run_case(CASE + "case_groups", ranks, "host", args=("shuffled", "contiguous/8", 5, 2), timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_refusals(backend):
    run_case(CASE + "case_groups_refusals", ranks_for(backend), env_backend(backend), timeout=120)


def test_groups_across_nodes_refused():
    run_case(CASE + "case_groups_across_nodes_refused", 4, "host", timeout=120)


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_script(backend):
    """scripts/moe_layer.py: the SwiGLU layer on the contiguous layout, in sequence and overlapped by groups,
    against the dense layer (small shapes: timings are not tested)."""
    pytest.importorskip("torch")
    run = run_mpi([str(REPO / "scripts" / "moe_layer.py"), "--tokens", "24", "--experts-per-rank", "4", "--top-k",
                   "3", "--hidden", "256", "--intermediate", "128", "--groups", "3", "--iters", "1"],
                  ranks_for(backend), env_backend(backend), timeout=300, what="moe_layer.py")
    assert run.stdout.count(": PASS (") == ranks_for(backend) and "moe_layer: PASS" in run.stdout, run.stdout
