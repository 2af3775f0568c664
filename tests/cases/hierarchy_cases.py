"""Multi-rank cases for calls across nodes (run by tests/test_hierarchy.py under mpiexec): the ranks
split into simulated nodes of `G` ranks (AllToAll(..., ranks_per_node=G)), the exchange between them
by MPI on the host backend and by NCCL (or PYHIPA2A_INTERNODE) on GPUs."""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import A2AError, AllToAll
from pyhipa2a.errors import ConfigMismatchError
from pyhipa2a.bootstrap import node_layout
from pyhipa2a.hierarchy import HierarchicalAllToAll
from pyhipa2a.testing import (WEIGHTS_AT, draw_world, dtype_arguments, free_buffers, inputs_as_given,
                              layout_arguments, run_round, step_buffers)
from tests.cases import launches_checked


def _nodes(comm, G: int) -> int:
    if comm.Get_size() % G or comm.Get_size() // G < 2:
        pytest.skip(f"needs at least two nodes of {G} ranks; {comm.Get_size()} ranks run")
    return comm.Get_size() // G


def _small_call(comm, G: int) -> tuple:
    """(world, E, k, H, M) of the small calls the graph and repeat cases make, at least two nodes of G checked."""
    _nodes(comm, G)
    world = comm.Get_size()
    return world, 2 * world, 2, 128, 8


def _route(inputs, world: int, G: int, E: int, k: int, where: str, seed: int):
    """Routing kept to some nodes: 'other' (every expert of a token on a node other than its rank's),
    'own' (all on its own node: nothing crosses between nodes), or 'random' (as drawn)."""
    if where == "random":
        return inputs
    rng = np.random.default_rng(seed)
    per_node, N = E * G // world, world // G
    for r in range(world):
        home = r // G
        nodes = [home] if where == "own" else [n for n in range(N) if n != home]
        experts = np.concatenate([np.arange(n * per_node, (n + 1) * per_node) for n in nodes])
        T = len(inputs.indices[r])
        inputs.indices[r][:] = np.array([rng.choice(experts, k, replace=False) for _ in range(T)],
                                        np.int32).reshape(T, k)
    return inputs


def case_nodes(comm, G, E, k, H, M, dtype="float16", counts="random", where="random", fused="0", rounds="2",
               seed="0", fp8="none", calls_on="own", row_layout="packed"):
    """Oracle equality for a call across nodes, the weights given to combine and to dispatch in turn,
    each rank in its own turn (counterparts choose differently, and each one both ways);
    `fp8`: 'quantize' or 'given' dispatches in fp8 (x quantized by the kernels, or given with its scales);
    `calls_on`: AllToAll(stream=...), which the node's object takes; `row_layout`: layout_arguments' spec."""
    G, E, k, H, M, rounds, seed, fused = int(G), int(E), int(k), int(H), int(M), int(rounds), int(seed), fused == "1"
    _nodes(comm, G)
    world = comm.Get_size()
    counts = {"random": None, "full": [M] * world, "empty": [0] * world,
              "some_empty": [0 if r % 2 == 0 else M for r in range(world)]}[counts]
    types = dtype_arguments(dtype, None if fp8 == "none" else "float8_e4m3", fp8)
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, ranks_per_node=G,
                  stream=calls_on, **types, **layout_arguments(row_layout)) as a2a:
        assert isinstance(a2a, HierarchicalAllToAll)
        assert a2a.config.stream == calls_on
        for i in range(rounds):
            inputs = draw_world(1000 * seed + i, world, E, k, H, M, dtype, counts)
            inputs = inputs_as_given(a2a, _route(inputs, world, G, E, k, where, 77 + i), fp8)
            err = run_round(a2a, inputs, weights_at=WEIGHTS_AT[(i + a2a.rank) % 2], fused=fused)
            print(f"rank {a2a.rank} round {i}: T={len(inputs.xs[a2a.rank])} max err {err:.3g}")


@contextlib.contextmanager
def _small_full_call(comm, G: str, M: int, seed: int):
    """A small multi-node object (2 experts a rank, k=2, H=64, nodes of G ranks) and full calls'
    inputs for it."""
    G, world = int(G), comm.Get_size()
    _nodes(comm, G)
    E, k, H = 2 * world, 2, 64
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=G) as a2a:
        yield a2a, draw_world(seed, world, E, k, H, M, token_counts=[M] * world)


