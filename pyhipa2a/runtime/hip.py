"""HIP backend over AMD's hip-python (`from hip import hip`).

Every binding call returns a tuple whose first item is a `hipError_t`;
`_check` turns a failure into `RuntimeFailure` and hands back the remaining
value(s). Streams, events, modules and functions are the binding's own handle
objects; pointers cross this interface as plain ints. Copies, streams, events,
modules and launches are the shared `DriverBackend`'s, through the `_CALLS`
table below; what is HIP's own (device set-up, fine-grained and IPC memory,
pointer queries, flags) is here.
"""
from __future__ import annotations

import ctypes

from .base import DeviceInfo
from .driver import DriverBackend, make_check

# The binding's function for each role DriverBackend's shared methods call.
_CALLS = {
    "mem_free": "hipFree", "host_alloc": "hipHostMalloc",
    "host_get_device_pointer": "hipHostGetDevicePointer", "host_free": "hipHostFree",
    "ipc_close_handle": "hipIpcCloseMemHandle",
    "memcpy_htod": "hipMemcpyHtoD", "memcpy_htod_async": "hipMemcpyHtoDAsync",
    "memcpy_dtoh": "hipMemcpyDtoH", "memcpy_dtoh_async": "hipMemcpyDtoHAsync",
    "memcpy_dtod": "hipMemcpyDtoD", "memcpy_dtod_async": "hipMemcpyDtoDAsync",
    "memset_d8": "hipMemsetD8", "memset_d8_async": "hipMemsetD8Async",
    "stream_create": "hipStreamCreateWithFlags", "stream_destroy": "hipStreamDestroy",
    "stream_synchronize": "hipStreamSynchronize",
    "event_destroy": "hipEventDestroy", "event_record": "hipEventRecord",
    "event_synchronize": "hipEventSynchronize", "event_elapsed_time": "hipEventElapsedTime",
    "module_load_data": "hipModuleLoadData", "module_unload": "hipModuleUnload",
    "module_get_function": "hipModuleGetFunction", "launch_kernel": "hipModuleLaunchKernel",
    "mem_get_info": "hipMemGetInfo",
    "stream_begin_capture": "hipStreamBeginCapture", "stream_end_capture": "hipStreamEndCapture",
    "graph_instantiate": "hipGraphInstantiateWithFlags", "graph_launch": "hipGraphLaunch",
    "graph_exec_destroy": "hipGraphExecDestroy", "graph_destroy": "hipGraphDestroy",
    "occupancy": "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
    "event_record_with_flags": "hipEventRecordWithFlags", "stream_wait_event": "hipStreamWaitEvent", "stream_query": "hipStreamQuery",
    "stream_is_capturing": "hipStreamIsCapturing",
}

# Every attribute of `hip` used here, directly below or through _CALLS; tests
# assert they all exist, since this code cannot run without ROCm's
# libamdhip64.so and an AMD GPU.
_USED_CALLS = (
    "hipInit", "hipGetDeviceCount", "hipSetDevice", "hipGetDevice", "hipGetDeviceProperties", "hipGetErrorString",
    "hipExtMallocWithFlags", "hipHostMallocMapped", "hipHostMallocCoherent", "hipHostMallocPortable",
    "hipIpcGetMemHandle", "hipIpcOpenMemHandle", "hipPointerGetAttributes", "hipEventCreate",
    "hipError_t", "hipIpcMemHandle_t", "ihipStream_t", "hipMemoryType",
    "hipDeviceMallocFinegrained", "hipIpcMemLazyEnablePeerAccess", "hipStreamNonBlocking",
    "hipStreamCaptureMode",
) + tuple(_CALLS.values())

_IPC_HANDLE_BYTES = 64  # sizeof(hipIpcMemHandle_t), HIP_IPC_HANDLE_SIZE

hip = None  # hip-python's binding module, bound by _load() so importing this module never needs it


def _load():
    global hip
    if hip is None:
        try:
            from hip import hip as _hip
        except ImportError as e:
            raise ImportError(
                "the HIP backend needs AMD's hip-python bindings (`pip install hip-python`, "
                "matching the installed ROCm); `from hip import hip` failed: " + str(e)
            ) from e
        hip = _hip
    return hip


def _text(value) -> str:
    # Char-array fields come back as str in recent hip-python, as bytes in older ones.
    if isinstance(value, (bytes, bytearray)):
        value = value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


def _error_text(err) -> str:
    # hipGetErrorString needs libamdhip64; without it the binding either raises
    # or returns no string, and the enum's own name is still worth reporting.
    try:
        _, text = hip.hipGetErrorString(err)
        if text is not None and str(text):
            return f"{err.name}: {text}"
    except Exception:
        pass
    return getattr(err, "name", None) or f"hipError_t {int(err)}"


_check = make_check(_error_text)  # raise on a failed (code, value...) tuple; return the value(s)


