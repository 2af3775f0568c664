"""What the CUDA and HIP backends share: cuda-python's `driver` and hip-python's `hip` take the same arguments for
copies, memsets, streams, events, modules and launches and return (error code, value...); DriverBackend makes them."""
from __future__ import annotations

import ctypes

import numpy as np

from ..errors import RuntimeFailure
from .base import Backend

# Each role DriverBackend's methods call -> (CUDA driver function, HIP function); each backend's _CALLS is one column.
CALLS = {
    "init": ("cuInit", "hipInit"), "device_count": ("cuDeviceGetCount", "hipGetDeviceCount"),
    "mem_free": ("cuMemFree", "hipFree"), "host_alloc": ("cuMemHostAlloc", "hipHostMalloc"),
    "host_get_device_pointer": ("cuMemHostGetDevicePointer", "hipHostGetDevicePointer"),
    "host_free": ("cuMemFreeHost", "hipHostFree"), "ipc_close_handle": ("cuIpcCloseMemHandle", "hipIpcCloseMemHandle"),
    "memcpy_htod": ("cuMemcpyHtoD", "hipMemcpyHtoD"), "memcpy_htod_async": ("cuMemcpyHtoDAsync", "hipMemcpyHtoDAsync"),
    "memcpy_dtoh": ("cuMemcpyDtoH", "hipMemcpyDtoH"), "memcpy_dtoh_async": ("cuMemcpyDtoHAsync", "hipMemcpyDtoHAsync"),
    "memcpy_dtod": ("cuMemcpyDtoD", "hipMemcpyDtoD"), "memcpy_dtod_async": ("cuMemcpyDtoDAsync", "hipMemcpyDtoDAsync"),
    "memset_d8": ("cuMemsetD8", "hipMemsetD8"), "memset_d8_async": ("cuMemsetD8Async", "hipMemsetD8Async"),
    "stream_create": ("cuStreamCreate", "hipStreamCreateWithFlags"),
    "stream_destroy": ("cuStreamDestroy", "hipStreamDestroy"),
    "stream_synchronize": ("cuStreamSynchronize", "hipStreamSynchronize"),
    "event_destroy": ("cuEventDestroy", "hipEventDestroy"), "event_record": ("cuEventRecord", "hipEventRecord"),
    "event_synchronize": ("cuEventSynchronize", "hipEventSynchronize"),
    "event_elapsed_time": ("cuEventElapsedTime", "hipEventElapsedTime"),
    "module_load_data": ("cuModuleLoadData", "hipModuleLoadData"),
    "module_unload": ("cuModuleUnload", "hipModuleUnload"),
    "module_get_function": ("cuModuleGetFunction", "hipModuleGetFunction"),
    "launch_kernel": ("cuLaunchKernel", "hipModuleLaunchKernel"), "mem_get_info": ("cuMemGetInfo", "hipMemGetInfo"),
    "stream_begin_capture": ("cuStreamBeginCapture", "hipStreamBeginCapture"),
    "stream_end_capture": ("cuStreamEndCapture", "hipStreamEndCapture"),
    "graph_instantiate": ("cuGraphInstantiate", "hipGraphInstantiateWithFlags"),
    "graph_launch": ("cuGraphLaunch", "hipGraphLaunch"), "graph_destroy": ("cuGraphDestroy", "hipGraphDestroy"),
    "graph_exec_destroy": ("cuGraphExecDestroy", "hipGraphExecDestroy"),
    "occupancy": ("cuOccupancyMaxActiveBlocksPerMultiprocessor", "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor"),
    "event_record_with_flags": ("cuEventRecordWithFlags", "hipEventRecordWithFlags"),
    "stream_wait_event": ("cuStreamWaitEvent", "hipStreamWaitEvent"),
    "stream_query": ("cuStreamQuery", "hipStreamQuery"), "event_query": ("cuEventQuery", "hipEventQuery"),
    "stream_is_capturing": ("cuStreamIsCapturing", "hipStreamIsCapturing"),
    "stream_write_value32": ("cuStreamWriteValue32", "hipStreamWriteValue32"),
    "stream_wait_value32": ("cuStreamWaitValue32", "hipStreamWaitValue32"),
}
ROLES = tuple(CALLS)


def make_check(runtime_text, code_type: str):
    """The `_check` of a binding whose calls return (error code, value...): on failure raise RuntimeFailure naming
    the call and `runtime_text(code)` (else the code's enum name); else return None, the one value, or the tuple."""
    def error_text(code) -> str:
        try:  # the runtime's text needs its native library; without it the enum's name still says what failed
            text = runtime_text(code)
            if text:
                return text
        except Exception:
            pass
        return getattr(code, "name", None) or f"{code_type} {int(code)}"

    def check(result, call: str):
        if result[0]:
            raise RuntimeFailure(f"{call} failed: {error_text(result[0])}")
        return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]
    return check