def case_nodes_x_buffer(comm, G="2"):
    """x written into x_buffer() across nodes: [max_num_tokens, H] as within a node, and taken like any device
    array (every x crosses through the regions there); two full calls against the oracle."""
    from pyhipa2a.testing import check_dispatch_against_oracle, combine_error_against_oracle, in_x_buffer, poison
    M = 6
    with _small_full_call(comm, G, M, 11) as (a2a, inputs):
        me, buffer = a2a.rank, a2a.x_buffer()
        assert buffer.shape == (M, a2a.config.hidden) and buffer is a2a.x_buffer()
        for _ in range(2):
            poison(a2a)
            d = a2a.dispatch(in_x_buffer(a2a, inputs.xs[me]), inputs.indices[me])
            y = a2a.combine(a2a.fake_expert(d), inputs.weights[me])
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, d)
            combine_error_against_oracle(a2a, inputs, y)


def case_nodes_meta_names_true_source(comm, G="2"):
    """expert_meta's source rank and token are the world's, whichever node the token came through."""
    world, k, M = comm.Get_size(), 2, 6
    with _small_full_call(comm, G, M, 9) as (a2a, inputs):
        d = a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])
        a2a.combine(a2a.fake_expert(d), inputs.weights[a2a.rank])
        a2a.synchronize()
        counts, meta = d.expert_num_tokens.numpy(), d.expert_meta.numpy()
        for local in range(a2a.config.local_experts):
            e = a2a.rank * a2a.config.local_experts + local
            got = {tuple(m) for m in meta[local, :counts[local]]}
            want = {(r, t, j) for r in range(world) for t in range(M) for j in range(k) if inputs.indices[r][t, j] == e}
            assert got == want, f"rank {a2a.rank} expert {e}: meta {sorted(got)} != {sorted(want)}"


def case_nodes_graph(comm, G="2", launches="3"):
    """A captured step replays as a new call each launch, across nodes; a call on a stream that another
    library captures is refused before anything runs."""
    G = int(G)
    world, E, k, H, M = _small_call(comm, G)
    counts = [(3 * r + 1) % (M + 1) for r in range(world)]
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=G) as a2a:
        theirs = a2a.backend.stream_create()
        a2a.backend.capture_begin(theirs)
        inputs = draw_world(40, world, E, k, H, M, token_counts=counts)
        me = a2a.rank
        with pytest.raises(A2AError, match="cannot be recorded into another library's capture"):
            a2a.dispatch(inputs.xs[me], inputs.indices[me], weights=inputs.weights[me], stream=theirs)
        a2a.backend.capture_end(theirs, keep=False)
        a2a.backend.stream_destroy(theirs)
        run_round(a2a, inputs)  # untouched by the refusal
        if not a2a.engine.capturable:
            pytest.skip("the MPI engine on a GPU stages through the host: no graph capture")
        buffers = x, idx, w, y = step_buffers(a2a, counts[me])
        a2a.expert_y_buffer()
        captured = {}

        def step():
            captured["d"] = d = a2a.dispatch(x, idx, weights=w)
            a2a.combine(a2a.fake_expert(d), out=y)

        try:
            launches_checked(a2a, a2a.capture(step), buffers, captured, launches,
                             lambda i: draw_world(50 + i, world, E, k, H, M, token_counts=counts),
                             lambda: run_round(a2a, draw_world(99, world, E, k, H, M)))
        finally:
            free_buffers(a2a, buffers)


