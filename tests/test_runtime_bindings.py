"""GPU-free checks of the CUDA and HIP backends against the installed bindings.

Neither backend can run here (no libcuda, no libamdhip64), so these tests pin
what can be checked without a device: every binding name the code uses
exists, failures become RuntimeFailure naming the call, IPC handles survive
the bytes round trip, and each method's arguments get past the binding's
Python-side conversion (a TypeError there would otherwise first show up on a
GPU machine).
"""
import ctypes
import types

import numpy as np
import pytest

from pyhipa2a.runtime import cuda as cuda_rt
from pyhipa2a.runtime import driver as driver_rt
from pyhipa2a.runtime import hip as hip_rt
from pyhipa2a.runtime.base import WAIT, WRITE, Launcher
from pyhipa2a.errors import RuntimeFailure


@pytest.fixture(params=["cuda", "hip"])
def rt(request):
    """(backend module, binding module, success code, an error code)."""
    if request.param == "cuda":
        pytest.importorskip("cuda.bindings.driver")
        d = cuda_rt._load()
        return cuda_rt, d, d.CUresult.CUDA_SUCCESS, d.CUresult.CUDA_ERROR_INVALID_VALUE
    pytest.importorskip("hip")  # hip.hip is an attribute of the package, not a submodule
    h = hip_rt._load()
    return hip_rt, h, h.hipError_t.hipSuccess, h.hipError_t.hipErrorInvalidValue


@pytest.mark.parametrize("value,refused", [(None, False), ("0", False), ("false", False), ("1", True),
                                           ("true", True)])
def test_hip_refuses_stream_waits_where_rocm_waits_on_signal_memory_only(monkeypatch, value, refused):
    """ROCm with GPU_STREAMOPS_CP_WAIT set waits for a word on the command processor, and only on HSA signal
    memory: the heap's words are not, so groups and collective matmuls refuse to start (the method reads no
    runtime, so no ROCm is needed here); CUDA waits on any device memory."""
    if value is None:
        monkeypatch.delenv("GPU_STREAMOPS_CP_WAIT", raising=False)
    else:
        monkeypatch.setenv("GPU_STREAMOPS_CP_WAIT", value)
    why = hip_rt.HipBackend.stream_waits_refused(object.__new__(hip_rt.HipBackend))
    assert (why is not None) == refused and (not refused or "unset GPU_STREAMOPS_CP_WAIT" in why), why
    assert cuda_rt.CudaBackend.stream_waits_refused(object.__new__(cuda_rt.CudaBackend)) is None


def test_modules_import_and_describe_themselves():
    assert (cuda_rt.CudaBackend.kind, cuda_rt.CudaBackend.code_suffix) == ("cuda", ".fatbin")
    assert (hip_rt.HipBackend.kind, hip_rt.HipBackend.code_suffix) == ("hip", ".hsaco")
    assert cuda_rt.CudaBackend.dlpack_device_type == 2
    assert hip_rt.HipBackend.dlpack_device_type == 10


def test_every_used_binding_name_exists(rt):
    mod, binding, _, _ = rt
    missing = [name for name in mod._USED_CALLS if not hasattr(binding, name)]
    assert not missing


def test_used_calls_lists_every_call_in_the_source(rt):
    # Keeps _USED_CALLS honest: a call added to the code but not to the list
    # would escape the existence check above. The names the shared methods of
    # driver.DriverBackend call come from the module's _CALLS table.
    import re
    mod, _, _, _ = rt
    prefix = "driver" if mod is cuda_rt else "hip"
    source = open(mod.__file__).read()
    used = set(re.findall(rf"\b{prefix}\.(\w+)", source)) | set(mod._CALLS.values())
    assert used == set(mod._USED_CALLS), used ^ set(mod._USED_CALLS)


