"""HIP backend over AMD's hip-python (`from hip import hip`).

Every binding call returns a tuple whose first item is a `hipError_t`;
`_check` turns a failure into `RuntimeFailure` and hands back the remaining
value(s). Streams, events, modules and functions are the binding's own handle
objects; pointers cross this interface as plain ints.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .base import Backend, DeviceInfo, RuntimeFailure

# Every attribute of `hip` used below; tests assert they all exist, since this
# code cannot run without ROCm's libamdhip64.so and an AMD GPU.
_USED_CALLS = (
    "hipInit", "hipGetDeviceCount", "hipSetDevice", "hipGetDeviceProperties",
    "hipGetErrorString",
    "hipExtMallocWithFlags", "hipFree", "hipHostMalloc", "hipHostGetDevicePointer", "hipHostFree",
    "hipHostMallocMapped", "hipHostMallocCoherent", "hipHostMallocPortable", "hipMemsetD8", "hipMemsetD8Async",
    "hipIpcGetMemHandle", "hipIpcOpenMemHandle", "hipIpcCloseMemHandle", "hipPointerGetAttributes",
    "hipMemcpyHtoD", "hipMemcpyHtoDAsync", "hipMemcpyDtoH", "hipMemcpyDtoHAsync",
    "hipMemcpyDtoD", "hipMemcpyDtoDAsync",
    "hipStreamCreateWithFlags", "hipStreamDestroy", "hipStreamSynchronize",
    "hipEventCreate", "hipEventDestroy", "hipEventRecord", "hipEventSynchronize", "hipEventElapsedTime",
    "hipModuleLoadData", "hipModuleUnload", "hipModuleGetFunction", "hipModuleLaunchKernel",
    "hipError_t", "hipIpcMemHandle_t", "ihipStream_t", "hipMemoryType",
    "hipDeviceMallocFinegrained", "hipIpcMemLazyEnablePeerAccess", "hipStreamNonBlocking",
)

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


def _failure(err, call: str) -> RuntimeFailure:
    return RuntimeFailure(f"{call} failed: {_error_text(err)}")


def _check(result, call: str):
    """Raise on a failed `result` tuple; return its value (None, one item, or a tuple)."""
    if result[0]:
        raise _failure(result[0], call)
    return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]


def _handle_to_bytes(handle) -> bytes:
    # int() of a hip-python struct wrapper is the struct's address.
    return ctypes.string_at(int(handle), _IPC_HANDLE_BYTES)


def _handle_from_bytes(data: bytes):
    if len(data) != _IPC_HANDLE_BYTES:
        raise ValueError(f"a HIP IPC handle is {_IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = hip.hipIpcMemHandle_t()  # owns a zeroed struct of its own
    ctypes.memmove(int(handle), bytes(data), _IPC_HANDLE_BYTES)
    return handle


def _host_buffer(a: np.ndarray) -> tuple[int, int]:
    if not a.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous")
    return a.ctypes.data, a.nbytes


class HipBackend(Backend):
    kind = "hip"
    code_suffix = ".hsaco"
    dlpack_device_type = 10  # kDLROCM

    def __init__(self):
        _load()
        _check(hip.hipInit(0), "hipInit")
        self._streams = set()  # created here and not yet destroyed; close() reclaims them

    # -- device -------------------------------------------------------------
    def device_count(self) -> int:
        return _check(hip.hipGetDeviceCount(), "hipGetDeviceCount")

    def open_device(self, index: int) -> DeviceInfo:
        self.current_device = index
        _check(hip.hipSetDevice(index), "hipSetDevice")
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

    # -- memory -------------------------------------------------------------
    def malloc_ipc(self, nbytes: int) -> int:
        # Fine-grained memory keeps peers' stores coherent while a kernel still
        # runs, which the all-to-all's flag polling depends on.
        ptr = _check(hip.hipExtMallocWithFlags(nbytes, hip.hipDeviceMallocFinegrained), "hipExtMallocWithFlags")
        ptr = int(ptr)
        _check(hip.hipMemsetD8(ptr, 0, nbytes), "hipMemsetD8")
        return ptr

    def free(self, ptr: int) -> None:
        _check(hip.hipFree(ptr), "hipFree")

    def malloc_host_mapped(self, nbytes: int) -> tuple[int, int]:
        # Coherent: the host sees a kernel's status stores while the kernel still runs.
        flags = hip.hipHostMallocMapped | hip.hipHostMallocCoherent | hip.hipHostMallocPortable
        host = int(_check(hip.hipHostMalloc(nbytes, flags), "hipHostMalloc"))
        ctypes.memset(host, 0, nbytes)
        dev = int(_check(hip.hipHostGetDevicePointer(host, 0), "hipHostGetDevicePointer"))
        return host, dev

    def free_host_mapped(self, host_ptr: int) -> None:
        _check(hip.hipHostFree(host_ptr), "hipHostFree")

    def ipc_export(self, ptr: int) -> bytes:
        return _handle_to_bytes(_check(hip.hipIpcGetMemHandle(ptr), "hipIpcGetMemHandle"))

    def ipc_open(self, handle: bytes) -> int:
        ptr = _check(hip.hipIpcOpenMemHandle(_handle_from_bytes(handle), hip.hipIpcMemLazyEnablePeerAccess),
                     "hipIpcOpenMemHandle")
        return int(ptr)

    def ipc_close(self, ptr: int) -> None:
        _check(hip.hipIpcCloseMemHandle(ptr), "hipIpcCloseMemHandle")

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

    # -- copies ---------------------------------------------------------------
    # Host<->device copies return once the data has arrived (the host buffer
    # may be reused or read at once); device-only ops are just stream-ordered.
    def copy_to_device(self, dst: int, src: np.ndarray, stream=None) -> None:
        addr, nbytes = _host_buffer(src)
        if stream is None:
            _check(hip.hipMemcpyHtoD(dst, addr, nbytes), "hipMemcpyHtoD")
        else:
            _check(hip.hipMemcpyHtoDAsync(dst, addr, nbytes, stream), "hipMemcpyHtoDAsync")
            _check(hip.hipStreamSynchronize(stream), "hipStreamSynchronize")

    def copy_to_host(self, dst: np.ndarray, src: int, stream=None) -> None:
        addr, nbytes = _host_buffer(dst)
        if stream is None:
            _check(hip.hipMemcpyDtoH(addr, src, nbytes), "hipMemcpyDtoH")
        else:
            _check(hip.hipMemcpyDtoHAsync(addr, src, nbytes, stream), "hipMemcpyDtoHAsync")
            _check(hip.hipStreamSynchronize(stream), "hipStreamSynchronize")

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        if stream is None:
            _check(hip.hipMemcpyDtoD(dst, src, nbytes), "hipMemcpyDtoD")
        else:
            _check(hip.hipMemcpyDtoDAsync(dst, src, nbytes, stream), "hipMemcpyDtoDAsync")

    def memset(self, ptr: int, byte: int, nbytes: int, stream=None) -> None:
        if stream is None:
            _check(hip.hipMemsetD8(ptr, byte, nbytes), "hipMemsetD8")
        else:
            _check(hip.hipMemsetD8Async(ptr, byte, nbytes, stream), "hipMemsetD8Async")

    # -- streams and events ---------------------------------------------------
    # Stream None is the null stream; the binding turns None into a NULL hipStream_t.
    def stream_create(self):
        # Non-blocking: must not serialise against work other libraries put on the null stream.
        stream = _check(hip.hipStreamCreateWithFlags(hip.hipStreamNonBlocking), "hipStreamCreateWithFlags")
        self._streams.add(stream)
        return stream

    def stream_destroy(self, stream) -> None:
        self._streams.discard(stream)
        _check(hip.hipStreamDestroy(stream), "hipStreamDestroy")

    def stream_handle(self, stream) -> int:
        return 0 if stream is None else int(stream)

    def stream_from_handle(self, handle: int):
        return hip.ihipStream_t.fromObj(handle)

    def stream_synchronize(self, stream) -> None:
        _check(hip.hipStreamSynchronize(stream), "hipStreamSynchronize")

    def event_create(self):
        # hipEventCreate uses default flags, so timing stays on for event_elapsed_ms.
        return _check(hip.hipEventCreate(), "hipEventCreate")

    def event_destroy(self, event) -> None:
        _check(hip.hipEventDestroy(event), "hipEventDestroy")

    def event_record(self, event, stream) -> None:
        _check(hip.hipEventRecord(event, stream), "hipEventRecord")

    def event_synchronize(self, event) -> None:
        _check(hip.hipEventSynchronize(event), "hipEventSynchronize")

    def event_elapsed_ms(self, start, end) -> float:
        return float(_check(hip.hipEventElapsedTime(start, end), "hipEventElapsedTime"))

    # -- code ---------------------------------------------------------------
    def module_load(self, image: bytes):
        return _check(hip.hipModuleLoadData(image), "hipModuleLoadData")

    def module_unload(self, module) -> None:
        _check(hip.hipModuleUnload(module), "hipModuleUnload")

    def module_function(self, module, name: str):
        return _check(hip.hipModuleGetFunction(module, name.encode()), "hipModuleGetFunction")

    def launch(self, function, grid: int, block: int, stream, pack) -> None:
        # kernelParams: the binding reads a buffer-protocol object as the void**
        # array itself, so the ctypes array goes in as is (no per-launch packing).
        (err,) = hip.hipModuleLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, pack.kernel_params, None)
        if err:
            raise _failure(err, "hipModuleLaunchKernel")

    def close(self) -> None:
        streams, self._streams = getattr(self, "_streams", set()), set()
        for stream in streams:
            hip.hipStreamDestroy(stream)  # best effort: a failure here must not mask shutdown
