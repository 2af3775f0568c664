"""Multi-rank cases of PyTorch, CuPy and JAX arrays in and out (run under mpiexec by the tests).

Every case draws the whole world's inputs from a seed, poisons the outputs,
runs the library and checks this rank's outputs against pyhipa2a.reference.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import AllToAll, producers
from tests.cases import calls_watched
from pyhipa2a.testing import (draw_world)


def _framework(lib, device_index):
    """(to_device, fill_later, consume, finish, current, drain, handle) for one producer library: to_device(numpy)
    makes its array; fill_later(dst, src) queues dst = src behind several milliseconds of other work
    on a stream of the library's own (None for JAX, whose arrays are immutable: to_device queues a
    computation instead); consume(our_array) takes one of our outputs through DLPack (the library
    names its stream, we make it wait on the device) and queues work on it; finish(array) brings a
    library array to the host; current() makes the library's producer stream current; drain(arrays)
    waits on the host until the library's queued work, these arrays' included, is done; handle() is the
    library's current stream's handle (None: JAX names none)."""
    if lib == "torch":
        torch = pytest.importorskip("torch")
        torch.cuda.set_device(device_index)
        producer = torch.cuda.Stream()
        busy = torch.zeros(1 << 27, device="cuda")

        def fill_later(dst, src):
            with torch.cuda.stream(producer):
                for _ in range(16):
                    busy.add_(1.0)
                dst.copy_(src)
        return (lambda a: torch.from_numpy(a).cuda(), fill_later, lambda ours: torch.from_dlpack(ours) * 1,
                lambda t: t.cpu().numpy(), lambda: torch.cuda.stream(producer), lambda arrays: torch.cuda.synchronize(),
                lambda: torch.cuda.current_stream().cuda_stream)
    if lib == "cupy":
        cp = pytest.importorskip("cupy")
        cp.cuda.Device(device_index).use()
        producer = cp.cuda.Stream(non_blocking=True)
        busy = cp.zeros(1 << 27, cp.float32)

        def fill_later(dst, src):
            with producer:
                for _ in range(16):
                    busy.__iadd__(1.0)
                dst[...] = src
        return (cp.asarray, fill_later, lambda ours: cp.from_dlpack(ours) * 1, cp.asnumpy, lambda: producer,
                lambda arrays: cp.cuda.Device().synchronize(), lambda: cp.cuda.get_current_stream().ptr)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    dev = [d for d in jax.devices() if d.platform == "gpu"][device_index]
    busy, compiled = None, {}

    @jax.jit
    def after_busy_work(busy, a):  # (one dispatch: queueing JAX's eager operations costs the host more
        busy = jax.lax.fori_loop(0, 64, lambda _, b: b + 1.0, busy)  # than 512 MiB costs the device)
        return busy, a + (busy[0] * 0).astype(a.dtype)

    def produce(a):  # JAX arrays are immutable: the "late write" is a computation still queued
        nonlocal busy
        if busy is None:
            busy = jax.device_put(np.zeros(1 << 27, np.float32), dev)
        a = jax.device_put(a, dev)
        work = compiled.get((a.shape, a.dtype))  # (compiled ahead: the first array must not finish meanwhile)
        if work is None:
            work = compiled[a.shape, a.dtype] = after_busy_work.lower(busy, a).compile()
        busy, late = work(busy, a)
        return late
    return (produce, None, lambda ours: jnp.from_dlpack(ours) * 1, np.asarray, contextlib.nullcontext,
            lambda arrays: [a.block_until_ready() for a in arrays], lambda: None)


def case_framework_arrays(comm, lib, producer_order="protocol", calls_on="own"):
    """x, indices and weights from torch, CuPy or JAX, written late on the library's own stream; the
    library's arrays are passed as they are (no wrapper), the calls name no stream, and the outputs
    are consumed by the same library through DLPack with no host wait in between. Inputs read too
    early are zeros and an output read too early is poison: either fails. Checked against the oracle
    with gpu-mode's tolerance (allclose rtol=1e-2, atol=5e-3). producer_order="stream": the caller
    orders the producer before the call itself (here: a synchronize of the producer's stream).
    calls_on="current" (AllToAll(stream="current")): the calls run on the library's current stream
    (JAX names none: our own), which the outputs name."""
    from pyhipa2a.testing import check_dispatch_against_oracle, poison
    from pyhipa2a import reference
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  producer_order=producer_order, stream=calls_on, outputs="ours") as a2a:
        me = a2a.rank
        to_device, fill_later, consume, finish, current, drain, handle = _framework(lib, a2a.heap.device.index)
        T = M // 2
        zeros = [np.zeros((T, H), np.float16), np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)]
        arrays = [to_device(z) for z in zeros]  # the same objects every round (cached descriptions)
        for i in range(3):
            inputs = draw_world(500 + i, world, E, k, H, M, token_counts=[T] * world)
            host = (inputs.xs[me], inputs.indices[me], inputs.weights[me])
            poison(a2a)
            with current():
                if fill_later is None:
                    arrays = [to_device(h) for h in host]  # new JAX arrays each round, still computing
                    assert not any(a.is_ready() for a in arrays), i
                else:
                    for dst, h in zip(arrays, host):
                        fill_later(dst, to_device(h))
                if producer_order == "stream":
                    comm.Barrier()
                    a2a.backend.stream_synchronize(None)  # the caller's own ordering: everything done
                    drain(arrays)
                d = a2a.dispatch(arrays[0], arrays[1])
                y = a2a.combine(d.expert_x, arrays[2], expert_scale=1 + me)
                theirs = handle() if calls_on == "current" else None
                # (a library's default stream is the legacy one: 1 on CUDA, 0 on HIP)
                ran_on = (a2a.backend.stream_handle(a2a.stream) if theirs is None
                          else 0 if (theirs or 1) == 1 and a2a.backend.kind == "hip" else theirs or 1)
                assert a2a.backend.stream_handle(d.expert_x.stream) == ran_on, (lib, calls_on)
                assert a2a.backend.stream_handle(y.stream) == ran_on, (lib, calls_on)
                # consumed and read back on the library's stream (its reads follow its own work there)
                got = finish(consume(y)).astype(np.float64)
                counts = finish(consume(d.expert_num_tokens))
            expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                         reference.fused_expert([1 + r for r in range(world)]), ranks=[me])[me]
            assert np.allclose(got, expected, rtol=1e-2, atol=5e-3), (lib, i, np.abs(got - expected).max())
            a2a.synchronize()
            assert (counts == d.expert_num_tokens.numpy()).all()
            check_dispatch_against_oracle(a2a, inputs, d)
        print(f"rank {me} {lib} ({producer_order}): 3 rounds match the oracle")


def _late_written_step(a2a, tools, inputs, stream, what) -> None:
    """One step on new arrays of a library (`tools`: _framework's), each written late on its own stream:
    dispatch, combine with the fused expert, y consumed by the library with no host wait, on poisoned
    outputs; y and the dispatch's outputs against the oracle (`what` names the step in a failure)."""
    from pyhipa2a import reference
    from pyhipa2a.testing import check_dispatch_against_oracle, poison
    to_device, fill_later, consume, finish, current, _, _ = tools
    me, world, E = a2a.rank, a2a.world, a2a.config.num_experts
    poison(a2a)
    with current():
        arrays = [to_device(np.zeros_like(h)) for h in (inputs.xs[me], inputs.indices[me], inputs.weights[me])]
        for dst, h in zip(arrays, (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
            fill_later(dst, to_device(h))  # (new objects in new memory, written late)
        d = a2a.dispatch(arrays[0], arrays[1], stream=stream)
        y = a2a.combine(d.expert_x, arrays[2], expert_scale=1 + me, stream=stream)
        got = finish(consume(y)).astype(np.float64)
    expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                 reference.fused_expert([1 + r for r in range(world)]), ranks=[me])[me]
    assert np.allclose(got, expected, rtol=1e-2, atol=5e-3), (what, np.abs(got - expected).max())
    a2a.synchronize()
    check_dispatch_against_oracle(a2a, inputs, d)


def new_arrays_shape(world: int) -> tuple:
    """(E, k, H, M) of the cases of new arrays at every call."""
    return 8 * world, 4, 2048, 64


@contextlib.contextmanager
def _new_arrays_object(comm, lib: str, calls_on: str):
    """(AllToAll handing out our arrays, its calls watched, `lib`'s tools) for the cases of new arrays."""
    E, k, H, M = new_arrays_shape(comm.Get_size())
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream=calls_on,
                  outputs="ours") as a2a, calls_watched() as watched:
        yield a2a, watched, _framework(lib, a2a.heap.device.index)


def _forget_element_types(array) -> None:
    """Make the probe of `array`'s library forget the element types it learned: a case before in the process (the
    tests' pool of jobs) may have taught them, and a case's first call must learn them, as a program's does."""
    producers.stream_source(array).element_types.clear()


def case_new_framework_arrays_at_every_call(comm, lib, calls_on="own"):
    """New PyTorch or CuPy arrays at every call (a layer's activations, a router's output), each written
    late on the library's own stream, with another token count at most calls, some given a stream object
    of the library's own (and a new object for it: PyTorch makes one at each current_stream()): every call
    takes the full path, the first one's arrays through their protocols (each element type learned once),
    the later ones' each described by its probe's view alone. Every call must wait for the stream the
    library names, or read zeros or the last round's data. Each round on poisoned outputs against the
    oracle, the results consumed by the library with no host wait."""
    world = comm.Get_size()
    E, k, H, M = new_arrays_shape(world)
    with _new_arrays_object(comm, lib, calls_on) as (a2a, watched, tools):
        me = a2a.rank
        if lib == "torch":  # (the stream object lives to the end: its handle is used after it)
            import torch
            side = torch.cuda.Stream()
            side_again = torch.cuda.ExternalStream(side.cuda_stream)  # (a new object for it, as PyTorch makes)
            _forget_element_types(torch.empty(1, device=f"cuda:{a2a.heap.device.index}"))
        else:
            import cupy
            side = cupy.cuda.Stream(non_blocking=True)
            side_again = cupy.cuda.ExternalStream(side.ptr)
            _forget_element_types(cupy.empty(1))
        for i, (T, given) in enumerate(((32, None), (16, None), (32, None), (64, None), (8, side), (16, side_again))):
            inputs = draw_world(900 + i, world, E, k, H, M, token_counts=[T] * world)
            watched.clear()
            _late_written_step(a2a, tools, inputs, given, (lib, calls_on, i))
            # (expert_y is our own array: "own")
            protocols = ["probed"] * 3 if i else ["cai" if lib == "cupy" else "dlpack"] * 3
            assert watched.plans == [] and watched.described == [*protocols[:2], "own", protocols[2]], \
                (i, watched.plans, watched.described)
        print(f"rank {me} {lib} ({calls_on}): 6 rounds of new arrays match the oracle")


def case_new_framework_arrays_like_the_last(comm, lib, calls_on="own"):
    """New PyTorch or CuPy arrays at every call, of one token count, each written late on the library's own
    stream (a training loop's activations and router outputs): from the third call on, each leg's plan
    takes the call, its new arrays standing in for the last (their pointers written into the launch). Every
    call must still wait for the stream the library names, or read zeros or the last step's data. Another
    token count takes the full path until two calls of it were made. Each step on poisoned outputs against
    the oracle."""
    world = comm.Get_size()
    E, k, H, M = new_arrays_shape(world)
    with _new_arrays_object(comm, lib, calls_on) as (a2a, watched, tools):
        me = a2a.rank
        for i, T in enumerate((32, 32, 32, 32, 32, 16, 16, 16)):
            inputs = draw_world(1000 + i, world, E, k, H, M, token_counts=[T] * world)
            watched.clear()
            _late_written_step(a2a, tools, inputs, None, (lib, calls_on, i))
            # (16 tokens from step 5: the plans miss, and take the calls again from step 7)
            want = [True, True] if i in (2, 3, 4, 7) else [False, False] if i == 5 else []
            assert watched.plans == want, (lib, calls_on, i, watched.plans)
        print(f"rank {me} {lib} ({calls_on}): 8 steps of new arrays like the last match the oracle")


def case_new_jax_arrays_at_every_call(comm):
    """New JAX arrays at every call, as a JAX program makes them (immutable: each layer's activations
    and router outputs are new arrays), with another token count at most calls. A finished array
    (is_ready) is described by its view and held by its plain export (naming no stream): the first call
    learns each element type through its export for the call's stream, later ones describe each finished
    array by its view, on our stream or another. While a call may still read an input, JAX must not
    donate its buffer (the
    hold is an external reference: JAX refuses). An array whose computation is still queued goes
    through its export, which makes our stream wait for it on the device: read early, it would be
    another array's data. Each round on poisoned outputs against the oracle, the results consumed by JAX
    with no host wait."""
    from pyhipa2a import reference
    from pyhipa2a.testing import check_dispatch_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, outputs="ours") as a2a, \
            calls_watched() as watched:
        me = a2a.rank
        _, _, consume, finish, _, drain, _ = _framework("jax", a2a.heap.device.index)
        import jax
        dev = [d for d in jax.devices() if d.platform == "gpu"][a2a.heap.device.index]
        busy = jax.device_put(np.zeros(1 << 27, np.float32), dev)

        @jax.jit
        def after_busy_work(busy, x, indices, weights):  # (one dispatch: JAX's eager ops cost the host more
            busy = jax.lax.fori_loop(0, 64, lambda _, b: b + 1.0, busy)  # than 512 MiB costs the device)
            zero = busy[0] * 0
            return busy, x + zero.astype(x.dtype), indices + zero.astype(indices.dtype), weights + zero
        donate = jax.jit(lambda a: a * 2, donate_argnums=0)
        array_type = type(jax.device_put(np.zeros(1, np.float32), dev))
        exports, export = [], array_type.__dlpack__  # (the stream each export names; None: a hold)
        array_type.__dlpack__ = lambda self, stream=None, **kw: (exports.append(stream),
                                                                  export(self, stream=stream, **kw))[1]
        _forget_element_types(busy)
        other = a2a.backend.stream_create()
        try:
            for i, (T, finished, given) in enumerate(((32, True, None), (16, True, None), (32, True, None),
                                                      (64, False, None), (8, True, None), (16, True, other))):
                inputs = draw_world(950 + i, world, E, k, H, M, token_counts=[T] * world)
                host = (inputs.xs[me], inputs.indices[me], inputs.weights[me])
                poison(a2a)
                if finished:
                    arrays = [jax.device_put(h, dev) for h in host]
                    drain(arrays)
                else:  # (behind milliseconds of JAX's own work)
                    busy, *arrays = after_busy_work(busy, *(jax.device_put(h, dev) for h in host))
                assert [a.is_ready() for a in arrays] == [finished] * 3, (i, [a.is_ready() for a in arrays])
                exports.clear(), watched.clear()
                d = a2a.dispatch(arrays[0], arrays[1], stream=given)
                y = a2a.combine(d.expert_x, arrays[2], expert_scale=1 + me, stream=given)
                calls = (list(watched.plans), [p for p in watched.described if p != "own"],
                         [s is None for s in exports])
                if finished:
                    try:  # (JAX may also refuse it outright)
                        donate(arrays[0])
                    except Exception:
                        pass
                    assert not arrays[0].is_deleted(), (i, "donated while a call may read it")
                got = finish(consume(y)).astype(np.float64)
                expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                             reference.fused_expert([1 + r for r in range(world)]), ranks=[me])[me]
                assert np.allclose(got, expected, rtol=1e-2, atol=5e-3), (i, np.abs(got - expected).max())
                a2a.synchronize(given)
                check_dispatch_against_oracle(a2a, inputs, d)
                exported = [False] * 3  # (x's, the indices' and the weights' export for the call's stream)
                if i == 0 or not finished:  # each element type learned, or each unfinished array, through its export
                    assert calls == ([], ["dlpack"] * 3, exported), (i, calls)
                else:  # each array described by its view and held by its plain export
                    assert calls == ([], ["probed"] * 3, [True] * 3), (i, calls)
        finally:
            array_type.__dlpack__ = export
            a2a.synchronize()
            a2a.backend.stream_destroy(other)
        print(f"rank {me} jax: 6 rounds of new arrays match the oracle")