def test_call_tables_cover_every_role_the_shared_code_uses(rt):
    # A role missing from a table would otherwise first fail (KeyError) on a GPU.
    import re
    mod, _, _, _ = rt
    source = open(driver_rt.__file__).read()
    roles = set(re.findall(r'(?:_call|_CALLS\[)\(?"(\w+)"', source))
    streamed = set(re.findall(r'_on_stream\("(\w+)"', source))
    roles |= streamed | {role + "_async" for role in streamed}
    assert roles == set(driver_rt.ROLES), roles ^ set(driver_rt.ROLES)
    assert set(mod._CALLS) == set(driver_rt.ROLES), set(mod._CALLS) ^ set(driver_rt.ROLES)
    backend = mod.CudaBackend if mod is cuda_rt else mod.HipBackend
    assert backend._CALLS is mod._CALLS


def test_check_returns_values_on_success(rt):
    mod, _, ok, _ = rt
    assert mod._check((ok,), "x") is None
    assert mod._check((ok, 7), "x") == 7
    assert mod._check((ok, 7, 8), "x") == (7, 8)


# Without libamdhip64, hipGetErrorString reports its failed dlopen as an
# "unraisable" exception and returns no string; _check falls back to the enum name.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_check_raises_runtime_failure_naming_the_call(rt):
    mod, _, _, bad = rt
    with pytest.raises(RuntimeFailure) as info:
        mod._check((bad, None), "someCall")
    message = str(info.value)
    assert "someCall" in message
    assert bad.name in message  # from the runtime's string or, without a GPU, the enum


def test_ipc_handle_bytes_round_trip(rt):
    mod, _, _, _ = rt
    data = bytes(range(64))
    handle = mod._handle_from_bytes(data)
    assert mod._handle_to_bytes(handle) == data
    with pytest.raises(ValueError):
        mod._handle_from_bytes(data[:63])


def _bare_backend(mod, activate=None):
    # Skips __init__ (it would call cuInit/hipInit); the handle helpers need no device. No device was
    # opened, so activate() (which the allocating calls make first) is `activate` or does nothing.
    cls = mod.CudaBackend if mod is cuda_rt else mod.HipBackend
    backend = cls.__new__(cls)
    backend._streams, backend._capturing, backend._joined = set(), set(), set()
    backend._batches, backend._tapes = {}, {}
    backend.activate = activate or (lambda: None)
    return backend


def test_stream_handle_round_trip(rt):
    mod, _, _, _ = rt
    backend = _bare_backend(mod)
    assert backend.stream_handle(None) == 0
    assert backend.stream_handle(backend.stream_from_handle(0x1234)) == 0x1234


def test_calls_without_a_stream_finish_before_returning(rt):
    """A memset or copy given no stream waits for the null stream: cuMemsetD8 and hipMemset on
    device memory return before they are done, and our non-blocking streams do not wait for them
    (a poison fill still running under the next call's kernels corrupted it on two H200s)."""
    mod, _, _, _ = rt
    backend, calls = _bare_backend(mod), []
    backend._call = lambda role, *args: calls.append((role, args))
    ptr, host, stream = 1 << 40, np.zeros(4, np.uint32), backend.stream_from_handle(0x1234)
    for op, args in (("memset", (ptr, 0xFF, 16)), ("copy_device", (ptr, ptr + 64, 16)),
                     ("copy_to_device", (ptr, host)), ("copy_to_host", (host, ptr))):
        calls.clear()
        getattr(backend, op)(*args)
        assert [role for role, _ in calls][-1] == "stream_synchronize" and calls[-1][1] == (None,), (op, calls)
    calls.clear()
    backend.memset(ptr, 0xFF, 16, stream)  # on a stream: queued, nothing waits
    assert [role for role, _ in calls] == ["memset_d8_async"], calls


