"""Multi-rank cases of the call protocol: bad inputs and configurations, outputs and device inputs, repeated calls and
new arrays, late peers, devices (run under mpiexec by the tests).

Every case draws the whole world's inputs from a seed, poisons the outputs,
runs the library and checks this rank's outputs against pyhipa2a.reference.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import A2AError, AllToAll
from tests.cases import calls_watched
from pyhipa2a.testing import (dispatch, draw_world)


def case_out_and_device_inputs(comm):
    """combine(out=...) writes the caller's array; device arrays (DLPack / our own) are used in place."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 96, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        inputs = draw_world(7, world, E, k, H, M)
        me = a2a.rank
        T = len(inputs.xs[me])
        x_dev = a2a.expert_y_buffer().view((T, H))   # any device array of ours will do as input
        x_dev.copy_from(inputs.xs[me])
        d = a2a.dispatch(DLPackOnly(x_dev), inputs.indices[me])
        expert_y = a2a.fake_expert(d)
        out = pyhipa2a.DeviceArray(a2a.backend, a2a.buffers["x_stage"].ptr, (T, H), np.float16, owner=a2a.heap)
        y = a2a.combine(expert_y, inputs.weights[me], out=out)
        a2a.synchronize()
        assert y is out
        from pyhipa2a import reference
        from pyhipa2a.testing import combine_error
        expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, ranks=[me])[me]
        combine_error(out.numpy(), expected, np.float16)


def case_new_arrays_at_every_call(comm, weights_at="combine", out_given="0", ranks_per_node="0"):
    """A loop that hands over new arrays of ours at every call, with a new token count at most calls (a
    layer's activations, a router's output): a call takes the full path unless the two before it had its
    token count (then the plans take it, the new arrays standing in for the last), and every one is
    right, checked against the oracle on poisoned outputs. An array unlike the last (another element
    type, stream, a NumPy array) is refused or ordered as ever. `ranks_per_node` > 0: across nodes."""
    from pyhipa2a.array import DeviceArray
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    at_dispatch, out_given = weights_at == "dispatch", out_given == "1"
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=int(ranks_per_node) or None) as a2a, \
            calls_watched() as watched:
        assert not int(ranks_per_node) or type(a2a).__name__ == "HierarchicalAllToAll"
        kept, first, outs, mine_before = [], None, {}, []
        for i, T in enumerate((5, 3, 5, 8, 1, 5, 8)):
            counts = [(T + r) % M + 1 if i % 2 else T for r in range(world)]  # (ranks differ on odd rounds)
            inputs = draw_world(40 + i, world, E, k, H, M, token_counts=counts)
            arrays = upload_inputs(a2a, inputs)  # new buffers, new objects
            kept.append(arrays)
            if first is None:
                first = (arrays, inputs)
            elif i == 5:  # the first call's arrays again, refilled
                arrays, inputs = first[0], draw_world(40 + i, world, E, k, H, M,
                                                      token_counts=[len(first[1].xs[0])] * world)
                for arr, fresh in zip(arrays, (inputs.xs[a2a.rank], inputs.indices[a2a.rank],
                                               inputs.weights[a2a.rank])):
                    arr.copy_from(fresh)
            x, idx, w = arrays[:3]
            mine = len(inputs.xs[a2a.rank])
            out = None
            if out_given:
                if mine not in outs:
                    outs[mine] = DeviceArray(a2a.backend, a2a.backend.malloc_ipc(mine * H * 2), (mine, H), np.float16,
                                             stream=a2a.stream)
                out = outs[mine]
            poison(a2a)
            watched.clear()
            d = a2a.dispatch(x, idx, weights=w) if at_dispatch else a2a.dispatch(x, idx)
            y = a2a.combine(d.expert_x, None if at_dispatch else w, out=out, expert_scale=float(1 + a2a.rank))
            a2a.synchronize()
            assert d.num_tokens == mine and y.shape == (mine, H) and (out is None or y is out), (i, y.shape)
            check_call(a2a, inputs, d, y, fused=True)
            # (a plan is made by the second of two calls alike, and misses a call of another token count)
            planned = len(mine_before) >= 2 and mine_before[-1] == mine_before[-2]
            want = [] if not planned else [True, True] if mine == mine_before[-1] else [False, False]
            assert watched.plans == want, (i, mine_before, mine, watched.plans)
            mine_before.append(mine)
        # What the full path must see: another element type (refused as ever), another stream, NumPy.
        inputs = draw_world(60, world, E, k, H, M, token_counts=[4] * world)
        x, idx, w = upload_inputs(a2a, inputs)[:3]
        kept.append((x, idx, w))
        wide = DeviceArray(a2a.backend, a2a.backend.malloc_ipc(4 * H * 4), (4, H), np.float32, stream=a2a.stream)
        kept.append((wide,))
        with pytest.raises(TypeError, match="must have dtype float16"):
            a2a.dispatch(wide, idx)
        poison(a2a)  # a refused call records nothing: a good one records again
        d = a2a.dispatch(x, idx)
        check_call(a2a, inputs, d, a2a.combine(d.expert_x, w, expert_scale=float(1 + a2a.rank)), fused=True)
        other = a2a.backend.stream_create()
        try:
            x_elsewhere = DeviceArray(a2a.backend, x.ptr, x.shape, x.dtype, stream=other)
            poison(a2a)
            d = a2a.dispatch(x_elsewhere, idx)  # (ordered after `other` by the full path)
            y = a2a.combine(d.expert_x, inputs.weights[a2a.rank], expert_scale=float(1 + a2a.rank))
            a2a.synchronize()
            check_call(a2a, inputs, d, y, fused=True)
        finally:
            a2a.synchronize()
            a2a.backend.stream_destroy(other)
        for arrays in kept:
            free_inputs(a2a, arrays)
        for out in outs.values():
            a2a.backend.free(out.ptr)
    print(f"rank {comm.Get_rank()} new arrays at every call ({weights_at}, out given: {out_given}): right")