def case_producer_arrays_seen_before(comm, lib, calls_on="own"):
    """The arrays a boundary has seen before are asked through their own attributes
    (pyhipa2a.producers), not their protocols. PyTorch: the same tensors every round, round 2's x
    moved to new memory in place (`set_`, as `t.data = ...` does) and the others refilled late on
    PyTorch's current stream; a call that kept x's old pointer, or did not wait for that stream,
    reads the last round's data or zeros. JAX: the same arrays (their computation still queued at
    the first call) passed to three calls. Each call on poisoned outputs against the oracle.
    calls_on="current": the calls run on PyTorch's current stream, so the arrays need no wait and a call
    repeats the last one (round 3) unless what the arrays say has changed (round 2)."""
    from pyhipa2a.testing import check_dispatch_against_oracle, combine_error_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    T = M // 2
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream=calls_on,
                  outputs="ours") as a2a:
        me = a2a.rank
        to_device, fill_later, _, _, current, _, _ = _framework(lib, a2a.heap.device.index)
        arrays = None
        for i in range(3):
            inputs = draw_world(700 + (i if lib == "torch" else 0), world, E, k, H, M, token_counts=[T] * world)
            host = (inputs.xs[me], inputs.indices[me], inputs.weights[me])
            poison(a2a)
            with current():
                if arrays is None:
                    if lib == "jax":  # (the late work compiled for these shapes first: none may finish meanwhile)
                        [to_device(np.zeros_like(h)) for h in host]
                    arrays = [to_device(h) for h in host]
                    assert lib == "torch" or not any(a.is_ready() for a in arrays)
                elif lib == "torch":
                    arrays[0].set_(to_device(np.zeros_like(host[0])))  # new memory behind the same tensor
                    for dst, h in zip(arrays, host):
                        fill_later(dst, to_device(h))
                d = a2a.dispatch(arrays[0], arrays[1])
                y = a2a.combine(a2a.fake_expert(d), arrays[2])
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, d)
            err = combine_error_against_oracle(a2a, inputs, y)
            print(f"rank {me} {lib} round {i}: max err {err:.3g}")