def test_activate_switches_back_only_when_another_device_is_current(rt, monkeypatch):
    """Another library may leave its own device current on our thread (JAX did on two H200s, and
    cuEventRecord on our stream then failed): every public entry calls activate(), which must make
    ours current again, and cost one query when it already is."""
    mod, binding, ok, _ = rt
    backend, calls = _bare_backend(mod), []
    del backend.activate  # the real one, under test here
    ours, theirs = (binding.CUcontext(0x1000), binding.CUcontext(0x2000)) if mod is cuda_rt else (1, 0)
    current = [theirs]
    if mod is cuda_rt:
        backend._context, backend._context_handle = ours, int(ours)  # (as open_device sets them)
        fake = types.SimpleNamespace(cuCtxGetCurrent=lambda: (ok, current[0]),
                                     cuCtxSetCurrent=lambda c: (calls.append(int(c)), current.__setitem__(0, c),
                                                                (ok,))[-1])
        monkeypatch.setattr(mod, "driver", fake)
    else:
        backend._opened = ours
        fake = types.SimpleNamespace(hipGetDevice=lambda: (ok, current[0]),
                                     hipSetDevice=lambda d: (calls.append(d), current.__setitem__(0, d), (ok,))[-1])
        monkeypatch.setattr(mod, "hip", fake)
    backend.activate()
    assert calls == [int(ours)] and int(current[0]) == int(ours)
    backend.activate()  # already ours: no switch
    assert calls == [int(ours)]


class _Activated(Exception):
    """Raised by a fake activate(): the call under test reached it before touching the binding."""


@pytest.mark.parametrize("call, args", [
    ("malloc_ipc", (64,)), ("malloc_host_mapped", (64,)), ("ipc_open", (bytes(64),)), ("stream_create", ()),
    ("event_create", ()), ("module_load", (b"image",)), ("memory_in_use", ())])
def test_calls_that_make_device_bound_things_activate_first(rt, call, args):
    """A caller's events, streams and memory from our backend must land in our context: the bench's
    events, made after JAX had left the other GPU's context current on rank 1 of two H100s, were made in
    that context, and recording them on our stream failed (CUDA_ERROR_INVALID_HANDLE)."""
    mod, _, _, _ = rt

    def activate():
        raise _Activated

    backend = _bare_backend(mod, activate)
    with pytest.raises(_Activated):
        getattr(backend, call)(*args)


def test_a_kept_capture_is_instantiated_in_our_context(rt):
    """The captured step may leave another library's context current (its own arrays' work): the
    executable graph is made after activate()."""
    mod, _, _, _ = rt
    calls = []
    backend = _bare_backend(mod, lambda: calls.append("activate"))
    backend._call = lambda role, *args: calls.append(role)
    stream = backend.stream_from_handle(0x1234)
    backend.capture_end(stream)
    assert calls == ["stream_end_capture", "activate", "graph_instantiate", "graph_destroy"], calls
    calls.clear()
    backend.capture_end(stream, keep=False)  # discarded: nothing made
    assert calls == ["stream_end_capture", "graph_destroy"], calls


def test_activate_before_a_device_is_opened_does_nothing(rt, monkeypatch):
    """A direct user of the backend who chose a device before opening one is not switched to device 0
    by the calls that activate."""
    mod, _, _, _ = rt
    backend = _bare_backend(mod)
    del backend.activate  # the real one
    if mod is cuda_rt:
        backend._context = None
        monkeypatch.setattr(mod, "driver", None)  # any binding call would fail
    else:
        backend._opened = None
        monkeypatch.setattr(mod, "hip", None)
    backend.activate()


def test_module_owner_is_the_opened_device(rt):
    """Modules are shared among objects by owner (kernels.py): none before a device is opened (a failed
    open included, which may have set current_device already), then the opened device's context."""
    mod, binding, _, _ = rt
    backend = _bare_backend(mod)
    backend.current_device = 1
    if mod is cuda_rt:
        backend._context = None
        assert backend.module_owner() is None
        backend._context = binding.CUcontext(0x1000)
        assert backend.module_owner() == ("cuda", 0x1000)
    else:
        backend._opened = None
        assert backend.module_owner() is None
        backend._opened = 1
        assert backend.module_owner() == ("hip", 1)


def _library_missing_error(mod, binding):
    """The exception the binding raises when its native library is absent, or None."""
    try:
        if mod is cuda_rt:
            binding.cuInit(0)
        else:
            binding.hipInit(0)
    except Exception as e:  # noqa: BLE001 - the type is what we are after
        return type(e)
    return None