def _handle_to_bytes(handle) -> bytes:
    # int() of a hip-python struct wrapper is the struct's address.
    return ctypes.string_at(int(handle), _IPC_HANDLE_BYTES)


def _handle_from_bytes(data: bytes):
    if len(data) != _IPC_HANDLE_BYTES:
        raise ValueError(f"a HIP IPC handle is {_IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = hip.hipIpcMemHandle_t()  # owns a zeroed struct of its own
    ctypes.memmove(int(handle), bytes(data), _IPC_HANDLE_BYTES)
    return handle


class HipBackend(DriverBackend):
    kind = "hip"
    code_suffix = ".hsaco"
    dlpack_device_type = 10  # kDLROCM
    _CALLS = _CALLS
    # Launches stay hipModuleLaunchKernel: the CUDA backend's one-node graphs were measured cheaper
    # than a launch on NVIDIA only; hipGraphLaunch's cost on MI300X has not been measured here.
    _LAUNCH_EXTRA = None
    _api = staticmethod(_load)
    _check = staticmethod(_check)

    def __init__(self):
        super().__init__()
        _load()
        _check(hip.hipInit(0), "hipInit")
        self._opened = None  # the device open_device made current: what activate() switches back to

    # -- device -------------------------------------------------------------
    def device_count(self) -> int:
        return _check(hip.hipGetDeviceCount(), "hipGetDeviceCount")

    def open_device(self, index: int) -> DeviceInfo:
        self.current_device = index
        _check(hip.hipSetDevice(index), "hipSetDevice")
        self._opened = index
        props = _check(hip.hipGetDeviceProperties(index), "hipGetDeviceProperties")
        return DeviceInfo(
            name=_text(props.name),
            # "gfx942:sramecc+:xnack-" -> "gfx942": code objects are looked up by the bare target.
            arch=_text(props.gcnArchName).split(":", 1)[0],
            index=index,
            count=self.device_count(),
            multiprocessors=int(props.multiProcessorCount),
            warp_size=int(props.warpSize),
        )

    def module_owner(self):
        # HIP modules belong to the device's primary context, which lives as long as the process: the
        # device open_device made current (as activate() does, not current_device, which is set before
        # hipSetDevice can fail).
        return ("hip", self._opened) if self._opened is not None else None

    def activate(self) -> None:
        if self._opened is None:  # no device opened yet: nothing of ours to make current
            return
        current = hip.hipGetDevice()
        if current[0] or current[1] != self._opened:
            _check(hip.hipSetDevice(self._opened), "hipSetDevice")

    # -- memory -------------------------------------------------------------
    def malloc_ipc(self, nbytes: int) -> int:
        # Fine-grained memory keeps peers' stores coherent while a kernel still
        # runs, which the all-to-all's flag polling depends on.
        self.activate()
        ptr = _check(hip.hipExtMallocWithFlags(nbytes, hip.hipDeviceMallocFinegrained), "hipExtMallocWithFlags")
        ptr = int(ptr)
        self.memset(ptr, 0, nbytes)
        return ptr

    def _host_mapped_flags(self):
        # Coherent: the host sees a kernel's status stores while the kernel still runs.
        return hip.hipHostMallocMapped | hip.hipHostMallocCoherent | hip.hipHostMallocPortable

    def ipc_export(self, ptr: int) -> bytes:
        return _handle_to_bytes(_check(hip.hipIpcGetMemHandle(ptr), "hipIpcGetMemHandle"))

    def ipc_open(self, handle: bytes) -> int:
        self.activate()
        ptr = _check(hip.hipIpcOpenMemHandle(_handle_from_bytes(handle), hip.hipIpcMemLazyEnablePeerAccess),
                     "hipIpcOpenMemHandle")
        return int(ptr)

    def pointer_device(self, ptr: int) -> int | None:
        err, attrs = hip.hipPointerGetAttributes(ptr)
        # Depending on the ROCm release, memory HIP never saw is an InvalidValue
        # error or a success that reports it as unregistered.
        if err == hip.hipError_t.hipErrorInvalidValue:
            return None
        _check((err,), "hipPointerGetAttributes")
        if attrs.type == hip.hipMemoryType.hipMemoryTypeUnregistered:
            return None
        return int(attrs.device)

    # -- streams and events ---------------------------------------------------
    def _non_blocking_stream_flags(self):
        return hip.hipStreamNonBlocking

    def _capture_mode(self):
        return hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal

    def stream_from_handle(self, handle: int):
        return hip.ihipStream_t.fromObj(handle)

    @property
    def stream_type(self):
        return hip.ihipStream_t

    def event_create(self):
        # hipEventCreate uses default flags, so timing stays on for event_elapsed_ms.
        self.activate()
        return _check(hip.hipEventCreate(), "hipEventCreate")
