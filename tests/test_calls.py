"""The call protocol under MPI, on the host backend and (marked gpu) on GPUs: bad inputs and
configurations, outputs and device inputs, repeated calls and their plans, new arrays at every call,
peers that never come, the device made current again."""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, env_backend, ranks_for, run_case

CASE = "tests.cases.calls_cases:"


@pytest.mark.gpu
def test_calls_switch_back_to_their_gpu():
    run_case(CASE + "case_another_device_current", ranks_for("gpu"), env_backend("gpu"), timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights_at", ["combine", "dispatch"])
@pytest.mark.parametrize("out_given", ["0", "1"])
def test_new_arrays_at_every_call(backend, weights_at, out_given):
    run_case(CASE + "case_new_arrays_at_every_call", ranks_for(backend), env_backend(backend),
             args=(weights_at, out_given))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_weights_sent_then_given_again", "case_new_expert_outputs_at_every_call"])
def test_new_arrays_of_each_kind(case, backend):
    run_case(CASE + case, ranks_for(backend), env_backend(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_out_and_device_inputs", "case_bad_inputs", "case_bad_config",
                                  "case_one_rank_refuses_its_arguments",
                                  "case_config_mismatch", "case_after_close", "case_peer_skips_call",
                                  "case_stream_handle_views_cached", "case_repeated_calls"])
def test_api(case, backend):
    run_case(CASE + case, ranks_for(backend), env_backend(backend))




@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank_refuses_its_arguments_across_nodes(backend):
    """As within a node (test_api), where the ranks lie on nodes of one rank each: the device is chosen there."""
    run_case(CASE + "case_one_rank_refuses_its_arguments", ranks_for(backend), env_backend(backend),
             env={"PYHIPA2A_RANKS_PER_NODE": "1"})