def test_arguments_pass_binding_conversion(rt):
    mod, binding, _, _ = rt
    missing = _library_missing_error(mod, binding)
    if missing is None:
        pytest.skip("native runtime present: this dry run only works without it")
    backend = _bare_backend(mod)
    stream = backend.stream_from_handle(0x1234)
    if mod is cuda_rt:
        event, module, function = binding.CUevent(), binding.CUmodule(), binding.CUfunction()
        graph = binding.CUgraphExec()
    else:
        event = binding.ihipEvent_t.fromObj(0)
        module = binding.ihipModule_t.fromObj(0)
        function = binding.ihipModuleSymbol_t.fromObj(0)
        graph = binding.hipGraphExec.fromObj(0)
    host = np.zeros(8, np.uint32)
    pack = types.SimpleNamespace(kernel_params=(ctypes.c_void_p * 2)(), sites={})
    ptr = 1 << 40
    calls = [
        ("device_count", ()), ("open_device", (0,)), ("malloc_ipc", (64,)), ("free", (ptr,)),
        ("ipc_export", (ptr,)), ("ipc_open", (bytes(64),)), ("ipc_close", (ptr,)),
        ("pointer_device", (ptr,)),
        ("copy_to_device", (ptr, host)), ("copy_to_device", (ptr, host, stream)),
        ("copy_to_host", (host, ptr)), ("copy_to_host", (host, ptr, stream)),
        ("copy_device", (ptr, ptr + 64, 32)), ("copy_device", (ptr, ptr + 64, 32, stream)),
        ("memset", (ptr, 0, 32)), ("memset", (ptr, 0xFF, 32, stream)),
        ("stream_create", ()), ("stream_destroy", (stream,)),
        ("stream_synchronize", (stream,)), ("stream_synchronize", (None,)),
        ("event_create", ()), ("event_destroy", (event,)), ("event_record", (event, stream)),
        ("event_record", (event, None)), ("event_synchronize", (event,)), ("stream_wait_event", (stream, event)),
        ("event_elapsed_ms", (event, event)),
        ("module_load", (b"\x7fELF",)), ("module_unload", (module,)),
        ("module_function", (module, "kernel")),
        ("launch", (function, 4, 256, stream, pack)), ("launch", (function, 4, 256, None, pack)),
        ("resident_blocks", (function, 256)),
        ("capture_begin", (stream,)), ("capture_end", (stream,)), ("capture_end", (stream, False)),
        ("graph_launch", (graph, stream)), ("graph_destroy", (graph,)), ("stream_capturing", (stream,)),
        ("stream_write_word", (stream, ptr, 7)), ("stream_wait_word", (stream, ptr, 7, 1.0, None)),
        ("stream_word_ops", (stream, ((WRITE, ptr + 4, 2), (WAIT, ptr, 7), (WRITE, ptr, 0)), 1.0, None)),
        ("event_done", (event,)), ("stream_done", (stream,)),
        ("event_record", (event, stream)),
    ]
    for name, args in calls:
        with pytest.raises(missing):
            getattr(backend, name)(*args)
    backend._capturing.add(backend.stream_handle(stream))  # an event on a capturing stream: recorded "external"
    with pytest.raises(missing):
        backend.event_record(event, stream)
    with pytest.raises(missing):  # ... or, a fork or join within the capture, plain
        backend.event_record(event, stream, within_capture=True)
    backend.close()
    backend.close()  # idempotent


def test_the_legacy_default_stream_is_never_asked_whether_it_is_captured(rt):
    """A call on PyTorch's or CuPy's default current stream (named CU_STREAM_LEGACY, 1, by their probes)
    needs no capture query, since CUDA refuses to capture it; every other stream is asked: handle 0 too
    (the per-thread stream under CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1), and every HIP stream."""
    mod, _, _, _ = rt
    backend = _bare_backend(mod)
    assert backend.capturable(backend.stream_from_handle(1)) is (mod is not cuda_rt)
    for other in (None, backend.stream_from_handle(0), backend.stream_from_handle(2),
                  backend.stream_from_handle(0x1234)):
        assert backend.capturable(other)


