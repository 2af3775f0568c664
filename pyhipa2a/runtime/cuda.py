"""CUDA backend over cuda-python's driver API (`cuda.bindings.driver`): what CUDA does its own way (one-node-graph
launches among it); the rest is DriverBackend's."""
from __future__ import annotations

import ctypes
import functools
import os
import weakref

from ..errors import RuntimeFailure
from .base import WAIT, DeviceInfo, Launcher
from .driver import CALLS, DriverBackend, make_check

_CALLS = {role: names[0] for role, names in CALLS.items()}

# Every attribute of `driver` used, here or through _CALLS: tests check they exist, as no NVIDIA driver runs them.
_USED_CALLS = (
    "cuCtxGetDevice_v2", "cuCtxGetCurrent", "cuDeviceGet", "cuDeviceGetName",
    "cuDeviceGetAttribute", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuGetErrorName", "cuGetErrorString",
    "cuMemAlloc", "CU_MEMHOSTALLOC_DEVICEMAP", "CU_MEMHOSTALLOC_PORTABLE", "cuIpcGetMemHandle", "cuIpcOpenMemHandle",
    "cuPointerGetAttribute", "cuEventCreate", "CUresult", "CUstream", "CUipcMemHandle", "CUdevice_attribute",
    "CUipcMem_flags", "CUpointer_attribute", "CUstream_flags", "CUevent_flags", "CUstreamCaptureMode",
    "CUDA_KERNEL_NODE_PARAMS", "CUstreamCaptureStatus", "cuGraphCreate", "cuGraphAddKernelNode",
    "cuGraphExecKernelNodeSetParams", "cuDeviceCanAccessPeer", "cuCtxEnablePeerAccess",
    "cuDevicePrimaryCtxRelease", "cuStreamBatchMemOp", "CUstreamBatchMemOpParams",
    "CUstreamBatchMemOpType", "cuGraphGetNodes", "cuGraphNodeGetType", "CUgraphNodeType",
    "cuGraphKernelNodeGetParams") + tuple(_CALLS.values())

# Word-operation batches kept packed, the least recently used dropped first: their values vary with the rows a
# call moves, and a grouped combine's marks with the combine, while a call's usual waits repeat.
_BATCHES_KEPT = 4096
_IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle), fixed by the CUDA ABI
driver = None  # cuda.bindings.driver, bound by _load() so importing this module never needs it


def _load():
    global driver
    if driver is None:
        try:
            from cuda.bindings import driver as _driver
        except ImportError as e:
            raise ImportError("the CUDA backend needs NVIDIA's cuda-python driver bindings "
                              "(`pip install cuda-bindings`); importing cuda.bindings.driver failed: " + str(e)) from e
        driver = _driver
    return driver


def _error_text(err) -> str | None:
    rn, name = driver.cuGetErrorName(err)
    rs, text = driver.cuGetErrorString(err)
    return f"{name.decode()}: {text.decode()}" if rn == 0 and rs == 0 and name and text else None


_check = make_check(_error_text, "CUresult")


def _handle_to_bytes(handle) -> bytes:
    return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES)  # (not all releases expose its field `reserved`)


def _handle_from_bytes(data: bytes):
    if len(data) != _IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {_IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = driver.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), bytes(data), _IPC_HANDLE_BYTES)
    return handle


class _OneNodeGraph:
    """A launch site's kernel as a one-node graph; it reads the site's void* array at cuGraphExecKernelNodeSetParams."""

    def __init__(self, function, grid: int, block: int, kernel_params):
        params = self.params = self.params_for(function, grid, block, kernel_params)
        graph = _check(driver.cuGraphCreate(0), "cuGraphCreate")
        try:
            self.node = _check(driver.cuGraphAddKernelNode(graph, None, 0, params), "cuGraphAddKernelNode")
            self.exec = _check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        except BaseException:
            driver.cuGraphDestroy(graph)
            raise
        self.release = weakref.finalize(self, _destroy_graph, self.exec, graph)  # (the template too: the node is its)

    @staticmethod
    def params_for(function, grid: int, block: int, kernel_params):
        """A kernel node's parameters that read the pack's void* array when handed to the node."""
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = function
        params.gridDimX, params.gridDimY, params.gridDimZ = grid, 1, 1
        params.blockDimX, params.blockDimY, params.blockDimZ = block, 1, 1
        params.sharedMemBytes = 0
        params.kernelParams = ctypes.addressof(kernel_params)
        return params


def _hand_arguments(site: _OneNodeGraph) -> None:
    """The site's node takes the arguments its pack holds now."""
    result = driver.cuGraphExecKernelNodeSetParams(site.exec, site.node, site.params)
    if result[0]:
        _check(result, "cuGraphExecKernelNodeSetParams")