def case_weights_sent_then_given_again(comm, ranks_per_node="0"):
    """Weights given to dispatch may be given to combine again (the same array): also where dispatch's plan
    took a new array standing in for the recorded weights, which is then what it sent. New arrays at every
    call, right against the oracle on poisoned outputs. `ranks_per_node` > 0: across nodes."""
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=int(ranks_per_node) or None) as a2a, calls_watched() as watched:
        assert not int(ranks_per_node) or type(a2a).__name__ == "HierarchicalAllToAll"
        kept = []
        try:
            for i in range(5):
                inputs = draw_world(80 + i, world, E, k, H, M, token_counts=[6] * world)
                x, idx, w = arrays = upload_inputs(a2a, inputs)[:3]
                kept.append(arrays)
                poison(a2a)
                watched.clear()
                d = a2a.dispatch(x, idx, weights=w)
                y = a2a.combine(d.expert_x, w, expert_scale=float(1 + a2a.rank))
                a2a.synchronize()
                check_call(a2a, inputs, d, y, fused=True)
                # (dispatch's plan, made by its second call, takes every later one, new arrays standing in;
                # combine, given new weights at every call, makes none)
                assert watched.plans == ([] if i < 2 else [True]), (i, watched.plans)
            # The same weights twice give combine a plan; weights of another dispatch (a stand-in's) are then
            # refused as the full path refuses them, before any kernel runs, and the right ones are taken.
            x, idx, w_a = kept[-1][:3]
            for _ in range(2):
                d = a2a.dispatch(x, idx, weights=w_a)
                a2a.combine(d.expert_x, w_a, expert_scale=float(1 + a2a.rank))
            inputs = draw_world(89, world, E, k, H, M, token_counts=[6] * world)
            x, idx, w_b = arrays = upload_inputs(a2a, inputs)[:3]
            kept.append(arrays)
            poison(a2a)
            watched.clear()
            d = a2a.dispatch(x, idx, weights=w_b)
            with pytest.raises(ValueError, match="given to dispatch"):
                a2a.combine(d.expert_x, w_a, expert_scale=float(1 + a2a.rank))
            y = a2a.combine(d.expert_x, w_b, expert_scale=float(1 + a2a.rank))
            a2a.synchronize()
            check_call(a2a, inputs, d, y, fused=True)
            assert watched.plans == [True, False], watched.plans  # (the refused call left combine no plan)
        finally:
            for arrays in kept:
                free_inputs(a2a, arrays)


def case_new_expert_outputs_at_every_call(comm, ranks_per_node="0"):
    """A layer's expert outputs are new arrays at every step too: combine's plan takes a new expert_y like the
    last (and new weights), right against the oracle on poisoned outputs. `ranks_per_node` > 0: across nodes."""
    from pyhipa2a.array import DeviceArray
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  ranks_per_node=int(ranks_per_node) or None) as a2a, calls_watched() as watched:
        assert not int(ranks_per_node) or type(a2a).__name__ == "HierarchicalAllToAll"
        like = a2a.expert_y_buffer()
        kept = []
        try:
            for i in range(5):
                inputs = draw_world(90 + i, world, E, k, H, M, token_counts=[5] * world)
                arrays = upload_inputs(a2a, inputs)
                expert_y = DeviceArray(a2a.backend, a2a.backend.malloc_ipc(like.nbytes), like.shape, like.dtype,
                                       stream=a2a.stream)
                kept.append((*arrays, expert_y))
                x, idx, w = arrays[:3]
                poison(a2a)
                watched.clear()
                d = a2a.dispatch(x, idx)
                a2a.fake_expert(d, out=expert_y)
                y = a2a.combine(expert_y, w)
                a2a.synchronize()
                check_call(a2a, inputs, d, y)
                assert watched.plans == ([] if i < 2 else [True, True]), (i, watched.plans)
        finally:
            for arrays in kept:
                free_inputs(a2a, arrays)


