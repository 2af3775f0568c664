"""HIP backend over AMD's hip-python (`from hip import hip`): what HIP does its own way; the rest is DriverBackend's."""
from __future__ import annotations

import ctypes
import os

from .base import DeviceInfo
from .driver import CALLS, DriverBackend, make_check

_CALLS = {role: names[1] for role, names in CALLS.items()}

# Every attribute of `hip` used, here or through _CALLS: tests check they exist, as no ROCm runtime runs them.
_USED_CALLS = (
    "hipSetDevice", "hipGetDevice", "hipGetDeviceProperties", "hipGetErrorString",
    "hipExtMallocWithFlags", "hipHostMallocMapped", "hipHostMallocCoherent", "hipHostMallocPortable",
    "hipIpcGetMemHandle", "hipIpcOpenMemHandle", "hipPointerGetAttributes", "hipEventCreate", "hipError_t",
    "hipIpcMemHandle_t", "ihipStream_t", "hipMemoryType", "hipDeviceMallocFinegrained",
    "hipIpcMemLazyEnablePeerAccess", "hipStreamNonBlocking", "hipStreamCaptureMode", "hipDeviceCanAccessPeer",
    "hipDeviceEnablePeerAccess") + tuple(_CALLS.values())

_IPC_HANDLE_BYTES = 64  # sizeof(hipIpcMemHandle_t), HIP_IPC_HANDLE_SIZE
hip = None  # hip-python's binding module, bound by _load() so importing this module never needs it


def _load():
    global hip
    if hip is None:
        try:
            from hip import hip as _hip
        except ImportError as e:
            raise ImportError("the HIP backend needs AMD's hip-python bindings (`pip install hip-python`, "
                              "matching the installed ROCm); `from hip import hip` failed: " + str(e)) from e
        hip = _hip
    return hip


def _text(value) -> str:
    """A char-array field: str in recent hip-python, bytes in older ones."""
    if isinstance(value, (bytes, bytearray)):
        value = value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


def _error_text(err) -> str | None:
    _, text = hip.hipGetErrorString(err)
    return f"{err.name}: {text}" if text is not None and str(text) else None


_check = make_check(_error_text, "hipError_t")


