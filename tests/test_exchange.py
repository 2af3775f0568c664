"""The exchange against the oracle under MPI, on the host backend and (marked gpu) on GPUs: gpu-mode's
shapes, edge cases, transfer modes and publish protocols, narrow partials, the fused expert, combine's
two kernels, launch geometry and sites."""
from __future__ import annotations


import pytest

from tests.mpi_harness import (BACKENDS, REPO, SHAPES, TRANSFER_MODES, env_backend, ranks_for, run_case,
                                run_mpi, shape_id)

CASE = "tests.cases.exchange_cases:"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES["tests"], ids=shape_id)
def test_gpumode_test_shapes(shape, backend):
    ranks = ranks_for(backend)
    if shape["num_experts"] % ranks:
        pytest.skip(f"{shape['num_experts']} experts do not divide over {ranks} ranks")
    run_case(CASE + "case_shape", ranks, env_backend(backend),
             args=(shape["num_experts"], shape["experts_per_token"], shape["hidden_dim"],
                   shape["max_num_tokens"], "float16", "random", "random", 2, shape["seed"]))


def test_check_script_at_eight_ranks_host():
    """Users run 8 ranks: scripts/check.py, every gpu-mode test shape at its real world size (8),
    on the host backend (the same Python stack and protocol; the host twins stand in for the kernels)."""
    run = run_mpi([str(REPO / "scripts" / "check.py"), "--rounds", "1"], 8, "host", timeout=900, what="check.py")
    rows = [line for line in run.stdout.splitlines() if line.startswith("E=")]
    assert len(rows) == len(SHAPES["tests"]) and all(" PASS " in r for r in rows), run.stdout
    assert "check: PASS" in run.stdout, run.stdout


# (E per rank, k, H, M, dtype, token counts, routing)
EDGE_CASES = {
    "some_ranks_empty": (4, 3, 256, 16, "float16", "some_empty", "random"),
    "all_ranks_empty": (2, 2, 64, 8, "float16", "all_empty", "random"),
    "T_equals_M": (4, 4, 512, 32, "float16", "full", "random"),
    "one_hot_expert_full_capacity": (4, 4, 256, 32, "float16", "full", "hot"),
    "k1": (4, 1, 384, 16, "float16", "random", "random"),
    "one_expert_per_rank": (1, 1, 256, 16, "float16", "full", "random"),
    "one_expert_per_rank_hot": (1, 1, 128, 8, "float16", "full", "hot"),
    "hidden_2880": (8, 4, 2880, 16, "float16", "random", "random"),
    "hidden_1000": (4, 2, 1000, 16, "float16", "random", "random"),
    "hidden_1001_unaligned_rows": (4, 3, 1001, 8, "float16", "random", "random"),
    "hidden_1001_some_empty": (4, 3, 1001, 8, "float16", "some_empty", "random"),
    "bf16": (8, 4, 2880, 16, "bfloat16", "random", "random"),
    "bf16_hot_full": (4, 2, 1000, 16, "bfloat16", "full", "hot"),
    # from 2 ranks on, more experts than dispatch's route counts in one pass (A2A_ROUTE_WINDOW)
    "experts_over_route_windows": (1024, 4, 128, 16, "float16", "full", "random"),
    # dispatch routes by chunks of tokens (kernels.route_chunk: 256 here, 8 chunks at T = M)
    "many_route_chunks": (4, 2, 64, 2048, "float16", "full", "random"),
    # expert_num_tokens sums W * route_chunks count words an expert, a group of lanes an expert
    # (publish_counts in dispatch.hip): here 3 chunks a rank (route_chunk 64 at k = 8), so the groups
    # have idle lanes (4 lanes for 3 words at one rank, 8 for 6 at two)
    "count_words_not_a_power_of_two": (32, 8, 128, 192, "float16", "full", "random"),
    # max_num_tokens = 1: one count word an expert at one rank (a warp counts a warp's width of experts
    # at once), and the smallest call on the whole grid
    "capacity_one_token": (128, 8, 256, 1, "float16", "full", "random"),
    # a small call (T = 4, k = 8) of crowded experts: at 2 ranks (E = 8) every token goes to every
    # expert, so each expert's rows from a source are all of its tokens; at 4 (E = 16), to half of them
    "small_call_every_expert": (4, 8, 256, 4, "float16", "full", "random"),
}


# AllToAll(row_layout="by_source"): each source's rows of an expert from row s * M on, as expert_layout
# says. The edge cases whose rows it places otherwise: sources with no tokens, full capacity and a hot
# expert (a source's whole region), several route chunks (a chunk's rows after its source's earlier
# chunks', not after other sources'), count words not a power of two, one-token capacity, crowded small
# calls, rows not whole words.
BY_SOURCE_EDGE_CASES = ("some_ranks_empty", "T_equals_M", "one_hot_expert_full_capacity", "many_route_chunks",
                        "count_words_not_a_power_of_two", "capacity_one_token", "small_call_every_expert",
                        "hidden_1001_unaligned_rows", "experts_over_route_windows", "bf16_hot_full")