def case_repeated_calls(comm):
    """A loop that hands over the same device arrays again: from its third call on, each leg's plan
    (pyhipa2a.repeat) takes the call, and every call is right (new data in the same arrays, each call
    checked against the oracle on poisoned outputs). A change of the stream, the scale or an argument, a
    NumPy argument, or a capture in between takes the full path."""
    from pyhipa2a import repeat
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    counts = [5] * world
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a, \
            calls_watched() as watched:
        arrays = upload_inputs(a2a, draw_world(1, world, E, k, H, M, token_counts=counts))
        x, idx, w = arrays[:3]
        expert_y = a2a.expert_y_buffer()

        def refill(seed, arrays=(x, idx, w)):
            """New inputs for this rank written into the same (device or NumPy) arrays, outputs poisoned:
            the next call's inputs."""
            inputs = draw_world(seed, world, E, k, H, M, token_counts=counts)
            for arr, fresh in zip(arrays, (inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank])):
                if isinstance(arr, np.ndarray):
                    arr[...] = fresh
                else:
                    arr.copy_from(fresh)
            poison(a2a)
            watched.clear()
            return inputs

        def loop_call(x_arg=x, w_arg=w, **combine_kw):
            d = a2a.dispatch(x_arg, idx)
            a2a.fake_expert(d, out=expert_y)
            return d, a2a.combine(expert_y, w_arg, **combine_kw)

        try:
            for i in range(4):
                inputs = refill(10 + i)
                d, y = loop_call()
                a2a.synchronize()
                check_call(a2a, inputs, d, y)
                assert watched.plans == ([True, True] if i >= 2 else []), (i, watched.plans)
            if a2a.backend.kind == "cuda" and repeat.COMPILED:  # (the context and the graph launch from C)
                assert watched.forms == [("driver", "driver")] * 2, watched.forms
            # Each change takes the full path for the call it touches (its plan misses); the other repeats. A
            # new array like x (a view of it) stands in for it; one that names no stream does not.
            from pyhipa2a.array import DeviceArray
            y_before = y.numpy().astype(np.float32)
            unordered = DeviceArray(a2a.backend, x.ptr, x.shape, x.dtype, stream=None)
            for change, want in (("scale", [True, False]), ("array alike", [True, True]),
                                 ("array of no stream", [False, True]), ("numpy", [True, False])):
                for _ in range(2):  # (the loop's call, twice: its plans made again)
                    loop_call()
                watched.clear()
                given_x = {"array alike": x.view(x.shape), "array of no stream": unordered}.get(change, x)
                y = loop_call(given_x,
                              inputs.weights[a2a.rank] if change == "numpy" else w,
                              **({"expert_scale": 3.0} if change == "scale" else {}))[1]
                a2a.synchronize()
                assert watched.plans == want, (change, watched.plans)
                if change == "scale":  # every rank scales its expert rows by 3: so does y, within rounding
                    np.testing.assert_allclose(y.numpy().astype(np.float32), 3 * y_before, rtol=1e-2, atol=1e-2)
            # A stream given as a handle (an int, as CuPy's .ptr is: a new object each time) repeats too.
            handle = a2a.backend.stream_handle(a2a.stream)
            for i in range(3):
                watched.clear()
                d = a2a.dispatch(x, idx, stream=int(str(handle)))
                a2a.combine(a2a.fake_expert(d, out=expert_y, stream=int(str(handle))), w, stream=int(str(handle)))
                a2a.synchronize()
                assert watched.plans == [True, True] if i == 2 else True not in watched.plans, \
                    ("handle", i, watched.plans)
            # Weights given to dispatch, and a caller's out=: repeated too, and right with new data. The scale is
            # worked out afresh at every call (a new float of the same value, as gpu-mode's harness passes it).
            out = a2a.expert_y_buffer().view((counts[a2a.rank], H))  # any device array of ours will do
            scale = float(1 + a2a.rank)
            for i in range(3):
                inputs = refill(20 + i)
                d = a2a.dispatch(x, idx, weights=w)
                y = a2a.combine(d.expert_x, out=out, expert_scale=float(str(scale)))
                a2a.synchronize()
                assert y is out
                check_call(a2a, inputs, d, y, fused=True)
                assert watched.plans == [True, True] if i == 2 else True not in watched.plans, \
                    ("sent", i, watched.plans)
            # ... but not -0.0 after 0.0 (equal, yet a product's sign follows the scale's), nor an int after an
            # equal float: combine's plan misses each, and the next call (the same again) makes a new one.
            for z, want in ((0.0, [True, False]), (-0.0, [True]), (-0.0, [True]), (-0.0, [True, True]),
                            (0, [True, False]), (0, [True]), (0, [True, True])):
                watched.clear()
                a2a.combine(a2a.dispatch(x, idx, weights=w).expert_x, out=out, expert_scale=z)
                a2a.synchronize()
                assert watched.plans == want, ("scale", z, watched.plans)
            # NumPy inputs are copied at every call, even the same object refilled in place: no plan takes them
            # (the first call's legs miss the last loop's plans).
            host_x, host_idx, host_w = (np.empty_like(a) for a in (inputs.xs[a2a.rank], inputs.indices[a2a.rank],
                                                                   inputs.weights[a2a.rank]))
            for i in range(3):
                inputs = refill(30 + i, (host_x, host_idx, host_w))
                d = a2a.dispatch(host_x, host_idx)
                a2a.fake_expert(d, out=expert_y)
                y = a2a.combine(expert_y, host_w)
                a2a.synchronize()
                check_call(a2a, inputs, d, y)
                assert watched.plans == ([False, False] if i == 0 else []), ("numpy", i, watched.plans)
            # A capture in between: its calls take the full path, and the loop's next call too.
            for _ in range(3):
                loop_call()
            graph = a2a.capture(lambda: loop_call())
            graph.close()
            watched.clear()
            loop_call()
            a2a.synchronize()
            assert watched.plans == [], ("after a capture", watched.plans)
        finally:
            free_inputs(a2a, arrays)