def _host_buffer(a: np.ndarray) -> tuple[int, int]:
    if not a.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous")
    return a.ctypes.data, a.nbytes


class DriverBackend(Backend):
    """A subclass sets _CALLS (its column of CALLS) and provides _api (the binding module, loaded on first use),
    _check (make_check's), and the flags _host_mapped_flags (pinned host memory the device can write),
    _non_blocking_stream_flags and _capture_mode (thread-local: other threads' calls cannot invalidate ours)."""
    _CALLS: dict[str, str] = {}
    _LAUNCH_EXTRA = None  # the launch call's `extra` argument, as the binding wants it

    def __init__(self):
        self._streams = set()  # created here and not yet destroyed; close() reclaims them
        self._capturing: set[int] = set()  # handles of streams between capture_begin and capture_end
        self._joined: set[int] = set()  # handles of streams another library captures (capture_join)
        self._call("init", 0)  # (loads the binding: a missing one raises ImportError here)

    # An event recorded while capturing orders only captured work unless "external": then each graph launch records it.
    _EVENT_RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL, hipEventRecordExternal

    def _call(self, role: str, *args):
        """The binding's call for `role`, checked under that call's own name."""
        name = self._CALLS[role]
        return self._check(getattr(self._api(), name)(*args), name)

    def _on_stream(self, role: str, stream, *args, wait: bool = False) -> None:
        """No stream: `role`'s plain call, done on return; a stream: its "_async" form, then synchronized if `wait`."""
        if stream is None:
            # A plain memset or device-to-device copy may return still queued on the null stream, which our
            # non-blocking streams do not wait for: it would overwrite the next kernel's flags and inboxes.
            self._call(role, *args)
            self._call("stream_synchronize", None)
        else:
            self._call(role + "_async", *args, stream)
            if wait:
                self._call("stream_synchronize", stream)

    def device_count(self) -> int:
        return self._call("device_count")

    def reach_in_process(self, ptr: int, device: int) -> int | None:
        # The process's one address space: the peer's own address, once our device may reach its device's memory.
        if device != self.current_device:
            self.activate()
            if not self._enable_peer_access(device):
                raise RuntimeFailure(f"GPU {self.current_device} cannot reach the memory of GPU {device} (no peer "
                                     "access): the ranks of one process need GPUs that reach each other")
        return ptr

    def _enable_peer_access(self, device: int) -> bool:
        """Let kernels on our device reach memory on `device` (enabled already is no error); False where the
        driver says the GPUs cannot."""
        raise NotImplementedError

    def memory_in_use(self) -> int:
        self.activate()
        free, total = self._call("mem_get_info")
        return int(total) - int(free)

    def free(self, ptr: int) -> None:
        self._call("mem_free", ptr)

    def ipc_close(self, ptr: int) -> None:
        self._call("ipc_close_handle", ptr)

    def malloc_host_mapped(self, nbytes: int) -> tuple[int, int]:
        self.activate()
        host = int(self._call("host_alloc", nbytes, self._host_mapped_flags()))
        ctypes.memset(host, 0, nbytes)
        dev = int(self._call("host_get_device_pointer", host, 0))
        return host, dev

    def free_host_mapped(self, host_ptr: int) -> None:
        self._call("host_free", host_ptr)

    # -- copies: host<->device ones return once the host buffer may be reused or read --
    def copy_to_device(self, dst: int, src: np.ndarray, stream=None) -> None:
        addr, nbytes = _host_buffer(src)
        self._on_stream("memcpy_htod", stream, dst, addr, nbytes, wait=True)

    def copy_to_host(self, dst: np.ndarray, src: int, stream=None) -> None:
        addr, nbytes = _host_buffer(dst)
        self._on_stream("memcpy_dtoh", stream, addr, src, nbytes, wait=True)

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self._on_stream("memcpy_dtod", stream, dst, src, nbytes)

    def memset(self, ptr: int, byte: int, nbytes: int, stream=None) -> None:
        self._on_stream("memset_d8", stream, ptr, byte, nbytes)

    # -- streams and events (stream None is the null stream: both bindings make it handle 0) --
    def stream_create(self):
        # Non-blocking: must not serialise against work other libraries put on the default stream.
        self.activate()
        stream = self._call("stream_create", self._non_blocking_stream_flags())
        self._streams.add(stream)
        return stream

    def stream_destroy(self, stream) -> None:
        self._streams.discard(stream)
        self._call("stream_destroy", stream)

    def stream_handle(self, stream) -> int:
        return 0 if stream is None else int(stream)

    def stream_synchronize(self, stream) -> None:
        self._call("stream_synchronize", stream)

    _NOT_READY = 600  # CUDA_ERROR_NOT_READY and hipErrorNotReady: work still queued

    def stream_done(self, stream) -> bool:
        return self._query(self._CALLS["stream_query"], stream)

    def event_done(self, event) -> bool:
        return self._query(self._CALLS["event_query"], event)

    def _query(self, name: str, handle) -> bool:
        """A query call's answer: done (success), or not yet (NOT_READY); any other code raises."""
        result = getattr(self._api(), name)(handle)
        if int(result[0]) == self._NOT_READY:
            return False
        self._check(result, name)
        return True

    # Flags shared by both runtimes: a write after a fence over the stream's earlier writes (DEFAULT), a
    # wait for equality (CU_STREAM_WAIT_VALUE_EQ, hipStreamWaitValueEq); HIP's wait also takes a mask.
    _WRITE_FENCED, _WAIT_EQUAL, _WAIT_MASK = 0, 1, ()

    def stream_write_word(self, stream, ptr: int, value: int) -> None:
        self._call("stream_write_value32", stream, ptr, value, self._WRITE_FENCED)

    def stream_wait_word(self, stream, ptr: int, value: int, timeout: float, timed_out) -> None:
        self._call("stream_wait_value32", stream, ptr, value, self._WAIT_EQUAL, *self._WAIT_MASK)

    def event_destroy(self, event) -> None:
        self._call("event_destroy", event)

    def _recording(self, stream) -> bool:
        """Whether `stream` is capturing: between our capture_begin and capture_end, or joined."""
        if not (self._capturing or self._joined):
            return False
        handle = self.stream_handle(stream)
        return handle in self._capturing or handle in self._joined

    def event_record(self, event, stream, *, within_capture: bool = False) -> None:
        if not within_capture and self._recording(stream):
            self._call("event_record_with_flags", event, stream, self._EVENT_RECORD_EXTERNAL)
        else:
            self._call("event_record", event, stream)

    def event_synchronize(self, event) -> None:
        self._call("event_synchronize", event)

    def stream_wait_event(self, stream, event) -> None:
        self._call("stream_wait_event", stream, event, 0)

    def event_elapsed_ms(self, start, end) -> float:
        return float(self._call("event_elapsed_time", start, end))

    def capture_begin(self, stream) -> None:
        self._call("stream_begin_capture", stream, self._capture_mode())
        self._capturing.add(self.stream_handle(stream))

    def _capture_stop(self, stream):
        """Stop capturing on `stream`: the captured graph's template, the caller's to instantiate and destroy."""
        self._capturing.discard(self.stream_handle(stream))
        return self._call("stream_end_capture", stream)

    def capture_end(self, stream, keep: bool = True):
        graph = self._capture_stop(stream)
        try:
            if not keep:
                return None
            self.activate()  # the executable graph is made in the current context: ours, whatever the step left
            return self._call("graph_instantiate", graph, 0)
        finally:
            self._call("graph_destroy", graph)  # the executable graph does not need its template

    def graph_launch(self, graph, stream) -> None:
        self._call("graph_launch", graph, stream)

    def stream_capturing(self, stream) -> bool:
        status = self._call("stream_is_capturing", stream)  # (none, active, or invalidated: still capturing)
        return int(getattr(status, "value", status)) != 0

    def capture_join(self, stream) -> None:
        self._joined.add(self.stream_handle(stream))

    def capture_leave(self, stream) -> None:
        self._joined.discard(self.stream_handle(stream))

    def graph_destroy(self, graph) -> None:
        self._call("graph_exec_destroy", graph)

    def module_load(self, image: bytes):
        self.activate()
        return self._call("module_load_data", image)

    def module_unload(self, module) -> None:
        self._call("module_unload", module)

    def module_function(self, module, name: str):
        return self._call("module_get_function", module, name.encode())

    def resident_blocks(self, function, block_threads: int) -> int:
        return int(self._call("occupancy", function, block_threads, 0))

    def launch(self, function, grid: int, block: int, stream, pack) -> None:
        # The binding reads a buffer-protocol object as the void** array itself: the ctypes array goes in as is.
        launch = self.__dict__.get("_launch_kernel")  # looked up once: this is every call's path
        if launch is None:
            launch = self._launch_kernel = getattr(self._api(), self._CALLS["launch_kernel"])
        result = launch(function, grid, 1, 1, block, 1, 1, 0, stream, pack.kernel_params, self._LAUNCH_EXTRA)
        if result[0]:
            self._check(result, self._CALLS["launch_kernel"])

    def function_address(self, function) -> int:
        return int(function)

    def close(self) -> None:
        # Best effort, unchecked: a failure here must not mask shutdown.
        event = getattr(self.__dict__.get("_handoff"), "event", None)  # this thread's (stream_wait_stream)
        if event is not None:
            getattr(self._api(), self._CALLS["event_destroy"])(event)
        streams, self._streams = getattr(self, "_streams", set()), set()
        for stream in streams:
            getattr(self._api(), self._CALLS["stream_destroy"])(stream)