# AllToAll(row_layout="contiguous"): every expert's rows in one buffer from expert_offsets[l], each
# expert's rounded up to row_align (the default 128, and 1, 8 and 3 here: every expert a few rows apart,
# none, and a row count no power of two). The edge cases for it: experts that receive nothing (their
# offsets equal), one expert holding a source's every row, several route chunks, more experts than a
# warp's width (publish_offsets takes 32 at a time), crowded small calls, rows not whole words.
CONTIGUOUS_EDGE_CASES = {"some_ranks_empty": "contiguous", "one_hot_expert_full_capacity": "contiguous/8",
                         "many_route_chunks": "contiguous/1", "experts_over_route_windows": "contiguous/3",
                         "small_call_every_expert": "contiguous/8", "hidden_1001_unaligned_rows": "contiguous"}
EDGE_RUNS = ([(name, "packed") for name in sorted(EDGE_CASES)]
             + [(name, "by_source") for name in BY_SOURCE_EDGE_CASES]
             + sorted(CONTIGUOUS_EDGE_CASES.items()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,row_layout", EDGE_RUNS)
def test_edge_cases(name, row_layout, backend):
    per_rank, k, H, M, dtype, counts, routing = EDGE_CASES[name]
    ranks = ranks_for(backend)
    E = per_rank * ranks
    if k > E:
        pytest.skip(f"k={k} > E={E} on {ranks} ranks")
    run_case(CASE + "case_shape", ranks, env_backend(backend),
             args=(E, k, H, M, dtype, counts, routing, 3, 11, row_layout))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", sorted(TRANSFER_MODES))
@pytest.mark.parametrize("H", [1000, 2048])
@pytest.mark.parametrize("row_layout", ["packed", "by_source", "contiguous/8"])
def test_transfer_modes(mode, H, row_layout, backend):
    env, counts = TRANSFER_MODES[mode]
    ranks = ranks_for(backend)
    run_case(CASE + "case_shape", ranks, env_backend(backend), env=env,
             args=(4 * ranks, 4, H, 64, "float16", counts, "random", 2, 5, row_layout))


# Flags over data left in the sender's memory follow a GPU-scope fence on sm_90 (and with
# PYHIPA2A_PUBLISH=gpu-fence), a system-scope release elsewhere and with =system
# (pyhipa2a.config.publish_with_gpu_fence); with the fence a pushed call pushes only its contributions back,
# so its tokens are pulled (exchange.h: A2A_PUSHED_TOKENS). Every protocol on every transfer mode,
# partial sums in fp32 and narrow; "mixed" has pushed and pulled calls in one exchange.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("publish", ["system", "gpu-fence"])
@pytest.mark.parametrize("mode", sorted(TRANSFER_MODES))
@pytest.mark.parametrize("narrow", ["0", "1"])
def test_publish_modes(publish, mode, narrow, backend):
    run_case(CASE + "case_fused_expert", ranks_for(backend), env_backend(backend),
             env={**TRANSFER_MODES[mode][0], "PYHIPA2A_PUBLISH": publish},
             args=(1024, "float16", "normal", narrow))


# Pushed calls in both protocols (PYHIPA2A_PUBLISH): pushed tokens (system) and pulled tokens with
# contributions pushed back (gpu-fence), on misaligned arrays.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,publish", [("pull", "auto"), ("push", "system"), ("push", "gpu-fence")])
@pytest.mark.parametrize("narrow", ["0", "1"])
def test_misaligned_device_arrays(mode, publish, narrow, backend):
    run_case(CASE + "case_misaligned_device_arrays", ranks_for(backend), env_backend(backend),
             env={**TRANSFER_MODES[mode][0], "PYHIPA2A_PUBLISH": publish}, args=(narrow,))


# (mode, H, dtype, values) for the narrow-partials tests: whole chunks in every transfer mode, on exact
# inputs (compared value for value) and on gpu-mode's; H=1001 takes the element-wise paths, and never
# pushes (pushed rows are whole 8-element chunks), so it runs pulled only.
NARROW_CASES = ([(m, 1024, "float16", v) for m in sorted(TRANSFER_MODES) for v in ("exact", "normal")]
                + [(m, 1000, "bfloat16", v) for m in sorted(TRANSFER_MODES) for v in ("exact", "normal")]
                + [("pull", 1001, dt, "exact") for dt in ("float16", "bfloat16")])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,H,dtype,values", NARROW_CASES)
def test_narrow_partials(mode, H, dtype, values, backend):
    """Partial sums in the output's format, against the oracle of that contract."""
    run_case(CASE + "case_narrow_partials", ranks_for(backend), env_backend(backend),
             env=TRANSFER_MODES[mode][0], args=(H, dtype, values))


# (mode, narrow partials, H, dtype, values) for an expert fused into combine (expert_scale): every
# transfer mode, fp32 and narrow partials, on exact inputs (value for value); gpu-mode's inputs; bf16;
# and H=1001, whose rows take the element-wise paths (pulled only). Misaligned expert_y with a scale:
# test_misaligned_device_arrays.
FUSED_CASES = ([(m, n, 1024, "float16", "exact") for m in sorted(TRANSFER_MODES) for n in ("0", "1")]
               + [("mixed", "0", 1024, "float16", "normal"), ("mixed", "1", 1000, "bfloat16", "exact"),
                  ("pull", "0", 1001, "float16", "exact"), ("pull", "1", 1001, "bfloat16", "exact")])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,narrow,H,dtype,values", FUSED_CASES)
def test_fused_expert(mode, narrow, H, dtype, values, backend):
    """combine(d.expert_x, w, expert_scale=s): an expert with no kernel of its own, against its oracle."""
    run_case(CASE + "case_fused_expert", ranks_for(backend), env_backend(backend),
             env=TRANSFER_MODES[mode][0], args=(H, dtype, values, narrow))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode,narrow", [("push", "1"), ("mixed", "0"), ("pull", "0")])
@pytest.mark.parametrize("row_layout", ["by_source", "contiguous/8"])
def test_fused_expert_rows_laid_out(mode, narrow, row_layout, backend):
    """The fused expert reads its rows where dispatch left them, laid out by source or contiguous too (exact
    inputs)."""
    run_case(CASE + "case_fused_expert", ranks_for(backend), env_backend(backend),
             env=TRANSFER_MODES[mode][0],
             args=(1024, "float16", "exact", narrow, 2, row_layout))


# Combine has a bulk kernel (a warp a segment) and a small one (a warp a chunk), chosen per call from
# its tokens (pyhipa2a.legs.settle_geometry); the test shapes are small, so the default takes the small
# one almost everywhere. Each is forced here over the paths where they differ: pulled, pushed and mixed
# contributions, partial sums in fp32 and narrow, the fused expert, element-wise rows (H=1001), bf16,
# and a call large enough for several items a warp. The host twin is one kernel for both.
COMBINE_KERNEL_CASES = {  # name: (case, transfer mode (TRANSFER_MODES; None: the defaults), its arguments)
    "pull": ("case_shape", "pull", (8, 4, 2048, 64, "float16", "full", "random", 2, 3)),
    "push": ("case_shape", "push", (8, 4, 2048, 64, "float16", "full", "random", 2, 3)),
    "mixed": ("case_shape", "mixed", (8, 4, 1000, 64, "float16", "staggered", "random", 2, 3)),
    "posted": ("case_shape", "posted", (8, 4, 1000, 64, "float16", "staggered", "random", 2, 3)),
    "k8_large": ("case_shape", None, (16, 8, 7168, 256, "bfloat16", "full", "random", 2, 4)),
    "unaligned_rows": ("case_shape", None, (8, 3, 1001, 16, "float16", "random", "random", 2, 5)),
    "narrow_push": ("case_narrow_partials", "push", (1024, "float16", "exact")),
    "narrow_pull": ("case_narrow_partials", "pull", (1000, "bfloat16", "exact")),
    "narrow_posted": ("case_narrow_partials", "posted", (1000, "bfloat16", "exact")),
    "fused_push_narrow": ("case_fused_expert", "push", (1024, "float16", "exact", "1")),
    "fused_mixed": ("case_fused_expert", "mixed", (1024, "float16", "normal", "0")),
    "fused_posted": ("case_fused_expert", "posted", (1024, "float16", "normal", "0")),
    # a last segment of 512 elements (parts past the row's end) and of 832 (a part of 64)
    "hidden_2560": ("case_shape", None, (8, 4, 2560, 32, "float16", "random", "random", 2, 6)),
    "hidden_2880_pull": ("case_shape", "pull", (8, 4, 2880, 32, "bfloat16", "random", "random", 2, 7)),
}


# Calls with more tokens than the grid has warps take whole tokens, then segments (prefill sizes; here a
# grid of one block), in dispatch's fan-out and in combine's bulk kernel (PYHIPA2A_COMBINE_KERNEL=bulk), its
# contributions pulled (a flag a segment), posted (a token's flags after one release) or pushed back, and
# its reduce: the GPU kernels' item order, which the host twins do not model.
@pytest.mark.gpu
@pytest.mark.parametrize("row_layout,dispatch_dtype,counts,mode", [
    ("packed", "", "random", "pull"), ("packed", "", "random", "push"), ("packed", "", "full", "posted"),
    ("contiguous/8", "", "staggered", "mixed"), ("contiguous/8", "", "staggered", "push"),
    ("by_source", "float8_e4m3", "full", "pull"), ("by_source", "float8_e4m3", "full", "push")])
def test_whole_token_items(row_layout, dispatch_dtype, counts, mode):
    run_case(CASE + "case_whole_token_items", ranks_for("gpu"), env_backend("gpu"),
             env={"PYHIPA2A_COMBINE_KERNEL": "bulk", **TRANSFER_MODES[mode][0]},
             args=(row_layout, dispatch_dtype, counts), timeout=300)


# x where the peers read it (x_buffer(), NumPy x) and x staged, mixed in each call, at rows of 2 and 7 segments;
# on a grid of one block, whole tokens staged.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H, M, one_block", [(2048, 64, 0), (7168, 48, 0), (7168, 48, 1)])
def test_x_in_heap(backend, H, M, one_block):
    ranks = ranks_for(backend)
    if ranks < 2:
        pytest.skip("needs two ranks")
    run_case(CASE + "case_x_in_heap", ranks, env_backend(backend), env={"PYHIPA2A_PUSH_MAX_TOKENS": "0"},
             args=(H, M, one_block))


# A source that failed while its rows were read where they lie: the readers' calls fail naming it.
@pytest.mark.parametrize("backend", BACKENDS)
def test_x_in_heap_source_failed(backend):
    ranks = ranks_for(backend)
    if ranks < 2:
        pytest.skip("needs two ranks")
    run_case(CASE + "case_x_in_heap_source_failed", ranks, env_backend(backend), env={"PYHIPA2A_PUSH_MAX_TOKENS": "0"},
             timeout=120)


# Calls of one object on either side of PYHIPA2A_POST_MIN_TOKENS, in turn: each combine's contributions land where
# its call says (posted: in their owners' memory; pulled: in their contributors'), seen in the heap.
@pytest.mark.parametrize("backend", BACKENDS)
def test_posted_and_pulled_calls(backend):
    ranks = ranks_for(backend)
    if ranks < 2:
        pytest.skip("needs two ranks")
    run_case(CASE + "case_posted_and_pulled_calls", ranks, env_backend(backend),
             env={"PYHIPA2A_POST_MIN_TOKENS": "32", "PYHIPA2A_PUSH_MAX_TOKENS": "0"})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("choice", ["auto", "small", "bulk"])
def test_combine_kernel_choice(choice, backend):
    run_case(CASE + "case_combine_kernel_choice", ranks_for(backend), env_backend(backend), args=(choice,))


# Each rank picks its combine kernel for its own call: a pushed or pulled peer may run the other one.
# (experts per rank, k, H, M, token counts); "staggered" gives ranks calls from 1 token to M.
MIXED_KERNEL_CASES = {"push": (4, 4, 2048, 32, "full"), "pull_large": (4, 8, 7168, 256, "staggered"),
                      "unaligned": (4, 3, 1001, 16, "random")}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MIXED_KERNEL_CASES))