def case_nodes_repeated_calls(comm, G="2"):
    """A loop that hands over the same device arrays again, across nodes, then another set of arrays (which
    dispatch's plan takes standing in for the last): from the third call of a set on each leg's plan takes the
    call (the hierarchy's repeater: the regions staged, swapped between nodes and placed, the node's kernel,
    and for combine the seal and the sums home), with NCCL on CUDA as one graph a leg, made once and handed
    each new plan's arguments or stand-in's pointers (a graph still holding the first set's pointers would
    read its x and write its y: the second set's y stays poison), launched from C, and every call is right
    (new values, outputs poisoned, checked against the oracle); weights to combine, then to dispatch."""
    from tests.cases import calls_watched
    from pyhipa2a import repeat
    from pyhipa2a.internode import NcclEngine
    from pyhipa2a.testing import check_call, poison
    G = int(G)
    world, E, k, H, M = _small_call(comm, G)
    counts = [(2 * r + 3) % (M + 1) for r in range(world)]
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=G) as a2a, calls_watched() as watched:
        me = a2a.rank
        sets, expert_y = [step_buffers(a2a, counts[me]) for _ in range(2)], a2a.expert_y_buffer()
        graphs = isinstance(a2a.engine, NcclEngine) and a2a.backend.kind == "cuda"
        first = True
        try:
            for j, weights_at in enumerate(WEIGHTS_AT):
                for part, (x, idx, w, y) in enumerate(sets):
                    for i in range(4):
                        inputs = draw_world(60 + 100 * j + 10 * part + i, world, E, k, H, M, token_counts=counts)
                        for arr, fresh in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                            arr.copy_from(fresh)
                        poison(a2a)
                        y.copy_from(np.full(y.shape, np.nan, y.dtype))
                        watched.clear()
                        d = a2a.dispatch(x, idx, **({"weights": w} if weights_at == "dispatch" else {}))
                        a2a.fake_expert(d, out=expert_y)
                        out = a2a.combine(expert_y, None if weights_at == "dispatch" else w, out=y)
                        a2a.synchronize()
                        err = check_call(a2a, inputs, d, out)
                        # A set's first call finds the last set's plans: dispatch's takes the new arrays standing in
                        # for the last (combine's misses: out= is another array, the call's result), and misses
                        # them given again, where the full path makes them the recorded ones; where the weights
                        # move to dispatch both miss.
                        if i >= 2:
                            want = [True, True]
                        elif i == 0 and not first:
                            want = [True, False] if part == 1 else [False, False]
                        else:
                            want = [False] if part == 1 else []
                        assert watched.plans == want, (weights_at, part, i, watched.plans)
                        if graphs and repeat.COMPILED and i >= 2:  # (each leg's graph launched from C)
                            assert watched.forms == [("driver", "driver")] * 2, watched.forms
                        first = False
                        # (a graph a leg, made with the first plan, at the end of a set's second call)
                        kept = 2 if graphs and (i >= 1 or j or part) else 0
                        assert a2a.engine.graphs_kept == kept, (weights_at, part, i, a2a.engine.graphs_kept)
                        print(f"rank {me} weights to {weights_at}, set {part}, call {i}: max err {err:.3g}")
        finally:
            for buffers in sets:
                free_buffers(a2a, buffers)


def case_nodes_plans_hold_the_engines_conditions(comm, G="2"):
    """A plan across nodes also needs what its engine names (NCCL's: a communicator not aborted, whose graphs
    the plan launches): while a condition holds the plans take the calls; once it fails they miss, and the
    full path takes each call, right."""
    import types
    from tests.cases import calls_watched
    from pyhipa2a.testing import check_call
    G = int(G)
    world, E, k, H, M = _small_call(comm, G)
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=G) as a2a, calls_watched() as watched:
        me, held = a2a.rank, types.SimpleNamespace(up=True)
        a2a.engine.plan_conditions += ((held, "up", True),)  # (made before the plans, which take it)
        buffers = x, idx, w, y = step_buffers(a2a, M)
        expert_y = a2a.expert_y_buffer()
        try:
            for i in range(5):
                held.up = i < 3
                inputs = draw_world(70 + i, world, E, k, H, M, token_counts=[M] * world)
                for arr, fresh in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                    arr.copy_from(fresh)
                watched.clear()
                d = a2a.dispatch(x, idx)
                a2a.fake_expert(d, out=expert_y)
                out = a2a.combine(expert_y, w, out=y)
                a2a.synchronize()
                check_call(a2a, inputs, d, out)
                assert watched.plans == ([True, True] if i == 2 else [False, False] if i > 2 else []), \
                    (i, watched.plans)
        finally:
            free_buffers(a2a, buffers)


def _raw(a2a, arr):
    """An output's memory as the device holds it, read without asking its health (a consumer that
    reads without asking sees this)."""
    from pyhipa2a import DeviceArray
    return DeviceArray(a2a.backend, arr.ptr, arr.shape, arr.dtype, stream=a2a.stream).numpy()