def test_cuda_recorded_steps_find_their_kernels_and_take_their_packs_again(monkeypatch):
    """record_steps on a fake driver: the launches into the capture are taped; in the captured graph the
    kernel nodes of those functions are ours (another library's kernel, a node whose parameters cannot be
    read and a node of another kind are not), and rehand() gives each of ours its pack's arguments again,
    nothing else; a taped kernel missing from the graph, or launched twice, refuses the recording."""
    pytest.importorskip("cuda.bindings.driver")
    from pyhipa2a.errors import RuntimeFailure
    from pyhipa2a.kernels import ArgPack
    real, calls = cuda_rt._load(), []
    KERNEL, OTHER = real.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL, real.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET
    nodes = {"stage": (KERNEL, 11), "nccl": (KERNEL, 99), "hidden": (KERNEL, None), "memset": (OTHER, None),
             "sum": (KERNEL, 22)}

    def record(name, *value):
        return lambda *args: (calls.append((name, *args)), (0, *value))[1]

    def node_params(node):
        func = nodes[node][1]
        return (0, types.SimpleNamespace(func=func)) if func is not None else (1,)
    fake = types.SimpleNamespace(
        CUstream=real.CUstream, CUgraphNodeType=real.CUgraphNodeType, CUDA_KERNEL_NODE_PARAMS=types.SimpleNamespace,
        cuGraphGetNodes=lambda graph, n: (0, list(nodes)[:n], len(nodes)),
        cuGraphNodeGetType=lambda node: (0, nodes[node][0]), cuGraphKernelNodeGetParams=node_params,
        cuGraphInstantiate=record("instantiate", "exec"), cuGraphExecKernelNodeSetParams=record("set params"),
        cuGraphLaunch=record("graph launch"), cuGraphExecDestroy=record("destroy exec"),
        cuGraphDestroy=record("destroy template"))
    monkeypatch.setattr(cuda_rt, "driver", fake)
    backend = _bare_backend(cuda_rt)
    backend._launch_kernel = record("kernel launch")
    backend._call = lambda role, *args: "template"  # (stream_end_capture)
    stream = backend.stream_from_handle(0x1234)
    backend.capture_begin = lambda s: backend._capturing.add(backend.stream_handle(s))
    packs = {11: ArgPack((ctypes.c_uint64,)), 22: ArgPack((ctypes.c_uint64,))}

    def steps(s):
        for function, pack in packs.items():
            backend.launch(function, 8, 256, s, pack)
    recorded = backend.record_steps(stream, steps)
    assert [c[0] for c in calls] == ["kernel launch", "kernel launch", "instantiate"] and not backend._capturing
    assert [(node, p.func, p.kernelParams) for node, p in recorded.nodes] == [
        (node, f, ctypes.addressof(packs[f].kernel_params)) for node, f in (("stage", 11), ("sum", 22))]
    calls.clear()
    recorded.rehand()
    recorded.launch(stream)
    assert [c[:3] for c in calls] == [("set params", "exec", "stage"), ("set params", "exec", "sum"),
                                      ("graph launch", "exec", stream)]
    calls.clear()
    recorded.close()
    assert [c[0] for c in calls] == ["destroy exec", "destroy template"]
    for taped in ({33: packs[11]}, None):  # a kernel not in the graph; one launched twice
        def wrong(s, taped=taped):
            for function, pack in (taped or {11: packs[11]}).items():
                backend.launch(function, 8, 256, s, pack)
            if taped is None:
                backend.launch(11, 8, 256, s, packs[11])
        with pytest.raises(RuntimeFailure, match="missing from the captured graph|launches one kernel twice"):
            backend.record_steps(stream, wrong)
        assert calls[-1][0] == "destroy template" and not backend._tapes


