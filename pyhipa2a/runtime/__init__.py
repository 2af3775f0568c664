"""Runtime backends behind one interface (`base.Backend`): hip, cuda, host.

`get_backend()` picks one: the `PYHIPA2A_BACKEND` variable or the `name`
argument when given, else the first of hip (an AMD GPU is present), cuda (an
NVIDIA GPU is present), host (no GPU). No layer above this package imports
hip-python or cuda-python.
"""
from __future__ import annotations

import os

from .base import Backend, DeviceInfo, RuntimeFailure

BACKENDS = ("hip", "cuda", "host")
__all__ = ["Backend", "DeviceInfo", "RuntimeFailure", "BACKENDS", "get_backend", "select_device"]


def _make(name: str) -> Backend:
    if name == "hip":
        from .hip import HipBackend
        return HipBackend()
    if name == "cuda":
        from .cuda import CudaBackend
        return CudaBackend()
    from .host import HostBackend
    return HostBackend()


def _with_devices(name: str) -> Backend | None:
    """Backend `name` if it can be created here and sees at least one device."""
    try:
        backend = _make(name)
        return backend if backend.device_count() > 0 else None
    except Exception:  # missing bindings, missing driver library, no device: not this backend
        return None


def get_backend(name: str | None = None) -> Backend:
    name = name or os.environ.get("PYHIPA2A_BACKEND") or None
    if name is not None:
        name = name.strip().lower()
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
        return _make(name)
    for candidate in ("hip", "cuda"):
        backend = _with_devices(candidate)
        if backend is not None:
            return backend
    return _make("host")


def select_device(backend: Backend, local_rank: int, device: int | None = None) -> int:
    """The device this rank drives: `device`, else PYHIPA2A_DEVICE, else local rank modulo the count.

    All of the node's GPUs stay visible to every rank: opening a peer's IPC
    handle maps memory that lives on the peer's GPU.
    """
    count = backend.device_count()
    if device is None and os.environ.get("PYHIPA2A_DEVICE"):
        device = int(os.environ["PYHIPA2A_DEVICE"])
    if device is None:
        device = local_rank % count
    if not 0 <= device < count:
        raise ValueError(f"device {device} does not exist: {count} {backend.kind} device(s) visible")
    return device