def _handle_to_bytes(handle) -> bytes:
    return ctypes.string_at(int(handle), _IPC_HANDLE_BYTES)  # int() of a hip-python struct is its address


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
    _LAUNCH_EXTRA = None  # plain hipModuleLaunchKernel: one-node graphs were measured cheaper on NVIDIA only
    _WAIT_MASK = (0xFFFFFFFF,)  # hipStreamWaitValue32 compares (word & mask) with the value
    # (stream_word_ops stays one call an operation: ROCm marks hipStreamBatchMemOp beta, and no AMD GPU ran it here)
    _api = staticmethod(_load)
    _check = staticmethod(_check)

    def __init__(self):
        super().__init__()
        self._opened = None  # the device open_device made current: what activate() switches back to

    def stream_waits_refused(self) -> str | None:
        # ROCm waits for a word in one of two ways: by default with a small wait kernel (it holds a slot of one
        # CU while it waits); with GPU_STREAMOPS_CP_WAIT set, on the command processor, which takes only HSA
        # signal memory (hipMallocSignalMemory) and refuses any other pointer, as our heap's words are.
        value = os.environ.get("GPU_STREAMOPS_CP_WAIT", "")
        if value.strip().lower() in ("", "0", "false", "no", "off"):
            return None
        return (f"GPU_STREAMOPS_CP_WAIT={value} makes ROCm wait for words on the command processor, which "
                "takes only HSA signal memory; pyhipa2a's readiness words live in its symmetric heap, so every "
                "such wait would fail: unset GPU_STREAMOPS_CP_WAIT for this process")

    def launch_entry(self) -> int | None:
        try:  # (the library hip-python binds; hipModuleLaunchKernel takes cuLaunchKernel's arguments)
            return ctypes.cast(ctypes.CDLL("libamdhip64.so").hipModuleLaunchKernel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            return None

    def open_device(self, index: int) -> DeviceInfo:
        self.current_device = index
        _check(hip.hipSetDevice(index), "hipSetDevice")
        self._opened = index
        props = _check(hip.hipGetDeviceProperties(index), "hipGetDeviceProperties")
        # arch "gfx942:sramecc+:xnack-" -> "gfx942": code objects are looked up by the bare target.
        return DeviceInfo(name=_text(props.name), arch=_text(props.gcnArchName).split(":", 1)[0], index=index,
                          count=self.device_count(), multiprocessors=int(props.multiProcessorCount),
                          warp_size=int(props.warpSize))

    def module_owner(self):
        # The opened device's primary context, living as long as the process (current_device is set before it opens).
        return ("hip", self._opened) if self._opened is not None else None

    def activate(self) -> None:
        if self._opened is None:  # no device opened yet: nothing of ours to make current
            return
        current = hip.hipGetDevice()
        if current[0] or current[1] != self._opened:
            _check(hip.hipSetDevice(self._opened), "hipSetDevice")

    def malloc_ipc(self, nbytes: int) -> int:
        # Fine-grained: peers' stores stay coherent while a kernel runs, which the flag polling depends on.
        self.activate()
        ptr = int(_check(hip.hipExtMallocWithFlags(nbytes, hip.hipDeviceMallocFinegrained), "hipExtMallocWithFlags"))
        self.memset(ptr, 0, nbytes)
        return ptr

    def _host_mapped_flags(self):
        # Coherent: the host sees a kernel's status stores while the kernel still runs.
        return hip.hipHostMallocMapped | hip.hipHostMallocCoherent | hip.hipHostMallocPortable

    def ipc_export(self, ptr: int) -> bytes:
        return _handle_to_bytes(_check(hip.hipIpcGetMemHandle(ptr), "hipIpcGetMemHandle"))

    def ipc_open(self, handle: bytes) -> int:
        self.activate()
        return int(_check(hip.hipIpcOpenMemHandle(_handle_from_bytes(handle), hip.hipIpcMemLazyEnablePeerAccess),
                          "hipIpcOpenMemHandle"))

    def _enable_peer_access(self, device: int) -> bool:
        if not _check(hip.hipDeviceCanAccessPeer(self.current_device, device), "hipDeviceCanAccessPeer"):
            return False
        err = hip.hipDeviceEnablePeerAccess(device, 0)[0]  # (from the current device: ours, activated)
        if err not in (hip.hipError_t.hipSuccess, hip.hipError_t.hipErrorPeerAccessAlreadyEnabled):
            _check((err,), "hipDeviceEnablePeerAccess")
        return True

    def pointer_device(self, ptr: int) -> int | None:
        err, attrs = hip.hipPointerGetAttributes(ptr)
        # Memory HIP never saw is, by ROCm release, an InvalidValue error or a success that says unregistered.
        if err == hip.hipError_t.hipErrorInvalidValue:
            return None
        _check((err,), "hipPointerGetAttributes")
        if attrs.type == hip.hipMemoryType.hipMemoryTypeUnregistered:
            return None
        return int(attrs.device)

    def _non_blocking_stream_flags(self):
        return hip.hipStreamNonBlocking

    def _capture_mode(self):
        return hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal

    def stream_from_handle(self, handle: int):
        return hip.ihipStream_t.fromObj(handle)

    @property
    def stream_type(self):
        return hip.ihipStream_t

    def open_blas(self):
        from .blas import HIPBLAS, VendorBlas
        return VendorBlas(self, HIPBLAS)

    def event_create(self):
        # hipEventCreate uses default flags, so timing stays on for event_elapsed_ms.
        self.activate()
        return _check(hip.hipEventCreate(), "hipEventCreate")
