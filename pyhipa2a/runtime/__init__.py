"""Runtime backends behind one interface (`base.Backend`): hip, cuda, host; nothing above imports their bindings."""
from __future__ import annotations

import os

from ..arguments import env_int, is_int
from ..errors import RuntimeFailure
from .base import Backend, DeviceInfo, Launcher

BACKENDS = ("hip", "cuda", "host")
__all__ = ["Backend", "DeviceInfo", "Launcher", "RuntimeFailure", "BACKENDS", "get_backend", "select_device"]


def _make(name: str) -> Backend:
    if name == "hip":
        from .hip import HipBackend
        return HipBackend()
    if name == "cuda":
        from .cuda import CudaBackend
        return CudaBackend()
    from .host import HostBackend
    return HostBackend()


def get_backend(name: str | Backend | None = None) -> Backend:
    """`name` (a Backend: itself), else $PYHIPA2A_BACKEND, else the first of hip and cuda that sees a device, else
    host."""
    if isinstance(name, Backend):
        return name
    if name is None:
        name = os.environ.get("PYHIPA2A_BACKEND") or None
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"backend must be one of {', '.join(BACKENDS)} or a Backend, not {type(name).__name__}")
        name = name.strip().lower()
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
        return _make(name)
    for candidate in ("hip", "cuda"):
        try:
            backend = _make(candidate)
            if backend.device_count() > 0:
                return backend
        except Exception:  # missing bindings, missing driver library, no device: not this backend
            pass
    return _make("host")


def select_device(backend: Backend, local_rank: int, device: int | None = None) -> int:
    """The device this rank drives: `device`, else PYHIPA2A_DEVICE, else local rank modulo the count. Every rank
    sees all the node's GPUs: a peer's IPC handle maps memory on the peer's GPU."""
    count = backend.device_count()
    if device is None:
        device = env_int("PYHIPA2A_DEVICE")
    if device is None:
        device = local_rank % count
    if not is_int(device):
        raise TypeError(f"device must be an int, not {type(device).__name__}")
    if not 0 <= device < count:
        raise ValueError(f"device {device} does not exist: {count} {backend.kind} device(s) visible")
    return device