def _launch_graph(site: _OneNodeGraph, stream) -> None:
    result = driver.cuGraphLaunch(site.exec, 0 if stream is None else stream)
    if result[0]:
        _check(result, "cuGraphLaunch")


@functools.cache
def _entry_points() -> dict | None:
    """Addresses of the driver's cuCtxGetCurrent, cuCtxSetCurrent and cuGraphLaunch for a plan (pyhipa2a.repeat),
    and cuLaunchKernel for XLA's handler (pyhipa2a.jax); None where libcuda is not found or the binding calls the
    per-thread-stream variants."""
    if os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") != "0":
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            for name in ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuGraphLaunch", "cuLaunchKernel")}


class _RecordedSteps:
    """A captured graph whose kernels of ours (each function once) take their packs' arguments again at
    rehand(): cuGraphExecKernelNodeSetParams on the executable, from the template's nodes (kept with it)."""

    def __init__(self, graph, tape: list):
        self._packs = tuple(pack for *_, pack in tape)  # (rehand hands their arguments: held as long as the graph)
        launched = {}
        for function, grid, block, pack in tape:
            if int(function) in launched:  # (nodes are told apart by their function)
                raise RuntimeFailure("a recorded step launches one kernel twice")
            launched[int(function)] = _OneNodeGraph.params_for(function, grid, block, pack.kernel_params)
        count = _check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1]
        nodes = _check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")[0]
        self.nodes = []
        for node in nodes:
            if _check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType") != \
                    driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                continue
            found = driver.cuGraphKernelNodeGetParams(node)
            if found[0]:  # (not ours, or not readable so: ours missing below refuses the graph)
                continue
            params = launched.pop(int(found[1].func), None)
            if params is not None:  # (others are another library's: NCCL's)
                self.nodes.append((node, params))
        if launched:
            raise RuntimeFailure(f"{len(launched)} recorded kernel(s) of ours missing from the captured graph")
        self.exec = _check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        self.release = weakref.finalize(self, _destroy_graph, self.exec, graph)

    def rehand(self) -> None:
        for node, params in self.nodes:
            result = driver.cuGraphExecKernelNodeSetParams(self.exec, node, params)
            if result[0]:
                _check(result, "cuGraphExecKernelNodeSetParams")

    def launch(self, stream) -> None:
        result = driver.cuGraphLaunch(self.exec, stream)
        if result[0]:
            _check(result, "cuGraphLaunch")

    def close(self) -> None:
        self.release()


def _destroy_graph(executable, graph) -> None:
    """Best effort, unchecked: this runs when a launch site is dropped, possibly at exit."""
    driver.cuGraphExecDestroy(executable)
    driver.cuGraphDestroy(graph)


class _WordBatch:
    """The cuStreamBatchMemOp parameters of one sequence of (WAIT or WRITE, place) operations, made once; each
    call's values are written into them where they differ from the last call's."""

    def __init__(self, ops: tuple, wait_flags: int, write_flags: int):
        kinds = driver.CUstreamBatchMemOpType
        self.params, self._ops, self._values = [], [], []
        for kind, ptr, value in ops:
            param = driver.CUstreamBatchMemOpParams()
            if kind == WAIT:
                op, code, flags = param.waitValue, kinds.CU_STREAM_MEM_OP_WAIT_VALUE_32, wait_flags
            else:
                op, code, flags = param.writeValue, kinds.CU_STREAM_MEM_OP_WRITE_VALUE_32, write_flags
            op.operation, op.address, op.value, op.flags = code, ptr, value, flags
            self.params.append(param)
            self._ops.append(op)
            self._values.append(value)

    def set_values(self, ops: tuple) -> None:
        values = self._values
        for i, (_, _, value) in enumerate(ops):
            if value != values[i]:
                self._ops[i].value = values[i] = value