def test_combine_kernels_mixed_across_ranks(name):
    ranks = ranks_for("gpu")
    if ranks < 2:
        pytest.skip("needs two ranks")
    run_case(CASE + "case_combine_kernels_mixed", ranks, env_backend("gpu"), args=MIXED_KERNEL_CASES[name],
             timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("H,M", [(7168, 32), (2880, 64), (1001, 16)])
def test_combine_kernels_agree_bit_for_bit(H, M):
    run_case(CASE + "case_combine_kernels_agree", ranks_for("gpu"), env_backend("gpu"), args=(H, M), timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["small", "bulk"])
@pytest.mark.parametrize("name", sorted(COMBINE_KERNEL_CASES))
def test_combine_kernels(name, kernel):
    case, mode, args = COMBINE_KERNEL_CASES[name]
    ranks = ranks_for("gpu")
    if case == "case_shape":  # (experts per rank, ...) -> (E, ...)
        args = (args[0] * ranks, *args[1:])
    env = {"PYHIPA2A_COMBINE_KERNEL": kernel, **(TRANSFER_MODES[mode][0] if mode else {})}
    run_case(CASE + case, ranks, env_backend("gpu"), env=env, args=args, timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
def test_200_alternating_calls(backend):
    run_case(CASE + "case_alternating", ranks_for(backend), env_backend(backend), args=(200,), timeout=900)




@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_default_push_threshold", "case_bf16_roundtrip_dtype", "case_launch_geometry",
                                  "case_launch_sites_made_ahead"])
def test_exchange_setup(case, backend):
    run_case(CASE + case, ranks_for(backend), env_backend(backend))