def case_stream_handle_views_cached(comm):
    """stream= given as an int handle (as CuPy's .ptr is) makes no new output views per call."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 4
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        if a2a.backend.kind == "host":  # the GPU backends wrap a handle in a new object every time
            known = a2a.backend.stream_from_handle
            a2a.backend.stream_from_handle = lambda handle: type("Wrapped", (), {"stream": known(handle)})()
        handle = a2a.backend.stream_handle(a2a.stream)
        results = []
        for i in range(5):
            inputs = draw_world(i, world, E, k, H, M, token_counts=[2] * world)
            me = a2a.rank
            d = a2a.dispatch(inputs.xs[me], inputs.indices[me], stream=handle)
            a2a.combine(a2a.fake_expert(d, stream=handle), inputs.weights[me], stream=handle)
            a2a.synchronize(stream=handle)
            results.append(d)
        assert all(d is results[0] for d in results), "new output views at a call"


class DLPackOnly:
    """Hides everything but DLPack, as a foreign framework's array would."""

    def __init__(self, arr):
        self._arr, self.shape, self.dtype = arr, arr.shape, arr.dtype

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class ForeignDevice:
    """An array that claims to live on another device."""

    def __init__(self, shape, dtype, device_type, device_id):
        self.shape, self.dtype, self._dev = shape, np.dtype(dtype), (device_type, device_id)

    def __dlpack_device__(self):
        return self._dev

    def __dlpack__(self, **kw):  # pragma: no cover - must be refused before this
        raise AssertionError("the library must refuse the array before asking for its data")