def test_cuda_launches_go_out_as_one_node_graphs(monkeypatch):
    """The CUDA backend's launch protocol, on a fake driver: a pack's first launch on a geometry makes its
    one-node graph, unless prepare_launch made it before (an AllToAll makes all of its own so); each
    launch hands the node the pack's arguments, then launches the graph; a launcher (a repeated call's)
    hands them once and then only launches, a rewritten one (a call on new arrays) at every launch; into a
    capture of ours, a launch is a plain kernel launch."""
    pytest.importorskip("cuda.bindings.driver")
    from pyhipa2a.kernels import ArgPack
    calls = []

    def record(name, *value):
        return lambda *args: (calls.append(name), (0, *value))[1]
    fake = types.SimpleNamespace(
        CUstream=cuda_rt._load().CUstream, CUDA_KERNEL_NODE_PARAMS=types.SimpleNamespace,
        cuGraphCreate=record("create", "template"),
        cuGraphAddKernelNode=record("add node", "node"), cuGraphInstantiate=record("instantiate", "exec"),
        cuGraphExecKernelNodeSetParams=record("set params"), cuGraphLaunch=record("graph launch"),
        cuGraphExecDestroy=record("destroy exec"), cuGraphDestroy=record("destroy template"))
    monkeypatch.setattr(cuda_rt, "driver", fake)
    backend = _bare_backend(cuda_rt)
    backend._launch_kernel = record("kernel launch")
    pack, stream = ArgPack((ctypes.c_uint64,)), backend.stream_from_handle(0x1234)
    for _ in range(2):
        backend.launch("function", 8, 256, stream, pack)
    assert calls == ["create", "add node", "instantiate"] + ["set params", "graph launch"] * 2
    calls.clear()
    launch = backend.launcher("function", 8, 256, pack)  # the same site: its graph is reused
    for _ in range(2):
        launch(stream)
    assert calls == ["set params", "graph launch", "graph launch"] and len(pack.sites) == 1
    calls.clear()
    backend.capture_begin = lambda s: backend._capturing.add(backend.stream_handle(s))
    backend.capture_begin(stream)
    backend.launch("function", 8, 256, stream, pack)
    launch(stream)
    assert calls == ["kernel launch"] * 2
    for site in pack.sites.values():
        site.release()  # (now, on the fake driver)
    assert calls[-2:] == ["destroy exec", "destroy template"]
    calls.clear()
    prepared = ArgPack((ctypes.c_uint64,))
    for _ in range(2):
        backend.prepare_launch("function", 8, 256, prepared)
    assert calls == ["create", "add node", "instantiate"]  # made once, ahead
    backend._capturing.clear()
    backend.launch("function", 8, 256, stream, prepared)
    backend.launcher("function", 8, 256, prepared)(stream)
    assert calls[3:] == ["set params", "graph launch", "set params", "graph launch"]
    backend.prepare_launch("function", 16, 256, prepared)  # another geometry: a site of its own
    assert calls[7:] == ["create", "add node", "instantiate"] and len(prepared.sites) == 2


