"""A communicator over NCCL (NVIDIA) or RCCL (AMD: the same C API), loaded with ctypes, bootstrapped with mpi4py:
one group of byte sends and receives per `exchange`, on a raw stream handle, for the traffic between nodes. Past
the unique id's broadcast no call waits for a peer without bound (NcclTimeout, and it is aborted), unless NCCL
writes no communicator handle before its init waits (an abort needs it; NCCL 2.14 on writes it first); what the
device waits for is the caller's watchdog's to abort. Needs NCCL >= 2.14 (or an RCCL built from it)."""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import threading
import time
import warnings
import weakref
from pathlib import Path

from ..errors import RuntimeFailure

__all__ = ["LIBRARY_VARIABLE", "NcclComm", "NcclFailure", "NcclLibrary", "NcclTimeout", "find_library"]

LIBRARY_VARIABLE = "PYHIPA2A_NCCL_LIBRARY"
MIN_VERSION = 21400  # NCCL_VERSION(2, 14, 0)

# ncclResult_t and ncclDataType_t values used here (the same in NCCL and RCCL).
_SUCCESS = 0
_IN_PROGRESS = 7
_UINT8 = 1

_UNIQUE_ID_BYTES = 128        # NCCL_UNIQUE_ID_BYTES
_API_MAGIC = 0xCAFEBEEF       # NCCL_API_MAGIC
_CONFIG_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN): "NCCL picks"


class NcclFailure(RuntimeFailure):
    """An NCCL/RCCL call failed, or the library could not be found or loaded; the message holds NCCL's own text."""


class NcclTimeout(NcclFailure):
    """A step of the communicator (initialization, a group launch, finalization) ran past its timeout."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """ncclConfig_t's first fields: NCCL >= 2.17 copies `size` bytes over its defaults (2.14-2.16 read `blocking`
    alone); cgaClusterSize, unset, only avoids trailing padding."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int)]


_COMM = ctypes.c_void_p  # ncclComm_t, an opaque pointer
_RESULT = ctypes.c_int   # ncclResult_t

# (restype, argtypes) of every function used; a library without a required one is too old.
_SIGNATURES = {
    "ncclGetVersion": (_RESULT, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetErrorString": (ctypes.c_char_p, [_RESULT]),
    "ncclGetUniqueId": (_RESULT, [ctypes.POINTER(_UniqueId)]),
    "ncclCommInitRankConfig": (_RESULT, [ctypes.POINTER(_COMM), ctypes.c_int, _UniqueId, ctypes.c_int,
                                         ctypes.POINTER(_Config)]),
    "ncclCommGetAsyncError": (_RESULT, [_COMM, ctypes.POINTER(_RESULT)]),
    "ncclCommFinalize": (_RESULT, [_COMM]),
    "ncclCommDestroy": (_RESULT, [_COMM]),
    "ncclCommAbort": (_RESULT, [_COMM]),
    "ncclGroupStart": (_RESULT, []),
    "ncclGroupEnd": (_RESULT, []),
    # (buffer, count, datatype, peer, comm, stream)
    "ncclSend": (_RESULT, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, ctypes.c_void_p]),
    "ncclRecv": (_RESULT, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _COMM, ctypes.c_void_p]),
    "ncclGetLastError": (ctypes.c_char_p, [_COMM]),
}
_OPTIONAL = {"ncclGetLastError"}  # NCCL >= 2.13; only makes messages better