def case_nodes_launch_sites_made_ahead(comm, G="2"):
    """Calls across nodes launch the node-to-node kernels (stage, localize, sum) from launch sites made
    with the object, one geometry each whatever the call's tokens (on CUDA a one-node graph each, with
    device memory of its own: a site made for each new token count grew memory mid-run): token counts
    1, some, M and others, the weights at dispatch and at combine, the fake expert fused and not. (On the
    host backend every grid is one block: only a GPU run, two nodes or more, sees a launch on another grid
    than the prepared one.)"""
    from . import launch_sites_watched
    G = int(G)
    _nodes(comm, G)
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 16
    backend = pyhipa2a.get_backend()
    with launch_sites_watched(backend) as (prepared, launched, names):
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, ranks_per_node=G,
                      backend=backend) as a2a:
            made = set(prepared)
            out16 = "bf16" if a2a.config.out_dtype.name == "bfloat16" else "f16"
            between = {f for f, name in names.items() if name in ("hier_stage", "hier_localize", f"hier_sum_{out16}")}
            assert len(between) == 3, names
            assert between <= {s[0] for s in made}
            for i, tokens in enumerate((1, M // 2 + 1, M, 3, 1)):
                inputs = draw_world(50 + i, world, E, k, H, M, token_counts=[tokens] * world)
                run_round(a2a, inputs, weights_at=WEIGHTS_AT[i % 2], fused=i % 2 == 1)
            assert prepared == made, prepared - made  # nothing prepared after the object was made
            assert launched <= made, launched - made
            assert between <= {s[0] for s in launched}


def case_nodes_peer_never_arrives(comm, G="2", who="node", leg="dispatch"):
    """The last node's ranks (who='node'), or only its last rank ('rank'), never call dispatch (or
    call it, then never combine: leg='combine'). Every other rank raises A2ATimeoutError within the
    timeout naming a rank: the one in its place on that node when that one never came, else one that
    is late or of its own node (whose part stopped, waiting itself); the failed call's outputs raise
    when read, and the device memory behind them holds poison."""
    G = int(G)
    N = _nodes(comm, G)
    world = comm.Get_size()
    late = set(range((N - 1) * G, world)) if who == "node" else {world - 1}
    E, k, H, M, timeout = 2 * world, 2, 64, 4, 2.0
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=timeout,
                  ranks_per_node=G) as a2a:
        me = a2a.rank
        inputs = draw_world(5, world, E, k, H, M, token_counts=[M] * world)
        if me in late and leg == "combine":
            a2a.dispatch(inputs.xs[me], inputs.indices[me])
        if me not in late:
            start = time.monotonic()
            d = a2a.dispatch(inputs.xs[me], inputs.indices[me])
            if leg == "combine":
                a2a.synchronize()  # the dispatch met every node
                y = a2a.combine(a2a.fake_expert(d), inputs.weights[me])
            with pytest.raises(pyhipa2a.A2ATimeoutError) as info:
                a2a.synchronize()
            elapsed = time.monotonic() - start
            counterpart = (N - 1) * G + me % G
            named = set(info.value.ranks)
            assert named, str(info.value)
            if counterpart in late and me // G != N - 1:
                assert counterpart in named and "between nodes" in str(info.value), (me, str(info.value))
            else:
                assert named <= late | set(range(me // G * G, me // G * G + G)), (me, str(info.value))
            assert elapsed < 3 * timeout + 3.0, f"rank {me}: the timeout took {elapsed:.1f} s"
            if leg == "combine":
                with pytest.raises(pyhipa2a.A2ATimeoutError):
                    y.numpy()
                assert np.isnan(_raw(a2a, y).astype(np.float32)).all(), f"rank {me}: y is not poisoned"
            else:
                for out in (d.expert_num_tokens, d.expert_x, d.expert_meta):
                    with pytest.raises(pyhipa2a.A2ATimeoutError):
                        out.numpy()
                assert (_raw(a2a, d.expert_num_tokens) == -1).all(), f"rank {me}: counts are not poisoned"
                assert np.isnan(_raw(a2a, d.expert_x).astype(np.float32)).all(), f"rank {me}: rows not poisoned"
            with pytest.raises(A2AError):
                a2a.dispatch(inputs.xs[me], inputs.indices[me])
            print(f"rank {me}: {info.value}")
        comm.Barrier()  # the late ranks close only after the others saw the timeout


def case_nodes_teardown_goes_on_after_the_engine_fails(comm, G="2"):
    """A close whose engine fails (NCCL reporting its abort failed, say) still closes the node's exchange,
    its heap with it, and the communicators, then raises the engine's error; a second close does nothing."""
    from pyhipa2a.errors import RuntimeFailure
    world = comm.Get_size()
    a2a = AllToAll(comm, num_experts=2 * world, experts_per_token=1, hidden_dim=8, max_num_tokens=2,
                   ranks_per_node=int(G))

    def failing_close(broken):
        raise RuntimeFailure("the engine's close failed")
    a2a.engine.close = failing_close
    with pytest.raises(RuntimeFailure, match="the engine's close failed"):
        a2a.close()
    assert a2a.heap.closed
    a2a.close()


def case_nodes_bad_config(comm):
    """A ranks_per_node that cannot split the ranks, or that ranks disagree on: a clear error on every
    rank before anything is allocated."""
    world = comm.Get_size()
    for bad, error in ((0, ValueError), (-2, ValueError), ("2", ValueError), (2.0, ValueError)):
        with pytest.raises(error, match="ranks_per_node must be a positive integer"):
            node_layout(comm, bad)
    if world > 2:
        with pytest.raises(ValueError, match=f"ranks_per_node={world - 1} does not divide the {world} ranks"):
            AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=2,
                     ranks_per_node=world - 1)
    if world > 1:  # rows by source are a layout of one node's call
        with pytest.raises(ValueError, match="row_layout='by_source' is for calls within one node"):
            AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=2, ranks_per_node=1,
                     row_layout="by_source")
    if world > 1:  # (checked before any communicator is split: a bad name costs nothing to find)
        with pytest.raises(ValueError, match=r"engine must be one of \('nccl', 'mpi'\) or None, not 'gloo'"):
            AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=2, ranks_per_node=1,
                     engine="gloo")
    with pytest.raises(ConfigMismatchError, match="ranks disagree on ranks_per_node"):
        node_layout(comm, 1 if comm.Get_rank() == 0 else world)
    layout = node_layout(comm, 1)
    assert (layout.nodes, layout.ranks_per_node, layout.node, layout.place) == (world, 1, comm.Get_rank(), 0)
    assert node_layout(comm).nodes == 1  # one machine, nothing asked: one node