def case_bad_inputs(comm):
    """Every rank makes the same bad call: each raises before any kernel runs, and the object stays usable."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        inputs = draw_world(3, world, E, k, H, M, token_counts=[4] * world)
        x, idx, w = inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank]
        L, cap = a2a.config.local_experts, a2a.config.capacity

        with pytest.raises(A2AError, match="combine\\(\\) needs a preceding dispatch"):
            a2a.combine(np.zeros((L, cap, H), np.float16), w)
        with pytest.raises(TypeError, match="result must be a dispatch\\(\\)'s result, not str"):
            a2a.fake_expert("junk")
        d = a2a.dispatch(x, idx)
        a2a.combine(a2a.fake_expert(d), w)
        with pytest.raises(A2AError, match="fake_expert\\(\\) needs a dispatch awaiting its combine"):
            a2a.fake_expert(d)  # (combined already: the rows it would read may be another call's by now)
        with pytest.raises(TypeError, match="x must have dtype float16, got float32"):
            a2a.dispatch(x.astype(np.float32), idx)
        with pytest.raises(TypeError, match=r"indices must have dtype int32, got int32 \(>i4\)"):
            a2a.dispatch(x, idx.astype(">i4"))  # (the byte order named: a plain "int32" would not say what is wrong)
        with pytest.raises(ValueError, match="x must have 2 dimensions"):
            a2a.dispatch(x.reshape(-1), idx)
        with pytest.raises(ValueError, match=r"x must have shape \(4, 64\), got \(4, 32\)"):
            a2a.dispatch(x[:, :32].copy(), idx)
        with pytest.raises(ValueError, match="x must be C-contiguous"):
            a2a.dispatch(np.asfortranarray(x), idx)
        with pytest.raises(ValueError, match="x has 9 tokens; .* max_num_tokens=8"):
            a2a.dispatch(np.zeros((9, H), np.float16), np.zeros((9, k), np.int32))
        with pytest.raises(TypeError, match="indices must have dtype int32, got int64"):
            a2a.dispatch(x, idx.astype(np.int64))
        with pytest.raises(ValueError, match=r"indices must have shape \(4, 2\)"):
            a2a.dispatch(x, idx[:3].copy())
        bad = idx.copy()
        bad[2, 1] = E
        with pytest.raises(ValueError, match=rf"indices\[2, 1\] = {E} is outside \[0, {E}\)"):
            a2a.dispatch(x, bad)
        bad = idx.copy()
        bad[1, 0] = -1
        with pytest.raises(ValueError, match="is outside"):
            a2a.dispatch(x, bad)
        bad = idx.copy()
        bad[3, 1] = bad[3, 0]
        with pytest.raises(ValueError, match="indices row 3 repeats expert"):
            a2a.dispatch(x, bad)
        other = a2a.heap.device.index + 1   # a device this rank does not drive
        with pytest.raises(ValueError, match=f"lives on cuda device {other}"):
            a2a.dispatch(ForeignDevice(x.shape, x.dtype, 2, other), idx)
        with pytest.raises(ValueError, match=f"lives on rocm device {other}"):
            a2a.dispatch(x, ForeignDevice(idx.shape, idx.dtype, 10, other))
        with pytest.raises(TypeError, match="x must be a NumPy array or a device array"):
            a2a.dispatch([[0.0] * H] * 4, idx)
        with pytest.raises(TypeError, match="weights must have dtype float32, got float64"):
            a2a.dispatch(x, idx, weights=w.astype(np.float64))
        with pytest.raises(ValueError, match="weights has 3 rows but the call has 4 tokens"):
            a2a.dispatch(x, idx, weights=w[:3].copy())
        with pytest.raises(TypeError, match="weights must be a NumPy array or a device array"):
            a2a.dispatch(x, idx, weights=w.tolist())
        for stream in ("stream 7", 7.0, True, types.SimpleNamespace(cuda_stream="7")):
            with pytest.raises(TypeError, match="stream= must be a stream handle .* got "):
                a2a.dispatch(x, idx, stream=stream)

        d = a2a.dispatch(x, idx)                       # a good call after all the refusals
        expert_y = a2a.fake_expert(d)
        with pytest.raises(ValueError, match=r"fake_expert out must have shape"):  # (it would write past it)
            a2a.fake_expert(d, out=expert_y.view((L, cap // 2, H)))
        with pytest.raises(TypeError, match="combine\\(\\) needs the weights"):
            a2a.combine(expert_y)
        with pytest.raises(ValueError, match=r"expert_y must have shape"):
            a2a.combine(expert_y.view((L, cap, H // 2)), w)
        with pytest.raises(TypeError, match="expert_y must have dtype float16, got float32"):
            a2a.combine(np.zeros((L, cap, H), np.float32), w)
        with pytest.raises(ValueError, match="weights has 3 rows but the call has 4 tokens"):
            a2a.combine(expert_y, w[:3].copy())
        with pytest.raises(TypeError, match="weights must have dtype float32"):
            a2a.combine(expert_y, w.astype(np.float64))
        with pytest.raises(TypeError, match="out must be a device array"):
            a2a.combine(expert_y, w, out=np.zeros((4, H), np.float16))
        with pytest.raises(TypeError, match="expert_scale must be a real number, not builtins.str"):
            a2a.combine(expert_y, w, expert_scale="2")
        with pytest.raises(ValueError, match="expert_scale=inf is not a finite float32"):
            a2a.combine(expert_y, w, expert_scale=float("inf"))
        with pytest.raises(TypeError, match="stream= must be a stream handle .* got str"):
            a2a.combine(expert_y, w, stream="current")
        from pyhipa2a import reference
        from pyhipa2a.testing import combine_error, poison
        expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, ranks=[a2a.rank])[a2a.rank]
        y = a2a.combine(expert_y, w)
        a2a.synchronize()
        combine_error(y.numpy(), expected, np.float16)

        # Weights given to dispatch: combine takes none, or the same array; another one is refused.
        for again in (None, w):
            poison(a2a)
            d = a2a.dispatch(x, idx, weights=w)
            expert_y = a2a.fake_expert(d)
            with pytest.raises(ValueError, match="weights were given to dispatch"):
                a2a.combine(expert_y, w.copy())
            y = a2a.combine(expert_y, again)
            a2a.synchronize()
            combine_error(y.numpy(), expected, np.float16)


def case_bad_config(comm):
    world = comm.Get_size()
    if world > 1:
        with pytest.raises(ValueError, match=f"must be divisible by the number of ranks \\({world}\\)"):
            AllToAll(comm, num_experts=world + 1, experts_per_token=1, hidden_dim=8, max_num_tokens=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=0, max_num_tokens=4)
    # (the kernels divide a routing slot e + E * place by E exactly only below 2^31)
    with pytest.raises(ValueError, match=r"num_experts \* max_num_tokens must be below 2\*\*31"):
        E = world * 2**10
        AllToAll(comm, num_experts=E, experts_per_token=1, hidden_dim=8, max_num_tokens=-(-2**31 // E))
    with pytest.raises(TypeError, match="in_dtype must be one of float16, bfloat16, not float32"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, in_dtype="float32")
    with pytest.raises(ValueError, match="experts_per_token=3 must be <= num_experts"):
        AllToAll(comm, num_experts=2, experts_per_token=3, hidden_dim=8, max_num_tokens=4)
    with pytest.raises(ValueError, match="push_max_tokens=-1 must be >= 0"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, push_max_tokens=-1)
    with pytest.raises(TypeError, match="narrow_partials must be a bool, not str"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, narrow_partials="no")
    with pytest.raises(ValueError, match=r"stream must be one of \('own', 'current'\)"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, stream="torch")
    with pytest.raises(ValueError, match=r"row_layout must be one of \('packed', 'by_source', 'contiguous'\), "
                                         r"not 'source'"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, row_layout="source")
    shape = dict(num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4)
    # Values a coercion would take (int(8.9) == 8; bool("no") is True; a NaN timeout would wait for ever)
    for wrong, error, message in (
            (dict(num_experts=world + 0.9), TypeError, "num_experts must be an int, not float"),
            (dict(hidden_dim=True), TypeError, "hidden_dim must be an int, not bool"),
            (dict(profile="no"), TypeError, "profile must be a bool, not str"),
            (dict(timeout=float("nan")), ValueError, "timeout must be a finite number of seconds above 0; got nan"),
            (dict(timeout=float("inf")), ValueError, "timeout must be a finite number of seconds above 0; got inf"),
            (dict(timeout="5"), TypeError, "timeout must be a number of seconds, not str"),
            (dict(push_max_tokens=1.5), TypeError, "push_max_tokens must be an int, not float"),
            (dict(block_threads=0), ValueError, "block_threads must be >= 1; got 0"),
            (dict(grid_blocks="4"), TypeError, "grid_blocks must be an int, not str"),
            (dict(max_tokens=4), TypeError, r"AllToAll\(\) got unexpected keyword arguments \['max_tokens'\]"),
            (dict(backend=3), TypeError, "backend must be one of hip, cuda, host or a Backend, not int"),
            (dict(device="0"), TypeError, "device must be an int, not str"),
            (dict(in_dtype=None), TypeError, "in_dtype must be one of float16, bfloat16, not None")):
        with pytest.raises(error, match=message):
            AllToAll(comm, **{**shape, **wrong})
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator"):
        AllToAll("x", **shape)
    with pytest.raises(ValueError, match=r"engine must be one of \('nccl', 'mpi'\) or None, not 'gloo'"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, engine="gloo")
    # A script that names its engine between nodes runs within one node too (where it goes unused).
    AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, engine="mpi").close()


def case_one_rank_refuses_its_arguments(comm):
    """A rank whose arguments are refused (its parameters, an engine, its device that will not open, kernels its
    device will not load) raises its own error and tells the other ranks before anything collective: they raise
    ConfigMismatchError naming it and its words at once, not a timeout, nor a hang in MPI. Across nodes a node
    whose part failed tells the other nodes so, naming its ranks. Then every rank makes the object again, and it
    works."""
    import os
    import time

    from pyhipa2a import CollectiveMatmul, ConfigMismatchError
    rank, world = comm.Get_rank(), comm.Get_size()
    if world < 2:
        pytest.skip("one rank has no peer to tell")
    last = world - 1
    shape = dict(num_experts=2 * world, experts_per_token=2, hidden_dim=64, max_num_tokens=4, timeout=20.0)
    matmul = dict(max_rows=4 * world, k=16, n=8, dtype="float16", timeout=20.0)
    kernel_choice = "PYHIPA2A_COMBINE_KERNEL"
    for make, wrong, error, words in (
            (AllToAll, dict(num_experts=2 * world + 1), ValueError, "divisible by the number of ranks"),
            (AllToAll, dict(bogus=1), TypeError, "unexpected keyword arguments"),
            (AllToAll, dict(backend="nope"), ValueError, "unknown backend 'nope'"),
            (AllToAll, dict(engine="gloo"), ValueError, "engine must be one of"),
            (AllToAll, dict(block_threads=100), ValueError, "block_threads=100 must be a multiple of 32"),
            (AllToAll, dict(device=99), ValueError, "device 99 does not exist"),
            (AllToAll, {kernel_choice: "nope"}, ValueError, f"{kernel_choice} must be one of"),
            (CollectiveMatmul, dict(k=0), ValueError, "k must be >= 1; got 0")):
        given = {**(shape if make is AllToAll else matmul), **(wrong if rank == last else {})}
        start = time.monotonic()
        os.environ.update({name: given.pop(name) for name in list(given) if name.startswith("PYHIPA2A_")})
        try:
            if rank == last:
                with pytest.raises(error, match=words):
                    make(comm, **given)
            else:
                with pytest.raises(ConfigMismatchError, match=f"rank {last} refused its arguments .*{words}") as info:
                    make(comm, **given)
                assert last in info.value.ranks  # (a node's peers name the ranks there that learnt it from it too)
        finally:
            os.environ.pop(kernel_choice, None)
        assert time.monotonic() - start < 10.0, (make, wrong)  # (told at once: far from the 20 s timeout)
    with AllToAll(comm, **shape) as a2a:
        inputs = draw_world(5, world, 2 * world, 2, 64, 4)
        d = a2a.dispatch(inputs.xs[rank], inputs.indices[rank])
        a2a.combine(a2a.fake_expert(d), inputs.weights[rank])
        a2a.synchronize()


def case_after_close(comm):
    """After close() the object refuses its calls and synchronize(), and its outputs, whose memory is freed,
    refuse every read, write and export."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 16, 4
    inputs = draw_world(3, world, E, k, H, M)
    a2a = AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    me = a2a.rank
    d = a2a.dispatch(inputs.xs[me], inputs.indices[me])
    y = a2a.combine(a2a.fake_expert(d), inputs.weights[me])
    y.numpy()
    assert not a2a.closed
    a2a.close()
    assert a2a.closed
    for way in (y.numpy, d.expert_x.numpy, d.expert_num_tokens.numpy, y.__dlpack__, lambda: y.fill_bytes(0),
                lambda: y.copy_from(np.zeros(y.shape, y.dtype))):
        with pytest.raises(A2AError, match="its memory was freed by close\\(\\)"):
            way()
    for call in (a2a.synchronize, lambda: a2a.dispatch(inputs.xs[me], inputs.indices[me]), lambda: a2a.fake_expert(d),
                 a2a.x_buffer, a2a.expert_y_buffer):
        with pytest.raises(A2AError, match="AllToAll is closed"):
            call()
    a2a.close()  # (idempotent)