def _library_io(lib: str, device_index: int | None):
    """(to_device(numpy), consume(output): work queued on it by the library right away, the type of the outputs
    a call on the library's arrays hands out) for PyTorch, CuPy or JAX (whose calls hand out our own arrays,
    imported by JAX); device_index None: the host backend's (CPU) arrays."""
    if lib == "torch":
        torch = pytest.importorskip("torch")
        dev = torch.device("cpu") if device_index is None else torch.device("cuda", device_index)
        if device_index is not None:
            torch.cuda.set_device(dev)
        return lambda a: torch.from_numpy(a).to(dev), lambda t: t.float() * 2, torch.Tensor
    if lib == "cupy":
        if device_index is None:
            pytest.skip("CuPy's arrays live on GPUs")
        cp = pytest.importorskip("cupy")
        cp.cuda.Device(device_index).use()
        return cp.asarray, lambda a: a.astype(cp.float32) * 2, cp.ndarray
    jax = pytest.importorskip("jax")
    devices = jax.devices("cpu") if device_index is None else [d for d in jax.devices() if d.platform == "gpu"]
    dev = devices[0 if device_index is None else device_index]
    from pyhipa2a.array import DeviceArray
    return (lambda a: jax.device_put(a, dev), lambda a: jax.dlpack.from_dlpack(a).astype(np.float32) * 2,
            DeviceArray)


