"""A small communicator over NCCL (NVIDIA) or RCCL (AMD), loaded with ctypes, bootstrapped with mpi4py.

It carries the traffic between nodes of a hierarchical all-to-all: one group
of point-to-point sends and receives of raw bytes per `exchange`, on a
CUDA/HIP stream given as a raw handle. RCCL has NCCL's C API under another
file name (librccl.so), so one class serves both.

The communicator runs in NCCL's non-blocking mode (config.blocking = 0):
initialization, group launches and finalization return ncclInProgress and
finish on NCCL's own threads, and we poll ncclCommGetAsyncError with a
deadline. Past the unique id's MPI broadcast at creation (which waits for
every rank, as MPI collectives do), no call here waits for a peer without
bound: a peer that never comes makes the step time out (NcclTimeout), and
the communicator is aborted. What the device then waits for (a receive whose
sender is gone) is the caller's watchdog's to abort. NCCL_COMM_BLOCKING=1 in
the environment overrides the config and makes NCCL's own waits unbounded.

Every C call is checked: a failure raises NcclFailure with NCCL's own strings
(ncclGetErrorString, and ncclGetLastError where the library has it). Needs
NCCL >= 2.14 (the first with ncclCommInitRankConfig, non-blocking mode and
ncclCommFinalize), or an RCCL built from it. No CUDA or HIP call is made
here: the caller makes its device current before creating a communicator.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import time
from pathlib import Path

from ..bootstrap import sleep_backoff
from .base import RuntimeFailure

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

# A non-blocking group launch runs on a thread NCCL starts for it, and an exchange's host time is
# mostly that thread's (one H100, NCCL 2.28: 55-60 us yielding between polls, ~100 us sleeping 0 s;
# 13 us for a blocking communicator): its polls yield first (bootstrap.sleep_backoff).


class NcclFailure(RuntimeFailure):
    """An NCCL/RCCL call failed, or the library could not be found or loaded; the message holds NCCL's own text."""


class NcclTimeout(NcclFailure):
    """A step of the communicator (initialization, a group launch, finalization) ran past its timeout."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """The first fields of ncclConfig_t, which every version since 2.17 (and RCCL) lays out alike.

    ncclConfig_t is versioned and append-only. Since 2.17 NCCL copies only the
    `size` bytes the caller passes over a config it filled with
    NCCL_CONFIG_INITIALIZER (parseCommConfig in init.cc), so a shorter struct
    leaves every later field at its default. cgaClusterSize is here, unset,
    only so the struct has no trailing padding: those 4 bytes would be copied
    into it. NCCL 2.14-2.16 read `blocking` alone, whose struct this covers.
    """
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
    ]


_COMM = ctypes.c_void_p  # ncclComm_t, an opaque pointer
_RESULT = ctypes.c_int   # ncclResult_t

# (restype, argtypes) of every function used; a library without one of the
# required ones is too old (NcclLibrary says so).
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
    # NCCL_VERSION: X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after.
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


# -- finding the library -------------------------------------------------------

def _wheel_candidates() -> list[Path]:
    """libnccl.so.2 of the nvidia-nccl-cu13 / -cu12 wheels: nvidia/nccl/lib/ in the `nvidia` namespace package.

    Found through import specs, which import nothing but the namespace package itself (no torch)."""
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
    # librccl.so is the development link; a runtime-only install has just the versioned name.
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
    """The NCCL ("cuda") or RCCL ("hip") library to load: a path, or a name the dynamic loader resolves.

    $PYHIPA2A_NCCL_LIBRARY first (it must name a file); then, for cuda, the
    nvidia-nccl wheels' libnccl.so.2 and the system's libnccl; for hip,
    $ROCM_PATH/lib, /opt/rocm/lib and the system's librccl."""
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


# -- the library ---------------------------------------------------------------