def case_nodes_bad_inputs(comm, G="2"):
    """Bad input raises on the calling rank before any kernel runs, also a combine whose weights would
    cross between nodes before its expert_y is looked at: the object stays as good as new."""
    E, k, H, M = 2 * comm.Get_size(), 2, 64, 4
    with _small_full_call(comm, G, M, 3) as (a2a, inputs):
        me = a2a.rank
        x, idx = inputs.xs[me], inputs.indices[me]
        with pytest.raises(ValueError, match="x has 5 tokens"):
            a2a.dispatch(np.zeros((M + 1, H), np.float16), np.zeros((M + 1, k), np.int32))
        with pytest.raises(ValueError, match="outside"):
            a2a.dispatch(x, np.full_like(idx, E))
        with pytest.raises(ValueError, match="repeats expert"):
            a2a.dispatch(x, np.repeat(idx[:, :1], k, axis=1))
        with pytest.raises(TypeError, match="x_scales is for fp8 x"):
            a2a.dispatch(x, idx, x_scales=np.ones((M, 1), np.float32))
        with pytest.raises(A2AError, match="needs a preceding dispatch"):
            a2a.combine(np.zeros((a2a.config.local_experts, a2a.config.capacity, H), np.float16), inputs.weights[me])
        run_round(a2a, inputs)  # nothing above ran a kernel: the object is as good as new
        d = a2a.dispatch(x, idx)
        expert_y = a2a.fake_expert(d)
        if me == 0:  # on one rank only: a refusal that had sent the weights would pair with a peer's real call
            for bad_y, error in ((np.zeros((1, 2, H), np.float16), ValueError), ([1.0], TypeError)):
                with pytest.raises(error):
                    a2a.combine(bad_y, inputs.weights[me])
            with pytest.raises(ValueError, match="weights has 1 rows"):
                a2a.combine(expert_y, inputs.weights[me][:1])
        a2a.combine(expert_y, inputs.weights[me])  # the refusals sent nothing: this call meets its peers'
        a2a.synchronize()
        run_round(a2a, inputs)
        a2a.exchange_between_nodes()  # the benchmarks' bare exchange: calls after it are as good
        a2a.synchronize()
        run_round(a2a, inputs)


def case_nodes_rank_layout(comm):
    """node_layout: nodes of consecutive ranks, the environment variable as the default."""
    import os
    world = comm.Get_size()
    os.environ["PYHIPA2A_RANKS_PER_NODE"] = "2"
    try:
        layout = node_layout(comm)
    finally:
        del os.environ["PYHIPA2A_RANKS_PER_NODE"]
    r = comm.Get_rank()
    assert (layout.nodes, layout.ranks_per_node, layout.node, layout.place) == (world // 2, 2, r // 2, r % 2)