def test_cuda_queues_word_operations_as_one_batch(monkeypatch):
    """On CUDA, stream_word_ops queues a sequence (a readiness wait's four operations: pyhipa2a.signals) as one
    cuStreamBatchMemOp, in order, each wait for equality and each write fenced as stream_wait_word and
    stream_write_word make them; a sequence's parameters are packed once and handed again while it is among the
    most recently used, the same operations on the same places with other values (a marked wait's new tag) too,
    with those values written in; nothing is queued for no operations; a failure names the call."""
    pytest.importorskip("cuda.bindings.driver")
    real, batches, results = cuda_rt._load(), [], []

    def batch(stream, count, params, flags):
        batches.append((int(stream), count, params, flags))
        return (results.pop() if results else real.CUresult.CUDA_SUCCESS,)
    fake = types.SimpleNamespace(CUstream=real.CUstream, CUresult=real.CUresult, cuStreamBatchMemOp=batch,
                                 CUstreamBatchMemOpParams=real.CUstreamBatchMemOpParams,
                                 CUstreamBatchMemOpType=real.CUstreamBatchMemOpType)
    monkeypatch.setattr(cuda_rt, "driver", fake)
    backend, kinds = _bare_backend(cuda_rt), real.CUstreamBatchMemOpType
    stream, seen, word = backend.stream_from_handle(0x1234), 1 << 40, (1 << 40) + 64
    wait = ((WRITE, seen, 2), (WAIT, word, 5), (WRITE, word, 0), (WRITE, seen, 1))
    backend.stream_word_ops(stream, wait, 1.0, None)
    [(handle, count, params, flags)] = batches
    assert (handle, count, len(params), flags) == (0x1234, 4, 4, 0)
    queued = [(p.waitValue if kind == WAIT else p.writeValue) for (kind, _, _), p in zip(wait, params)]
    assert [op.operation for op in queued] == [kinds.CU_STREAM_MEM_OP_WRITE_VALUE_32,
                                               kinds.CU_STREAM_MEM_OP_WAIT_VALUE_32] + [
                                               kinds.CU_STREAM_MEM_OP_WRITE_VALUE_32] * 2
    assert [(int(op.address), int(op.value), int(op.flags)) for op in queued] == [
        (seen, 2, 0), (word, 5, 1), (word, 0, 0), (seen, 1, 0)]  # (CU_STREAM_WAIT_VALUE_EQ; writes fenced: 0)
    backend.stream_word_ops(stream, wait, 1.0, None)
    assert batches[1][2] is params  # packed once
    retagged = ((WRITE, seen, 6), (WAIT, word, 5), (WRITE, word, 0), (WRITE, seen, 5))
    backend.stream_word_ops(stream, retagged, 1.0, None)
    assert batches[2][2] is params and [int(op.value) for op in queued] == [6, 5, 0, 5]
    backend.stream_word_ops(stream, wait, 1.0, None)
    assert batches[3][2] is params and [int(op.value) for op in queued] == [2, 5, 0, 1]
    del batches[2:]
    backend.stream_word_ops(stream, wait[:2], 1.0, None)
    assert batches[2][1] == 2 and batches[2][2] is not params
    half = batches[2][2]
    monkeypatch.setattr(cuda_rt, "_BATCHES_KEPT", 2)
    backend.stream_word_ops(stream, wait, 1.0, None)  # the most recently used now
    backend.stream_word_ops(stream, wait[1:], 1.0, None)  # a third: the least recently used is dropped
    backend.stream_word_ops(stream, wait, 1.0, None)
    backend.stream_word_ops(stream, wait[:2], 1.0, None)
    assert batches[5][2] is params and batches[6][2] is not half
    backend.stream_word_ops(stream, (), 1.0, None)
    assert len(batches) == 7
    results.append(real.CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(RuntimeFailure, match="cuStreamBatchMemOp failed: CUDA_ERROR_INVALID_VALUE"):
        backend.stream_word_ops(stream, wait, 1.0, None)


def test_cuda_hands_a_plan_the_driver_entries_and_its_launchers_graph(monkeypatch):
    """What a repeated call's plan (pyhipa2a.repeat) runs from C on CUDA: the driver's context calls with our
    context, and its launcher as its graph's cuGraphLaunch, under the launcher's own test (no stream of ours
    recording); a launch function of another kind, or no driver entries (the per-thread default stream),
    leave it the Python functions. A code the binding does not name still raises."""
    pytest.importorskip("cuda.bindings.driver")
    from pyhipa2a.kernels import ArgPack
    fake = types.SimpleNamespace(
        CUstream=cuda_rt._load().CUstream, CUDA_KERNEL_NODE_PARAMS=types.SimpleNamespace,
        cuGraphCreate=lambda *a: (0, "template"), cuGraphAddKernelNode=lambda *a: (0, "node"),
        cuGraphInstantiate=lambda *a: (0, 0x99), cuGraphExecKernelNodeSetParams=lambda *a: (0,),
        cuGraphExecDestroy=lambda *a: (0,), cuGraphDestroy=lambda *a: (0,), CUresult=cuda_rt._load().CUresult)
    monkeypatch.setattr(cuda_rt, "driver", fake)
    entries = {"cuCtxGetCurrent": 11, "cuCtxSetCurrent": 12, "cuGraphLaunch": 13}
    monkeypatch.setattr(cuda_rt, "_entry_points", lambda: entries)
    backend = _bare_backend(cuda_rt)
    backend._context, backend._context_handle = object(), 0x77
    pack, stream = ArgPack((ctypes.c_uint64,)), backend.stream_from_handle(0x1234)
    launch = backend.launcher("function", 8, 256, pack)
    assert backend.plan_activate() == (11, 12, 0x77)
    assert backend.plan_launch(launch, stream) == ((13, 0x99, 0x1234, launch), (backend._capturing, backend._joined))
    sequence = Launcher(lambda s: (launch(s), launch(s)))  # (several launches, as a call across nodes makes)
    assert backend.plan_launch(sequence, stream) == ((sequence.queue, stream), ())
    monkeypatch.setattr(cuda_rt, "_entry_points", lambda: None)
    assert backend.plan_activate() == (backend.activate,)
    assert backend.plan_launch(launch, stream) == ((launch.queue, stream), ())
    checked = []
    monkeypatch.setattr(cuda_rt, "_check", lambda result, call: checked.append((result, call)))
    backend.raise_driver_error("cuGraphLaunch", 700)
    assert checked == [((fake.CUresult(700),), "cuGraphLaunch")]
    with pytest.raises(RuntimeFailure, match="cuGraphLaunch failed with code 123456"):
        backend.raise_driver_error("cuGraphLaunch", 123456)
    for site in pack.sites.values():
        site.release()


def test_cuda_plan_entries_are_none_for_the_per_thread_default_stream(monkeypatch):
    """With CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM the binding calls the _ptsz variants: a plan must
    not call the legacy-stream cuGraphLaunch in their place."""
    cuda_rt._entry_points.cache_clear()
    monkeypatch.setenv("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    try:
        assert cuda_rt._entry_points() is None
    finally:
        cuda_rt._entry_points.cache_clear()


@pytest.mark.parametrize("answer", ["enabled", "already", "cannot", "fails"])
def test_ranks_of_one_process_reach_each_other_by_peer_access(rt, monkeypatch, answer):
    """A peer rank of this process (pyhipa2a.local) is reached at its own address once our GPU may reach its GPU:
    peer access enabled from our context (CUDA: towards the peer's primary context, retained and released
    around it), enabled already being no error; a pair the driver says cannot reach each other is refused
    naming both GPUs; any other failure names the call; a peer on our own GPU asks the driver nothing. (On
    fake bindings: one GPU has been lent, so no GPU has run this.)"""
    mod, binding, ok, bad = rt
    backend, calls = _bare_backend(mod), []
    backend.current_device = 0
    if mod is cuda_rt:
        code = {"enabled": ok, "already": binding.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "fails": bad}
        fake = types.SimpleNamespace(
            CUresult=binding.CUresult,
            cuDeviceGet=lambda i: (ok, f"device {i}"),
            cuDeviceCanAccessPeer=lambda a, b: (calls.append(("can", a, b)), (ok, int(answer != "cannot")))[1],
            cuDevicePrimaryCtxRetain=lambda d: (calls.append(("retain", d)), (ok, f"context of {d}"))[1],
            cuCtxEnablePeerAccess=lambda c, flags: (calls.append(("enable", c)), (code.get(answer, ok),))[1],
            cuDevicePrimaryCtxRelease=lambda d: (calls.append(("release", d)), (ok,))[1])
        monkeypatch.setattr(mod, "driver", fake)
        asked = [("can", "device 0", "device 1"), ("retain", "device 1"), ("enable", "context of device 1"),
                 ("release", "device 1")]
    else:
        code = {"enabled": ok, "already": binding.hipError_t.hipErrorPeerAccessAlreadyEnabled, "fails": bad}
        fake = types.SimpleNamespace(
            hipError_t=binding.hipError_t,
            hipDeviceCanAccessPeer=lambda a, b: (calls.append(("can", a, b)), (ok, int(answer != "cannot")))[1],
            hipDeviceEnablePeerAccess=lambda d, flags: (calls.append(("enable", d)), (code.get(answer, ok),))[1])
        monkeypatch.setattr(mod, "hip", fake)
        asked = [("can", 0, 1), ("enable", 1)]
    assert backend.reach_in_process(0x7000, 0) == 0x7000 and calls == []  # (our own GPU)
    if answer == "cannot":
        with pytest.raises(RuntimeFailure, match="GPU 0 cannot reach the memory of GPU 1"):
            backend.reach_in_process(0x7000, 1)
        assert calls == asked[:1]
    elif answer == "fails":
        with pytest.raises(RuntimeFailure, match="EnablePeerAccess"):
            backend.reach_in_process(0x7000, 1)
        assert calls == asked
    else:
        assert backend.reach_in_process(0x7000, 1) == 0x7000
        assert calls == asked