class NcclLibrary:
    """An NCCL or RCCL shared library, loaded with ctypes.

    `_functions` is the seam for tests: an object whose attributes stand in
    for the C functions (same names, same arguments, out-parameters as ctypes
    pointers); no library is loaded then."""

    def __init__(self, path: str, _functions=None):
        self.path = path
        if _functions is None:
            try:
                _functions = ctypes.CDLL(path)
            except OSError as e:
                raise NcclFailure(f"cannot load the NCCL library {path}: {e}") from e
            _declare(_functions, path)
        self._fn = _functions
        self._has_last_error = hasattr(_functions, "ncclGetLastError")
        version = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.pointer(version))
        self.version = version.value

    def error_string(self, code: int) -> str:
        text = self._fn.ncclGetErrorString(code)
        return text.decode(errors="replace") if text else f"ncclResult_t {code}"

    def _describe(self, what: str, code: int, comm=None) -> str:
        """`what` failed with `code`, in NCCL's words, with its last error message where it has one."""
        message = f"{what} failed: {self.error_string(code)} (ncclResult_t {code})"
        last = self._fn.ncclGetLastError(comm) if self._has_last_error else None
        if last:
            message += f"; NCCL's last error: {last.decode(errors='replace')}"
        return message

    def _call(self, name: str, *args, comm=None, in_progress_ok: bool = False) -> int:
        """Call `name`; raise NcclFailure unless it returned ncclSuccess (or ncclInProgress, when that is expected)."""
        code = getattr(self._fn, name)(*args)
        if code == _SUCCESS or (in_progress_ok and code == _IN_PROGRESS):
            return code
        raise NcclFailure(self._describe(name, code, comm))


def _declare(cdll, path: str) -> None:
    missing = []
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            function = getattr(cdll, name)
        except AttributeError:
            if name not in _OPTIONAL:
                missing.append(name)
            continue
        function.restype, function.argtypes = restype, argtypes
    if missing:
        raise NcclFailure(f"{path} lacks {', '.join(missing)}: pyhipa2a needs NCCL >= {_version_text(MIN_VERSION)} "
                          f"(or an RCCL built from it)")


# -- the communicator ------------------------------------------------------------