class CudaBackend(DriverBackend):
    kind = "cuda"
    code_suffix = ".fatbin"
    dlpack_device_type = 2  # kDLCUDA
    _CALLS = _CALLS
    _LAUNCH_EXTRA = 0  # `extra` must be 0, not None, for this binding
    _api = staticmethod(_load)
    _check = staticmethod(_check)

    def __init__(self):
        super().__init__()
        self._context = None
        self._tapes: dict = {}  # stream handle -> the launches record_steps records there
        self._context_handle = None  # int(self._context): activate() compares at every call
        self._batches = {}  # stream_word_ops' (kind, place) sequences -> their _WordBatch, least recently used first

    def open_device(self, index: int) -> DeviceInfo:
        self.current_device = index
        dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        # The primary context is the one the runtime API and other libraries share: buffers stay usable across them.
        self._context = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._context_handle = int(self._context)
        _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        attr = driver.CUdevice_attribute

        def get(a):
            return _check(driver.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute")
        name = _check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
        major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        return DeviceInfo(name=name.split(b"\0", 1)[0].decode(errors="replace"), arch=f"sm_{major}{minor}", index=index,
                          count=self.device_count(), multiprocessors=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                          warp_size=32)  # (every NVIDIA architecture so far)

    def module_owner(self):
        return ("cuda", int(self._context)) if self._context is not None else None

    def activate(self) -> None:
        if self._context is None:  # no device opened yet: nothing of ours to make current
            return
        current = driver.cuCtxGetCurrent()
        if current[0] or int(current[1]) != self._context_handle:
            _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def malloc_ipc(self, nbytes: int) -> int:
        self.activate()
        ptr = int(_check(driver.cuMemAlloc(nbytes), "cuMemAlloc"))  # (what cuIpcGetMemHandle takes; VMM memory is not)
        self.memset(ptr, 0, nbytes)
        return ptr

    def ipc_export(self, ptr: int) -> bytes:
        return _handle_to_bytes(_check(driver.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle"))

    def ipc_open(self, handle: bytes) -> int:
        flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        self.activate()
        return int(_check(driver.cuIpcOpenMemHandle(_handle_from_bytes(handle), flags), "cuIpcOpenMemHandle"))

    def _enable_peer_access(self, device: int) -> bool:
        ours = _check(driver.cuDeviceGet(self.current_device), "cuDeviceGet")
        peer = _check(driver.cuDeviceGet(device), "cuDeviceGet")
        if not _check(driver.cuDeviceCanAccessPeer(ours, peer), "cuDeviceCanAccessPeer"):
            return False
        # The peer rank's own primary context: it holds it already, so ours is given back at once.
        context = _check(driver.cuDevicePrimaryCtxRetain(peer), "cuDevicePrimaryCtxRetain")
        try:
            result = driver.cuCtxEnablePeerAccess(context, 0)
            if result[0] not in (driver.CUresult.CUDA_SUCCESS,
                                 driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                _check(result, "cuCtxEnablePeerAccess")
        finally:
            _check(driver.cuDevicePrimaryCtxRelease(peer), "cuDevicePrimaryCtxRelease")
        return True

    def _host_mapped_flags(self):
        return driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE

    def pointer_device(self, ptr: int) -> int | None:
        # The pointer's context, not CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, which read 0 for memory on device 1 (H200).
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
        result = driver.cuPointerGetAttribute(attr, ptr)
        if result[0] == driver.CUresult.CUDA_ERROR_INVALID_VALUE:  # memory it did not allocate or register
            return None
        context = _check(result, "cuPointerGetAttribute")
        if self._context is not None and int(context) == int(self._context):
            return self.current_device
        if hasattr(driver, "cuCtxGetDevice_v2"):
            return int(_check(driver.cuCtxGetDevice_v2(context), "cuCtxGetDevice_v2"))
        return -1  # another context: not the device this process drives

    def _non_blocking_stream_flags(self):
        return driver.CUstream_flags.CU_STREAM_NON_BLOCKING

    def _capture_mode(self):
        return driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL

    def stream_from_handle(self, handle: int):
        return driver.CUstream(handle)

    @property
    def stream_type(self):
        return driver.CUstream

    def open_blas(self):
        from .blas import CUBLAS, VendorBlas
        return VendorBlas(self, CUBLAS)

    def event_create(self):
        # Default flags keep timing on (CU_EVENT_DISABLE_TIMING would break event_elapsed_ms).
        self.activate()
        return _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")

    def stream_capturing(self, stream) -> bool:
        # Asked at every call on a foreign stream: the bare binding call is cheaper than the shared _call's lookups.
        result = driver.cuStreamIsCapturing(stream)
        if result[0]:
            _check(result, "cuStreamIsCapturing")
        return result[1] is not driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def capturable(self, stream) -> bool:
        # CU_STREAM_LEGACY (1), as PyTorch and CuPy name their default streams, cannot be captured. Handle 0 is
        # asked: with CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1 it is the per-thread stream.
        try:
            return int(stream) != 1
        except TypeError:  # (None, handle 0; or no handle we can read: ask)
            return True

    def launch(self, function, grid: int, block: int, stream, pack) -> None:
        # Outside a capture, the site's one-node graph given the pack's arguments now: cheaper for the host and
        # sooner done than cuLaunchKernel (docs/PERFORMANCE.md). Into a capture, a plain launch: a node of its own.
        if self._recording(stream):
            super().launch(function, grid, block, stream, pack)
            tape = self._tapes.get(self.stream_handle(stream))
            if tape is not None:
                tape.append((function, grid, block, pack))
            return
        site = pack.sites.get((id(function), grid, block)) or self._site(function, grid, block, pack)
        _hand_arguments(site)
        _launch_graph(site, stream)

    def _site(self, function, grid: int, block: int, pack) -> "_OneNodeGraph":
        """The one-node graph of `function` from `pack` on this grid, kept in the pack: made ahead or at first use."""
        key = (id(function), grid, block)  # (the site's params hold the function: its id stays)
        site = pack.sites.get(key)
        if site is None:
            self.activate()  # an executable graph belongs to the context current when it is made
            site = pack.sites[key] = _OneNodeGraph(function, grid, block, pack.kernel_params)
        return site

    def prepare_launch(self, function, grid: int, block: int, pack) -> None:
        self._site(function, grid, block, pack)

    def launcher(self, function, grid: int, block: int, pack) -> Launcher:
        # The node takes the arguments once, here: each launch is cuGraphLaunch alone. The graph stays the pack's
        # (one made per plan grew device memory in scripts/stress.py).
        site, capturing, joined = self._site(function, grid, block, pack), self._capturing, self._joined
        _hand_arguments(site)

        def launch(stream) -> None:  # (holds the site: its graph lives as long as this function)
            if capturing or joined:  # some stream records: launch() tells whether it is this one
                self.launch(function, grid, block, stream, pack)
            else:
                _launch_graph(site, stream)
        return Launcher(launch, site, functools.partial(_hand_arguments, site))  # (a plan launches the site from C)

    def launch_entry(self) -> int | None:
        entries = _entry_points()
        return None if entries is None else entries["cuLaunchKernel"]

    def plan_activate(self):
        entries = _entry_points()
        if entries is None or self._context is None:
            return (self.activate,)
        return (entries["cuCtxGetCurrent"], entries["cuCtxSetCurrent"], self._context_handle)

    def record_steps(self, stream, queue):
        handle, tape = self.stream_handle(stream), []
        self.capture_begin(stream)
        self._tapes[handle] = tape
        try:
            queue(stream)
        except BaseException:
            self.capture_end(stream, keep=False)
            raise
        finally:
            del self._tapes[handle]
        graph = self._capture_stop(stream)  # (its template stays: rehand finds our nodes in it)
        try:
            self.activate()  # (the executable graph belongs to the context current when it is made)
            return _RecordedSteps(graph, tape)
        except BaseException:
            driver.cuGraphDestroy(graph)
            raise

    def plan_launch(self, launch: Launcher, stream) -> tuple:
        # The launcher's own test, left to the plan: with no stream of ours recording, it launches the site's graph.
        entries, site = _entry_points(), launch.graph
        if entries is None or site is None:
            return (launch.queue, stream), ()
        handle = self.stream_handle(stream)
        return (entries["cuGraphLaunch"], int(site.exec), handle, launch), (self._capturing, self._joined)

    def stream_word_ops(self, stream, ops: tuple, timeout: float, timed_out) -> None:
        # One cuStreamBatchMemOp: a wait of four operations (pyhipa2a.signals) cost 1.9 us of host time against 6.2
        # one call each, and a graph of seven such waits replayed in 36 us against 59 (docs/COLLECTIVE.md).
        # A sequence's parameters are packed once for its operations and places, and its values patched in
        # place: a grouped combine's marked waits (groups.py) carry a new tag at every call, and packing their
        # four operations anew took 12 us each. (The driver reads them during the call, a capture included.)
        if not ops:
            return
        batches = self._batches
        places = tuple((kind, ptr) for kind, ptr, _ in ops)
        batch = batches[places] = batches.pop(places, None) or _WordBatch(ops, self._WAIT_EQUAL, self._WRITE_FENCED)
        if len(batches) > _BATCHES_KEPT:  # (the least recently used goes)
            del batches[next(iter(batches))]
        batch.set_values(ops)
        result = driver.cuStreamBatchMemOp(stream, len(batch.params), batch.params, 0)
        if result[0]:
            _check(result, "cuStreamBatchMemOp")

    def raise_driver_error(self, what: str, code: int) -> None:
        try:
            result = driver.CUresult(code)
        except ValueError:  # (a code this binding does not name)
            raise RuntimeFailure(f"{what} failed with code {code}") from None
        _check((result,), what)
