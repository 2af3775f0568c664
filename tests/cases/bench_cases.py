"""Multi-rank case for scripts/bench.py (run by tests/test_bench.py under mpiexec)."""
from __future__ import annotations

import collections
import os
import sys
from types import SimpleNamespace


def case_timing_releases_what_it_made(comm, fail_at, event_release_raises="0", between_nodes="0", x_in_heap="0"):
    """bench.time_shape frees every input buffer, event and graph it makes, whether its checks pass or one
    of them reports an error and it returns early (fail_at: which check_run call fails, counted from 1:
    the timed graph, the graph with events around the step alone, the bare graph, the eager call, the
    eager call with new arrays, the lockstep graph; 0: none). With
    event_release_raises, destroying an event raises (as every call does after a device fault): a failed
    shape still returns its FAIL row, and everything else is still freed. With between_nodes, each rank
    is a node of its own and the wall times are taken too: the bare exchange between nodes is captured
    once, its graph replayed at each of the wall's iterations, and released with the rest. With x_in_heap
    (--x-in-heap) the calls take x from the object's x_buffer(), which is not the bench's to free."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import bench
    from pyhipa2a import AllToAll
    from pyhipa2a.testing import draw_world, inputs_as_given
    fail_at, raises, world = int(fail_at), event_release_raises == "1", comm.Get_size()
    nodes = between_nodes == "1"
    E, k, H, M = 4 * world, 2, 64, 8
    args = SimpleNamespace(inputs="own", warmup=1, iters=2, lockstep_calls=2, fp8_input="quantize",
                           x_in_heap=x_in_heap == "1")
    bench.FLUSH_BYTES = 1 << 16  # the wall's cache flush: its size does not matter here
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=1 if nodes else None) as a2a:
        a2a.expert_y_buffer()  # the object's own, made once and freed by close(): not the bench's to free
        b, live, made = a2a.backend, collections.Counter(), collections.Counter()

        def count(name, kind, change, held=True):  # the backend's method, counted (an instance attribute
            real = getattr(b, name)                 # shadows it); held: what it makes must be released

            def counted(*a, **kw):
                result = real(*a, **kw)
                live[kind] += change if held else 0
                made[kind] += change > 0
                if raises and name == "event_destroy":
                    raise RuntimeError("event_destroy after a device fault")
                return result
            setattr(b, name, counted)
        for name, kind in (("malloc_ipc", "buffers"), ("event_create", "events"), ("capture_end", "graphs")):
            count(name, kind, +1)
        for name, kind in (("free", "buffers"), ("event_destroy", "events"), ("graph_destroy", "graphs")):
            count(name, kind, -1)
        count("graph_launch", "launches", +1, held=False)
        bare_graphs, real_walls = [], bench.bare_exchange_walls

        def bare_exchange_walls(*a, **kw):  # what the bare exchange between nodes made and launched
            graphs, launches = made["graphs"], made["launches"]
            walls = real_walls(*a, **kw)
            bare_graphs.append((made["graphs"] - graphs, made["launches"] - launches))
            return walls
        bench.bare_exchange_walls = bare_exchange_walls
        checks, real_check_run = [], bench.check_run

        def check_run(*a, **kw):
            checks.append(a[-1])
            return "a check made to fail" if len(checks) == fail_at else real_check_run(*a, **kw)
        bench.check_run = check_run
        inputs = inputs_as_given(a2a, draw_world(5, world, E, k, H, M), args.fp8_input)
        flush = b.malloc_ipc(bench.FLUSH_BYTES) if nodes else None  # (the caller's, freed below)
        made["buffers"] -= nodes
        result = bench.time_shape(comm, a2a, inputs, args, bench.Step(fused=True), flush, bench.FastCpu(comm))
        if nodes:
            b.free(flush)
        assert result.get("ok", True) == (fail_at == 0) and len(checks) == (fail_at or 6), (result, checks)
        # (x, indices and weights for the graphs and eager calls, and for each other set of new arrays)
        assert (made["buffers"] == 3 * bench.NEW_ARRAYS and made["events"] >= 4
                and made["graphs"] >= min(fail_at or 4, 2)), made
        assert not any(live.values()), f"left behind: {dict(live)} of {dict(made)}"
        if nodes and fail_at == 0:  # one graph of the bare exchange, launched at every wall iteration
            assert bare_graphs == [(1, args.iters)], bare_graphs
            assert result["bare_exchange_wall"] > 0 and result["bare_exchange_eager_wall"] > 0, result
        else:
            assert not bare_graphs, bare_graphs