def _version_text(code: int) -> str:
    """NCCL_VERSION: X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _wheel_candidates() -> list[Path]:
    """libnccl.so.2 of the nvidia-nccl-cu13 / -cu12 wheels, found through import specs (which import no torch)."""
    dirs: list[Path] = []
    for name, below in (("nvidia.nccl", "."), ("nvidia", "nccl")):
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:  # no `nvidia` package at all
            continue
        if spec is not None and spec.submodule_search_locations:
            dirs += [Path(d) / below for d in spec.submodule_search_locations]
    return list(dict.fromkeys(d / "lib" / "libnccl.so.2" for d in dirs))


def _rocm_candidates() -> list[Path]:
    roots = [os.environ["ROCM_PATH"]] if os.environ.get("ROCM_PATH") else []
    roots.append("/opt/rocm")
    # (librccl.so is the development link; a runtime-only install has just the versioned name)
    return list(dict.fromkeys(Path(r) / "lib" / name for r in roots for name in ("librccl.so", "librccl.so.1")))


def _loader_finds(soname: str) -> bool:
    """Whether the dynamic loader resolves `soname` (LD_LIBRARY_PATH, the ld cache)."""
    try:
        ctypes.CDLL(soname)
        return True
    except OSError:
        return False


_HOW_TO_FIX = {
    "cuda": f"install NCCL with `pip install nvidia-nccl-cu13` (nvidia-nccl-cu12 for CUDA 12), "
            f"or set {LIBRARY_VARIABLE} to the path of libnccl.so.2",
    "hip": f"install ROCm's RCCL (the rccl package), or set {LIBRARY_VARIABLE} to the path of librccl.so",
}


def find_library(kind: str) -> str:
    """The NCCL ("cuda") or RCCL ("hip") library to load, as a path or a name the dynamic loader resolves:
    $PYHIPA2A_NCCL_LIBRARY (a file), else the nvidia-nccl wheels' or ROCm's, else the system's."""
    if kind not in _HOW_TO_FIX:
        raise ValueError(f"no NCCL flavour for backend {kind!r}: choose 'cuda' (NCCL) or 'hip' (RCCL)")
    override = os.environ.get(LIBRARY_VARIABLE)
    if override:
        if not os.path.isfile(override):
            raise NcclFailure(f"{LIBRARY_VARIABLE}={override!r} names no file; point it at libnccl.so.2 or librccl.so")
        return override
    short, soname = ("nccl", "libnccl.so.2") if kind == "cuda" else ("rccl", "librccl.so")
    candidates = _wheel_candidates() if kind == "cuda" else _rocm_candidates()
    for path in candidates:
        if path.is_file():
            return str(path)
    found = ctypes.util.find_library(short)
    if found:
        return found
    if _loader_finds(soname):
        return soname
    tried = ", ".join([str(p) for p in candidates] + [f"ctypes.util.find_library({short!r})", soname])
    raise NcclFailure(f"no {short.upper()} library found (tried {tried}): {_HOW_TO_FIX[kind]}")


class NcclLibrary:
    """An NCCL or RCCL shared library, loaded with ctypes. Tests pass `_functions`: an object whose attributes
    stand in for the C functions (out-parameters as ctypes pointers); no library is loaded then."""

    def __init__(self, path: str, _functions=None):
        self.path = path
        if _functions is None:
            try:
                _functions = ctypes.CDLL(path)
            except OSError as e:
                raise NcclFailure(f"cannot load the NCCL library {path}: {e}") from e
            _declare(_functions, path)
        self.fn = _functions
        self._has_last_error = hasattr(_functions, "ncclGetLastError")
        version = ctypes.c_int()
        self.call("ncclGetVersion", ctypes.pointer(version))
        self.version = version.value

    def error_string(self, code: int) -> str:
        text = self.fn.ncclGetErrorString(code)
        return text.decode(errors="replace") if text else f"ncclResult_t {code}"

    def describe(self, what: str, code: int, comm=None) -> str:
        """`what` failed with `code`, in NCCL's words, with its last error message where it has one."""
        message = f"{what} failed: {self.error_string(code)} (ncclResult_t {code})"
        last = self.fn.ncclGetLastError(comm) if self._has_last_error else None
        if last:
            message += f"; NCCL's last error: {last.decode(errors='replace')}"
        return message

    def call(self, name: str, *args, comm=None) -> int:
        """Call `name`; raise NcclFailure unless it returned ncclSuccess."""
        code = getattr(self.fn, name)(*args)
        if code == _SUCCESS:
            return code
        raise NcclFailure(self.describe(name, code, comm))


def _declare(cdll, path: str) -> None:
    missing = []
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(cdll, name, None)
        if function is not None:
            function.restype, function.argtypes = restype, argtypes
        elif name not in _OPTIONAL:
            missing.append(name)
    if missing:
        raise NcclFailure(f"{path} lacks {', '.join(missing)}: pyhipa2a needs NCCL >= {_version_text(MIN_VERSION)} "
                          f"(or an RCCL built from it)")