def case_outputs_in_the_callers_library(comm, lib, calls_on="own", rounds="4"):
    """outputs="inputs" (the default): calls on PyTorch's or CuPy's arrays hand out that library's arrays,
    views of our buffers made once (the same objects at each call of a token count); calls on JAX's hand
    out ours. Each output is consumed by the library right after the call, with no host wait (on the GPU
    on the library's stream, which the call must order after its own, or JAX's import must): read too
    early, it is the poison of the round before. Each round has new values and its own token counts, on
    poisoned outputs, against the oracle; outputs="ours" hands out DeviceArray."""
    from pyhipa2a import reference
    from pyhipa2a.array import DeviceArray
    from pyhipa2a.testing import check_dispatch_against_oracle, host_copy, poison
    world = comm.Get_size()
    E, k, H, M = 4 * world, 2, 256, 16
    host = pyhipa2a.get_backend().kind == "host"
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream=calls_on) as a2a:
        me = a2a.rank
        to_device, consume, array_type = _library_io(lib, None if host else a2a.heap.device.index)
        handed = {}
        for i in range(int(rounds)):
            counts = [(M, M // 2, M, 3)[i % 4] - r % 2 for r in range(world)]
            inputs = draw_world(1100 + i, world, E, k, H, M, token_counts=counts)
            poison(a2a)
            x, idx, w = (to_device(h) for h in (inputs.xs[me], inputs.indices[me], inputs.weights[me]))
            d = a2a.dispatch(x, idx)
            y = a2a.combine(d.expert_x, w, expert_scale=1 + me)
            doubled, counted = consume(y), consume(d.expert_num_tokens)  # queued before anything waits
            outputs = (d.expert_x, d.expert_num_tokens, d.expert_meta, y)
            assert all(isinstance(a, array_type) for a in outputs), [type(a) for a in outputs]
            assert tuple(y.shape) == (counts[me], H)
            if counts[me] in handed:  # made once: the same objects again
                assert all(a is b for a, b in zip(handed[counts[me]], (d, y))), i
            handed[counts[me]] = (d, y)
            expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                         reference.fused_expert([1 + r for r in range(world)]), ranks=[me])[me]
            got = host_copy(doubled).astype(np.float64) / 2
            assert np.allclose(got, expected, rtol=1e-2, atol=5e-3), (lib, i, np.abs(got - expected).max())
            a2a.synchronize()
            assert (host_copy(counted) / 2 == host_copy(d.expert_num_tokens)).all()
            check_dispatch_against_oracle(a2a, inputs, d)
            print(f"rank {me} {lib} round {i}: T={counts[me]} matches the oracle")
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, outputs="ours") as a2a:
        inputs = draw_world(1199, world, E, k, H, M)
        x, idx, w = (to_device(h) for h in (inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank]))
        d = a2a.dispatch(x, idx)
        y = a2a.combine(d.expert_x, w, expert_scale=1 + a2a.rank)
        assert isinstance(d.expert_x, DeviceArray) and isinstance(y, DeviceArray)
        a2a.synchronize()
        check_dispatch_against_oracle(a2a, inputs, d)


# -- fp8 dispatch --------------------------------------------------------------------------------------