def case_config_mismatch(comm):
    """Ranks disagreeing on the configuration are named, on every rank, with what they disagree on."""
    world = comm.Get_size()
    if world == 1:
        pytest.skip("one rank cannot disagree with itself")
    odd = world - 1
    H = 64 if comm.Get_rank() != odd else 128
    with pytest.raises(pyhipa2a.ConfigMismatchError,
                       match=rf"ranks \[{odd}\] .*rank {odd}: hidden_dim 128 \(rank 0: 64\)") as info:
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=H, max_num_tokens=4)
    assert info.value.ranks == (odd,)
    # The push threshold sizes buffers and decides how peers read each other: it must agree too.
    push = 4 if comm.Get_rank() != odd else 2
    with pytest.raises(pyhipa2a.ConfigMismatchError, match=rf"ranks \[{odd}\].*push_max_tokens") as info:
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=64, max_num_tokens=4, push_max_tokens=push)
    assert info.value.ranks == (odd,)
    # Across nodes (one rank a node) each node's part agrees with itself: the nodes are compared too.
    with pytest.raises(pyhipa2a.ConfigMismatchError, match=rf"ranks \[{odd}\]") as info:
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=H, max_num_tokens=4, ranks_per_node=1)
    assert info.value.ranks == (odd,)


def case_peer_skips_call(comm):
    """A rank that never calls dispatch is named by the others within timeout + 2 s; no hang."""
    import time
    world = comm.Get_size()
    if world == 1:
        pytest.skip("needs a peer to go missing")
    late = world - 1
    with AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=64, max_num_tokens=4,
                  timeout=2.0) as a2a:
        inputs = draw_world(5, world, world, 1, 64, 4, token_counts=[4] * world)
        if a2a.rank != late:
            start = time.monotonic()
            a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])
            with pytest.raises(pyhipa2a.A2ATimeoutError, match=f"dispatch flag of rank {late}") as info:
                a2a.synchronize()
            elapsed = time.monotonic() - start
            assert late in info.value.ranks
            assert elapsed < 2.0 + 2.0, f"timeout took {elapsed:.1f} s"
            with pytest.raises(A2AError, match="unusable after an earlier failure"):
                a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])
        comm.Barrier()  # the late rank closes only after the others saw the timeout