class NcclComm:
    """An NCCL communicator over the ranks of an mpi4py communicator, in non-blocking mode.

    Collective over `comm`: every rank constructs it, with its device current.
    Every wait after the unique id's broadcast is bounded by `timeout` seconds;
    a step that runs past it aborts the communicator and raises NcclTimeout
    naming the step. Not thread-safe: one thread drives a communicator."""

    def __init__(self, library: NcclLibrary, comm, timeout: float):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if library.version < MIN_VERSION:
            raise NcclFailure(f"{library.path} is NCCL {_version_text(library.version)}; pyhipa2a needs "
                              f">= {_version_text(MIN_VERSION)} (non-blocking communicators)")
        self._lib = library
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self.aborted = False
        self._closed = False
        self._handle = _COMM()
        # Reused by every poll: no allocation on the exchange path.
        self._state = _RESULT()
        self._state_ptr = ctypes.pointer(self._state)
        self._init(self._unique_id(comm))

    def _unique_id(self, comm) -> _UniqueId:
        # Rank 0 sends its failure too, so the other ranks raise instead of waiting for an id that never comes.
        sent = None
        if self.rank == 0:
            uid = _UniqueId()
            try:
                self._lib._call("ncclGetUniqueId", ctypes.pointer(uid))
                sent = (True, ctypes.string_at(ctypes.addressof(uid), _UNIQUE_ID_BYTES))
            except NcclFailure as e:
                sent = (False, str(e))
        ok, payload = comm.bcast(sent, root=0)
        if not ok:
            raise NcclFailure(payload if self.rank == 0 else f"rank 0 could not create the NCCL unique id: {payload}")
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), payload, _UNIQUE_ID_BYTES)
        return uid

    def _init(self, uid: _UniqueId) -> None:
        config = _Config(size=ctypes.sizeof(_Config), magic=_API_MAGIC, version=self._lib.version,
                         blocking=0, cgaClusterSize=_CONFIG_UNDEF_INT)
        code = self._lib._fn.ncclCommInitRankConfig(ctypes.pointer(self._handle), self.size, uid, self.rank,
                                                    ctypes.pointer(config))
        if code not in (_SUCCESS, _IN_PROGRESS):
            message = self._lib._describe("ncclCommInitRankConfig", code, self._handle)
            if self._handle.value:  # a communicator may exist even so: release it
                self.abort()
            raise NcclFailure(message)
        try:
            self._finish("ncclCommInitRankConfig")
        except NcclFailure:
            self.abort()  # the caller gets no object to close (a no-op after a timeout's own abort)
            raise

    # -- waiting for NCCL's threads -----------------------------------------------
    def _async_state(self) -> int:
        self._lib._call("ncclCommGetAsyncError", self._handle, self._state_ptr, comm=self._handle)
        return self._state.value

    def _finish(self, step: str) -> None:
        """Poll until `step` is no longer in progress. Its failure raises NcclFailure; running past the
        timeout aborts the communicator (NCCL takes no other call on it while a step is in progress)
        and raises NcclTimeout."""
        start, attempt = time.monotonic(), 0
        while True:
            state = self._async_state()
            if state == _SUCCESS:
                return
            if state != _IN_PROGRESS:
                raise NcclFailure(self._lib._describe(f"{step} (asynchronously)", state, self._handle))
            waited = time.monotonic() - start
            if waited > self.timeout:
                self.abort()
                raise NcclTimeout(f"{step} on rank {self.rank} of {self.size} was still in progress after "
                                  f"{self.timeout:.1f} s (a rank never arrived or is stuck); the communicator "
                                  f"was aborted")
            sleep_backoff(attempt)
            attempt += 1

    def _ensure_usable(self) -> None:
        if self.aborted:
            raise NcclFailure("the NCCL communicator was aborted")
        if self._closed:
            raise NcclFailure("the NCCL communicator was closed")

    # -- public ---------------------------------------------------------------
    def exchange(self, sends, recvs, stream: int) -> None:
        """One group of sends and receives of bytes on `stream` (a raw cudaStream_t / hipStream_t).

        `sends`, `recvs`: sequences of (peer, device pointer, nbytes); entries of
        0 bytes are skipped. Returns once NCCL has queued the work on the stream;
        nothing waits for the device, so this may run during stream capture."""
        self._ensure_usable()
        # Everything that can refuse the arguments runs before the group opens.
        stream = int(stream)
        sends, recvs = _nonempty(sends, self.size), _nonempty(recvs, self.size)
        if not sends and not recvs:
            return
        lib = self._lib
        lib._call("ncclGroupStart")
        try:
            for peer, ptr, nbytes in sends:
                lib._call("ncclSend", ptr, nbytes, _UINT8, peer, self._handle, stream,
                          comm=self._handle, in_progress_ok=True)
            for peer, ptr, nbytes in recvs:
                lib._call("ncclRecv", ptr, nbytes, _UINT8, peer, self._handle, stream,
                          comm=self._handle, in_progress_ok=True)
        except BaseException:
            # Close the group we opened (groups nest per thread); the error being raised says what went wrong.
            lib._fn.ncclGroupEnd()
            raise
        lib._call("ncclGroupEnd", comm=self._handle, in_progress_ok=True)
        self._finish("ncclGroupEnd")

    def poll(self) -> None:
        """Raise NcclFailure if NCCL reports an asynchronous error on this communicator."""
        self._ensure_usable()
        state = self._async_state()
        if state not in (_SUCCESS, _IN_PROGRESS):
            raise NcclFailure(self._lib._describe("NCCL communicator", state, self._handle))

    def abort(self) -> None:
        """Release the communicator at once, stopping whatever it still runs on the device. Idempotent."""
        if self.aborted or self._closed:
            return
        self.aborted = True
        handle, self._handle = self._handle, _COMM()
        if handle.value:
            self._lib._call("ncclCommAbort", handle)

    def close(self) -> None:
        """Finalize (bounded) and destroy a healthy communicator, abort any other. Idempotent.

        A finalize that fails or times out aborts and raises: resources are released either way."""
        if self.aborted or self._closed:
            return
        try:
            healthy = self._async_state() == _SUCCESS
        except NcclFailure:
            healthy = False
        if not healthy:
            self.abort()
            return
        try:
            self._lib._call("ncclCommFinalize", self._handle, comm=self._handle, in_progress_ok=True)
            self._finish("ncclCommFinalize")
        except NcclFailure:
            self.abort()  # no-op after _finish's own abort on a timeout
            raise
        self._closed = True
        handle, self._handle = self._handle, _COMM()
        self._lib._call("ncclCommDestroy", handle)


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
