"""CUDA backend over the driver API of cuda-python (`cuda.bindings.driver`).

Every binding call returns a tuple whose first item is a `CUresult`; `_check`
turns a failure into `RuntimeFailure` and hands back the remaining value(s).
Streams, events, modules and functions are the binding's own handle objects;
pointers cross this interface as plain ints.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .base import Backend, DeviceInfo, RuntimeFailure

# Every attribute of `driver` used below; tests assert they all exist, since
# this code cannot run on a machine without an NVIDIA driver.
_USED_CALLS = (
    "cuInit", "cuDeviceGetCount", "cuCtxGetDevice_v2", "cuDeviceGet", "cuDeviceGetName", "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuGetErrorName", "cuGetErrorString",
    "cuMemAlloc", "cuMemFree", "cuMemHostAlloc", "cuMemHostGetDevicePointer", "cuMemFreeHost",
    "CU_MEMHOSTALLOC_DEVICEMAP", "CU_MEMHOSTALLOC_PORTABLE", "cuMemsetD8", "cuMemsetD8Async",
    "cuIpcGetMemHandle", "cuIpcOpenMemHandle", "cuIpcCloseMemHandle", "cuPointerGetAttribute",
    "cuMemcpyHtoD", "cuMemcpyHtoDAsync", "cuMemcpyDtoH", "cuMemcpyDtoHAsync",
    "cuMemcpyDtoD", "cuMemcpyDtoDAsync",
    "cuStreamCreate", "cuStreamDestroy", "cuStreamSynchronize",
    "cuEventCreate", "cuEventDestroy", "cuEventRecord", "cuEventSynchronize", "cuEventElapsedTime",
    "cuModuleLoadData", "cuModuleUnload", "cuModuleGetFunction", "cuLaunchKernel",
    "CUresult", "CUstream", "CUipcMemHandle", "CUdevice_attribute", "CUipcMem_flags",
    "CUpointer_attribute", "CUstream_flags", "CUevent_flags",
)

_IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle), fixed by the CUDA ABI

driver = None  # cuda.bindings.driver, bound by _load() so importing this module never needs it


def _load():
    global driver
    if driver is None:
        try:
            from cuda.bindings import driver as _driver
        except ImportError as e:
            raise ImportError(
                "the CUDA backend needs NVIDIA's cuda-python driver bindings "
                "(`pip install cuda-bindings`); importing cuda.bindings.driver failed: " + str(e)
            ) from e
        driver = _driver
    return driver


def _error_text(err) -> str:
    # cuGetErrorName/String need libcuda; without it (or for a code the driver
    # does not know) the enum's own name is still worth reporting.
    try:
        rn, name = driver.cuGetErrorName(err)
        rs, text = driver.cuGetErrorString(err)
        if rn == 0 and rs == 0 and name and text:
            return f"{name.decode()}: {text.decode()}"
    except Exception:
        pass
    return getattr(err, "name", None) or f"CUresult {int(err)}"


def _failure(err, call: str) -> RuntimeFailure:
    return RuntimeFailure(f"{call} failed: {_error_text(err)}")


def _check(result, call: str):
    """Raise on a failed `result` tuple; return its value (None, one item, or a tuple)."""
    if result[0]:
        raise _failure(result[0], call)
    return None if len(result) == 1 else result[1] if len(result) == 2 else result[1:]


def _handle_to_bytes(handle) -> bytes:
    # The struct's only field is `reserved`, which some cuda-bindings releases
    # do not expose; the struct's own address works in all of them.
    return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES)


def _handle_from_bytes(data: bytes):
    if len(data) != _IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {_IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = driver.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), bytes(data), _IPC_HANDLE_BYTES)
    return handle


def _host_buffer(a: np.ndarray) -> tuple[int, int]:
    if not a.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous")
    return a.ctypes.data, a.nbytes


class CudaBackend(Backend):
    kind = "cuda"
    code_suffix = ".fatbin"
    dlpack_device_type = 2  # kDLCUDA

    def __init__(self):
        _load()
        _check(driver.cuInit(0), "cuInit")
        self._context = None
        self._streams = set()  # created here and not yet destroyed; close() reclaims them

    # -- device -------------------------------------------------------------
    def device_count(self) -> int:
        return _check(driver.cuDeviceGetCount(), "cuDeviceGetCount")

    def open_device(self, index: int) -> DeviceInfo:
        self.current_device = index
        dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        # The primary context is the one the runtime API and other libraries
        # in this process share, so buffers stay usable across them.
        self._context = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        attr = driver.CUdevice_attribute

        def get(a):
            return _check(driver.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute")

        name = _check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
        major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        return DeviceInfo(
            name=name.split(b"\0", 1)[0].decode(errors="replace"),
            arch=f"sm_{major}{minor}",
            index=index,
            count=self.device_count(),
            multiprocessors=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            warp_size=32,  # every NVIDIA architecture so far
        )

    # -- memory -------------------------------------------------------------
    def malloc_ipc(self, nbytes: int) -> int:
        # cuMemAlloc memory is what cuIpcGetMemHandle accepts (VMM allocations are not).
        ptr = int(_check(driver.cuMemAlloc(nbytes), "cuMemAlloc"))
        _check(driver.cuMemsetD8(ptr, 0, nbytes), "cuMemsetD8")
        return ptr

    def free(self, ptr: int) -> None:
        _check(driver.cuMemFree(ptr), "cuMemFree")

    def ipc_export(self, ptr: int) -> bytes:
        return _handle_to_bytes(_check(driver.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle"))

    def ipc_open(self, handle: bytes) -> int:
        flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        ptr = _check(driver.cuIpcOpenMemHandle(_handle_from_bytes(handle), flags), "cuIpcOpenMemHandle")
        return int(ptr)

    def ipc_close(self, ptr: int) -> None:
        _check(driver.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")

    def malloc_host_mapped(self, nbytes: int) -> tuple[int, int]:
        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
        host = int(_check(driver.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
        ctypes.memset(host, 0, nbytes)
        dev = int(_check(driver.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
        return host, dev

    def free_host_mapped(self, host_ptr: int) -> None:
        _check(driver.cuMemFreeHost(host_ptr), "cuMemFreeHost")

    def pointer_device(self, ptr: int) -> int | None:
        # The pointer's context, not CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: on the
        # H200 machine the ordinal read 0 for memory on device 1.
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
        result = driver.cuPointerGetAttribute(attr, ptr)
        # The driver answers INVALID_VALUE for memory it did not allocate or register.
        if result[0] == driver.CUresult.CUDA_ERROR_INVALID_VALUE:
            return None
        context = _check(result, "cuPointerGetAttribute")
        if self._context is not None and int(context) == int(self._context):
            return self.current_device
        if hasattr(driver, "cuCtxGetDevice_v2"):
            return int(_check(driver.cuCtxGetDevice_v2(context), "cuCtxGetDevice_v2"))
        return -1  # another context: not the device this process drives

    # -- copies ---------------------------------------------------------------
    # Host<->device copies return once the data has arrived (the host buffer
    # may be reused or read at once); device-only ops are just stream-ordered.
    def copy_to_device(self, dst: int, src: np.ndarray, stream=None) -> None:
        addr, nbytes = _host_buffer(src)
        if stream is None:
            _check(driver.cuMemcpyHtoD(dst, addr, nbytes), "cuMemcpyHtoD")
        else:
            _check(driver.cuMemcpyHtoDAsync(dst, addr, nbytes, stream), "cuMemcpyHtoDAsync")
            _check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def copy_to_host(self, dst: np.ndarray, src: int, stream=None) -> None:
        addr, nbytes = _host_buffer(dst)
        if stream is None:
            _check(driver.cuMemcpyDtoH(addr, src, nbytes), "cuMemcpyDtoH")
        else:
            _check(driver.cuMemcpyDtoHAsync(addr, src, nbytes, stream), "cuMemcpyDtoHAsync")
            _check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        if stream is None:
            _check(driver.cuMemcpyDtoD(dst, src, nbytes), "cuMemcpyDtoD")
        else:
            _check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def memset(self, ptr: int, byte: int, nbytes: int, stream=None) -> None:
        if stream is None:
            _check(driver.cuMemsetD8(ptr, byte, nbytes), "cuMemsetD8")
        else:
            _check(driver.cuMemsetD8Async(ptr, byte, nbytes, stream), "cuMemsetD8Async")

    # -- streams and events ---------------------------------------------------
    # Stream None is handle 0, the legacy default stream; the binding maps None to 0.
    def stream_create(self):
        # Non-blocking: must not serialise against work other libraries put on stream 0.
        flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
        stream = _check(driver.cuStreamCreate(flags), "cuStreamCreate")
        self._streams.add(stream)
        return stream

    def stream_destroy(self, stream) -> None:
        self._streams.discard(stream)
        _check(driver.cuStreamDestroy(stream), "cuStreamDestroy")

    def stream_handle(self, stream) -> int:
        return 0 if stream is None else int(stream)

    def stream_from_handle(self, handle: int):
        return driver.CUstream(handle)

    def stream_synchronize(self, stream) -> None:
        _check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def event_create(self):
        # Default flags keep timing on (CU_EVENT_DISABLE_TIMING would break event_elapsed_ms).
        return _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")

    def event_destroy(self, event) -> None:
        _check(driver.cuEventDestroy(event), "cuEventDestroy")

    def event_record(self, event, stream) -> None:
        _check(driver.cuEventRecord(event, stream), "cuEventRecord")

    def event_synchronize(self, event) -> None:
        _check(driver.cuEventSynchronize(event), "cuEventSynchronize")

    def event_elapsed_ms(self, start, end) -> float:
        return float(_check(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    # -- code ---------------------------------------------------------------
    def module_load(self, image: bytes):
        return _check(driver.cuModuleLoadData(image), "cuModuleLoadData")

    def module_unload(self, module) -> None:
        _check(driver.cuModuleUnload(module), "cuModuleUnload")

    def module_function(self, module, name: str):
        return _check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")

    def launch(self, function, grid: int, block: int, stream, pack) -> None:
        # kernelParams: the binding reads a buffer-protocol object as the void**
        # array itself, so the ctypes array goes in as is (no per-launch packing).
        # extra must be 0, not None, for this binding.
        (err,) = driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, pack.kernel_params, 0)
        if err:
            raise _failure(err, "cuLaunchKernel")

    def close(self) -> None:
        streams, self._streams = getattr(self, "_streams", set()), set()
        for stream in streams:
            driver.cuStreamDestroy(stream)  # best effort: a failure here must not mask shutdown