def case_another_device_current(comm, rounds="3"):
    """Another library leaves a different context current on our thread between our calls (JAX did, with
    two GPUs visible to each rank: cuEventRecord on our stream then failed with an invalid handle).
    Before every public call here another context is made current: the next GPU's primary context where
    the process sees two, else a second context on our GPU. Each call must switch back, the results
    must match the oracle, a captured step must replay, and memory, events and streams made after the
    switch must be in our context (on our GPU)."""
    from pyhipa2a.testing import (check_call, check_dispatch_against_oracle, combine_error_against_oracle,
                                  free_inputs, oracle_expert, poison, upload_inputs)
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 32
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        if a2a.backend.kind != "cuda":
            pytest.skip("contexts are the CUDA driver's")
        from cuda.bindings import driver

        def ok(result):
            assert not result[0], result[0]
            return result[1] if len(result) > 1 else None
        ours = ok(driver.cuCtxGetCurrent())
        other = ok(driver.cuDeviceGet((a2a.heap.device.index + 1) % a2a.heap.device.count))
        if a2a.heap.device.count > 1:
            theirs = ok(driver.cuDevicePrimaryCtxRetain(other))
            release = lambda: ok(driver.cuDevicePrimaryCtxRelease(other))  # noqa: E731
        else:
            try:  # CUDA 13's signature, then 12's
                theirs = ok(driver.cuCtxCreate(None, 0, other))
            except TypeError:
                theirs = ok(driver.cuCtxCreate(0, other))
            ok(driver.cuCtxSetCurrent(ours))
            release = lambda: ok(driver.cuCtxDestroy(theirs))  # noqa: E731
        assert int(theirs) != int(ours)

        def elsewhere():
            ok(driver.cuCtxSetCurrent(theirs))
        elsewhere()
        buffer = a2a.expert_y_buffer()  # the first allocation after construction: in our context all the same
        assert int(ok(driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT,
                                                   buffer.ptr))) == int(ours)
        me = a2a.rank
        for i in range(int(rounds)):
            inputs = draw_world(900 + i, world, E, k, H, M)
            poison(a2a)
            elsewhere()
            d = dispatch(a2a, inputs)
            elsewhere()
            expert_y = a2a.fake_expert(d)
            elsewhere()
            a2a.synchronize()
            elsewhere()
            check_dispatch_against_oracle(a2a, inputs, d)
            elsewhere()
            y = a2a.combine(expert_y, inputs.weights[me])
            elsewhere()
            a2a.synchronize()
            elsewhere()
            err = combine_error_against_oracle(a2a, inputs, y, None, oracle_expert(a2a, False))
            print(f"rank {me} round {i}: max err {err:.3g}")
        inputs = draw_world(999, world, E, k, H, M)
        elsewhere()
        x, idx, w = arrays = upload_inputs(a2a, inputs)
        outputs = {}

        def step():
            outputs["d"] = a2a.dispatch(x, idx)
            outputs["y"] = a2a.combine(a2a.fake_expert(outputs["d"]), w)
        graph = a2a.capture(step)
        poison(a2a)
        elsewhere()
        graph.launch()
        elsewhere()
        a2a.synchronize()
        check_call(a2a, inputs, outputs["d"], outputs["y"])
        graph.close()
        free_inputs(a2a, arrays)
        # A caller's own events and streams from our backend (the bench's timing events, made after JAX
        # had switched contexts) must be ours too: recording them on our streams failed before.
        elsewhere()
        b = a2a.backend
        start, end, stream = b.event_create(), b.event_create(), b.stream_create()
        elsewhere()
        b.event_record(start, a2a.stream)
        b.stream_wait_event(stream, start)
        b.event_record(end, stream)
        b.event_synchronize(end)
        assert b.event_elapsed_ms(start, end) >= 0
        b.stream_destroy(stream)
        b.event_destroy(start)
        b.event_destroy(end)
        release()