class NcclComm:
    """An NCCL communicator over an mpi4py communicator's ranks, made collectively, each with its device current.

    It is blocking: a group launches in one call (12-18 us of host time on two H200s, NCCL 2.28, against 70-85 us
    where a non-blocking communicator's every group starts a thread of NCCL's). The calls that can wait for a
    peer (the init, a group's launch while it connects, the finalize) run against a deadline: a watch thread
    that finds one past `timeout` aborts the communicator, which ends the wait, and the call raises NcclTimeout
    naming its step (a call that returns just then too: the communicator is aborted either way). One thread
    drives it; abort() may come from any (a call it ends raises NcclFailure). close() ends the watch thread,
    which holds the object weakly: one never closed still goes, and its thread with it."""

    def __init__(self, library: NcclLibrary, comm, timeout: float):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if library.version < MIN_VERSION:
            raise NcclFailure(f"{library.path} is NCCL {_version_text(library.version)}; pyhipa2a needs "
                              f">= {_version_text(MIN_VERSION)} (ncclCommInitRankConfig, ncclCommFinalize)")
        self._lib = library
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self.aborted = self._closed = False
        self._abort_thread: threading.Thread | None = None  # runs ncclCommAbort (abort())
        self._abort_error: NcclFailure | None = None
        self._handle = _COMM()  # (NCCL writes it as its init begins: the watch can abort an init that waits)
        self._state = _RESULT()  # reused by every poll()
        self._state_ptr = ctypes.pointer(self._state)
        self._lock = threading.RLock()  # a bounded call's end against the watch's abort
        self._waiting: tuple[str, float] | None = None  # (step, deadline) of the bounded call under way
        self._expired: str | None = None  # the step the watch aborted
        self._stop = threading.Event()
        uid = self._unique_id(comm)
        self._watch_thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, timeout),
                                              daemon=True, name=f"pyhipa2a NCCL watch (rank {self.rank})")
        self._watch_thread.start()
        config = _Config(size=ctypes.sizeof(_Config), magic=_API_MAGIC, version=self._lib.version,
                         blocking=1, cgaClusterSize=_CONFIG_UNDEF_INT)
        try:
            self._bounded("ncclCommInitRankConfig", ctypes.pointer(self._handle), self.size, uid, self.rank,
                          ctypes.pointer(config))
        except BaseException:
            try:
                self._abort_and_join()  # the caller gets no object to close (a failed init may still hold one)
            finally:
                self._stop_watch()
            raise

    def _unique_id(self, comm) -> _UniqueId:
        # Rank 0 sends its failure too, so the other ranks raise instead of waiting for an id that never comes.
        sent = None
        if self.rank == 0:
            uid = _UniqueId()
            try:
                self._lib.call("ncclGetUniqueId", ctypes.pointer(uid))
                sent = (True, bytes(uid))
            except NcclFailure as e:
                sent = (False, str(e))
        ok, payload = comm.bcast(sent, root=0)
        if not ok:
            raise NcclFailure(payload if self.rank == 0 else f"rank 0 could not create the NCCL unique id: {payload}")
        return _UniqueId.from_buffer_copy(payload)

    def _bounded(self, name: str, *args) -> None:
        """Call NCCL's `name`, which may wait for a peer, against the deadline: NcclTimeout where the watch
        aborted the communicator to end it, NcclFailure where it failed."""
        with self._lock:
            self._waiting = (name, time.monotonic() + self.timeout)
        try:
            code = getattr(self._lib.fn, name)(*args)
        finally:
            with self._lock:
                self._waiting = None
                expired, self._expired = self._expired, None
        if expired is not None:
            raise NcclTimeout(f"{name} on rank {self.rank} of {self.size} had not returned after {self.timeout:.1f} s "
                              f"(a rank never arrived or is stuck); the communicator was aborted")
        if code != _SUCCESS:
            raise NcclFailure(self._lib.describe(name, code, self._handle))

    def _abort_if_late(self) -> None:
        """Abort the communicator where a bounded call is past its deadline; an init whose handle NCCL has not
        written yet is looked at again (an abort without it would end nothing)."""
        with self._lock:
            waiting = self._waiting
            if waiting is not None and time.monotonic() > waiting[1] and self._handle.value:
                self._expired, self._waiting = waiting[0], None
                self.abort()

    def _stop_watch(self) -> None:
        self._stop.set()
        self._watch_thread.join()

    def _async_state(self) -> int:
        self._lib.call("ncclCommGetAsyncError", self._handle, self._state_ptr, comm=self._handle)
        return self._state.value

    def _ensure_usable(self) -> None:
        if self.aborted:
            raise NcclFailure("the NCCL communicator was aborted")
        if self._closed:
            raise NcclFailure("the NCCL communicator was closed")

    def exchange(self, sends, recvs, stream: int) -> None:
        """One group of byte sends and receives on `stream` (a raw cudaStream_t / hipStream_t); `sends`, `recvs`:
        (peer, device pointer, nbytes), 0 bytes skipped. Nothing waits for the device (fine during capture)."""
        self._ensure_usable()
        stream = int(stream)  # (what can refuse the arguments runs before the group opens)
        sends, recvs = _nonempty(sends, self.size), _nonempty(recvs, self.size)
        if not sends and not recvs:
            return
        lib = self._lib
        lib.call("ncclGroupStart")
        try:
            for peer, ptr, nbytes in sends:
                lib.call("ncclSend", ptr, nbytes, _UINT8, peer, self._handle, stream, comm=self._handle)
            for peer, ptr, nbytes in recvs:
                lib.call("ncclRecv", ptr, nbytes, _UINT8, peer, self._handle, stream, comm=self._handle)
        except BaseException:
            try:  # close our group (groups nest per thread), bounded: what it launched may wait for peers
                self._bounded("ncclGroupEnd")
            except NcclFailure:
                pass  # (the error raised says what failed)
            raise
        self._bounded("ncclGroupEnd")

    def poll(self) -> None:
        """Raise NcclFailure if NCCL reports an asynchronous error on this communicator."""
        self._ensure_usable()
        state = self._async_state()
        if state not in (_SUCCESS, _IN_PROGRESS):
            raise NcclFailure(self._lib.describe("NCCL communicator", state, self._handle))

    def abort(self) -> None:
        """Stop the communicator now, without waiting for the device. Idempotent; from any thread.

        ncclCommAbort raises NCCL's abort flag first, which ends its kernels and a call of ours that waits
        for a peer, then frees device memory, and freeing waits for the whole device: a stream stuck anywhere
        on it (the caller's expert, stuck before its group_done) would hang the caller inside the call that
        reports the timeout. So the call runs on a thread of its own; close() waits for it."""
        with self._lock:  # (the thread made and started under it: close() never finds one half made)
            if self.aborted or self._closed:
                return
            self.aborted = True
            handle, self._handle = self._handle, _COMM()
            if handle.value:
                self._abort_thread = threading.Thread(target=self._abort_handle, args=(handle,), daemon=True,
                                                      name=f"pyhipa2a NCCL abort (rank {self.rank})")
                self._abort_thread.start()

    def _abort_handle(self, handle: _COMM) -> None:
        try:
            self._lib.call("ncclCommAbort", handle)
        except NcclFailure as e:
            self._abort_error = e

    def _abort_and_join(self) -> NcclFailure | None:
        """abort(), then wait (bounded) for its thread; what ncclCommAbort reported, if it failed. A thread
        still running after the timeout is left to finish when the device's stuck work does, with a warning."""
        self.abort()
        with self._lock:
            thread, self._abort_thread = self._abort_thread, None
        if thread is None:
            return None
        thread.join(self.timeout)
        if thread.is_alive():
            warnings.warn(f"NCCL's abort on rank {self.rank} still waits for the device after {self.timeout:.1f} s "
                          f"(work queued on it never finishes); it ends when that work does", RuntimeWarning,
                          stacklevel=3)
            return None
        error, self._abort_error = self._abort_error, None
        return error

    def close(self) -> None:
        """Finalize (bounded) and destroy a healthy communicator, else abort; a failed finalize aborts, then raises.
        Once aborted, close waits (bounded) for the abort's thread and raises what ncclCommAbort reported."""
        if self._closed:
            return
        try:
            if not self.aborted:
                try:
                    healthy = self._async_state() == _SUCCESS
                except NcclFailure:
                    healthy = False
                if healthy:
                    self._finalize()
                    return
            error = self._abort_and_join()
            if error is not None:
                raise error
        finally:
            self._stop_watch()

    def _finalize(self) -> None:
        try:
            self._bounded("ncclCommFinalize", self._handle)
        except NcclFailure:
            self._abort_and_join()  # (after a timeout: already aborted; the finalize's failure is the one raised)
            raise
        self._closed = True
        handle, self._handle = self._handle, _COMM()
        self._lib.call("ncclCommDestroy", handle)


def _watch(comm_ref, stop: threading.Event, timeout: float) -> None:
    """A communicator's watch thread: every quarter of the timeout (at most 0.5 s), abort it where a bounded call
    is late; ends at close() or once the communicator is gone (it holds it weakly)."""
    while not stop.wait(min(timeout / 4, 0.5)):
        comm = comm_ref()
        if comm is None:
            return
        comm._abort_if_late()
        del comm


def _nonempty(entries, size: int) -> list[tuple[int, int, int]]:
    """The entries with bytes to move, checked before any reaches NCCL (a group half built cannot be undone)."""
    kept = []
    for peer, ptr, nbytes in entries:
        if not 0 <= peer < size:
            raise ValueError(f"peer {peer} is not a rank of this {size}-rank NCCL communicator")
        if nbytes < 0:
            raise ValueError(f"negative byte count {nbytes} for peer {peer}")
        if nbytes:
            kept.append((int(peer), int(ptr), int(nbytes)))
    return kept
