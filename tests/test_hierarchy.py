"""Calls across nodes (pyhipa2a.hierarchy): ranks split into simulated nodes, checked against the oracle.

Host backend: 4 ranks as 2 nodes of 2 (PYHIPA2A_TEST_RANKS does not apply: the layouts are the
point), one check at 8 ranks as 2 nodes of 4. GPU (marked): one node per GPU, NCCL between them
(PYHIPA2A_INTERNODE=mpi stages through the host instead, for ranks that share a GPU).
"""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, REPO, env_backend, gpu_ranks, run_case, run_mpi

CASE = "tests.cases.hierarchy_cases:"


def layout_for(backend: str) -> tuple[int, int]:
    """(ranks, ranks per node)."""
    return (4, 2) if backend == "host" else (gpu_ranks(), max(1, gpu_ranks() // 2))


# (E per rank, k, H, M, dtype, token counts, where the experts are, fused expert)
CASES = {
    "random": (4, 4, 256, 16, "float16", "random", "random", "0"),
    "bf16_full": (2, 3, 1000, 8, "bfloat16", "full", "random", "0"),
    "only_other_nodes": (4, 2, 128, 8, "float16", "full", "other", "0"),
    "only_own_node": (4, 2, 128, 8, "float16", "full", "own", "0"),
    "no_tokens": (2, 2, 64, 4, "float16", "empty", "random", "0"),
    "some_ranks_empty": (4, 3, 264, 8, "float16", "some_empty", "random", "0"),
    "k1": (2, 1, 128, 8, "float16", "random", "random", "0"),
    "fused_expert": (4, 4, 512, 16, "float16", "random", "random", "1"),
    "hidden_1001": (2, 2, 1001, 8, "float16", "random", "random", "0"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_nodes_against_oracle(name, backend):
    ranks, G = layout_for(backend)
    E_per_rank, k, H, M, dtype, counts, where, fused = CASES[name]
    run_case(CASE + "case_nodes", ranks, env_backend(backend),
             args=(G, E_per_rank * ranks, k, H, M, dtype, counts, where, fused, 2, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_nodes_meta_names_true_source", "case_nodes_graph", "case_nodes_bad_inputs"])
def test_nodes_cases(case, backend):
    ranks, G = layout_for(backend)
    run_case(CASE + case, ranks, env_backend(backend), args=(G,))


@pytest.mark.parametrize("who", ["node", "rank"])
def test_node_that_never_arrives_host(who):
    run_case(CASE + "case_nodes_peer_never_arrives", 4, "host", args=(2, who), timeout=240)


@pytest.mark.gpu
def test_node_that_never_arrives_gpu():
    ranks, G = layout_for("gpu")
    run_case(CASE + "case_nodes_peer_never_arrives", ranks, None, args=(G, "node"), timeout=240)


def test_bad_ranks_per_node_host():
    run_case(CASE + "case_nodes_bad_config", 4, "host")
    run_case(CASE + "case_nodes_rank_layout", 4, "host")


def test_check_script_two_nodes_of_four_host():
    """check.py at 8 ranks as 2 nodes of 4 (issue 21's host target), on the smaller test shapes."""
    run = run_mpi([str(REPO / "scripts" / "check.py"), "--rounds", "1", "--max-hidden", "2880"], 8, "host",
                  timeout=900, env={"PYHIPA2A_RANKS_PER_NODE": "4"}, what="check.py, 2 nodes of 4")
    rows = [line for line in run.stdout.splitlines() if line.startswith("E=")]
    assert rows and all(" PASS " in r for r in rows), run.stdout
    assert "2 nodes of 4 ranks" in run.stdout and "check: PASS" in run.stdout, run.stdout
