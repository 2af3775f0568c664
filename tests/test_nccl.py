"""The NCCL/RCCL communicator layer (pyhipa2a.runtime.nccl).

Most tests run against a fake library: Python functions under NCCL's names,
taking the arguments the C functions take (out-parameters are ctypes
pointers), so the communicator's logic is checked where no NCCL is installed.
Where the real library is found, it is loaded and asked for its version and
error strings; with a GPU, a one-rank communicator sends bytes to itself.
"""
import ctypes
import os
import re
import struct
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from pyhipa2a import bootstrap
from pyhipa2a.runtime import nccl
from pyhipa2a.runtime.nccl import NcclComm, NcclFailure, NcclLibrary, NcclTimeout

VERSION = 23203
COMM = 0x5EED
UID = bytes(range(128))
IN_PROGRESS, INVALID_ARGUMENT, REMOTE_ERROR = 7, 4, 6
ERRORS = {0: b"no error", 4: b"invalid argument", 6: b"remote process exited or there was a network error",
          7: b"NCCL operation in progress"}
FOREVER = float("inf")


def _value(arg):
    return arg.value if isinstance(arg, ctypes.c_void_p) else arg


class FakeNccl:
    """Stands in for the CDLL. `polls` says how many ncclCommGetAsyncError calls each asynchronous step
    (init, group, finalize) stays in progress; after that the communicator reports `async_result`."""

    def __init__(self, polls=None, async_result=0, last_error=b"the fake's last error", version=VERSION):
        self.polls = {"init": 2, "group": 1, "finalize": 1, **(polls or {})}
        self.async_result, self.version = async_result, version
        self.results = {}  # C function name -> the code it returns instead of its usual one
        self.calls = []
        self.pending = 0
        self.group_depth = 0
        self.config = self.uid = None
        self.live = False  # a communicator exists and is neither destroyed nor aborted
        if last_error is not None:
            self.ncclGetLastError = lambda comm: last_error

    def _record(self, name, *args):
        self.calls.append((name, *args))
        return self.results.get(name, 0)

    def _start(self, step, name):
        code = self._record(name)
        if code == 0:
            self.pending = self.polls[step]
            return IN_PROGRESS
        return code

    def names(self):
        return [call[0] for call in self.calls]

    # -- the C functions -------------------------------------------------------
    def ncclGetVersion(self, version_ptr):
        version_ptr[0] = self.version
        return self._record("ncclGetVersion")

    def ncclGetErrorString(self, code):
        return ERRORS.get(code, b"unknown result code")

    def ncclGetUniqueId(self, uid_ptr):
        ctypes.memmove(ctypes.addressof(uid_ptr.contents), UID, len(UID))
        return self._record("ncclGetUniqueId")

    def ncclCommInitRankConfig(self, comm_ptr, nranks, uid, rank, config_ptr):
        size = config_ptr.contents.size
        self.config = ctypes.string_at(ctypes.addressof(config_ptr.contents), size)
        self.uid = ctypes.string_at(ctypes.addressof(uid), 128)
        self.init_args = (nranks, rank)
        code = self._start("init", "ncclCommInitRankConfig")
        if code in (0, IN_PROGRESS):
            comm_ptr.contents.value = COMM
            self.live = True
        return code

    def ncclCommGetAsyncError(self, comm, state_ptr):
        assert _value(comm) == COMM and self.live, "polled a communicator that does not exist"
        self.calls.append(("ncclCommGetAsyncError",))
        if self.pending > 0:
            self.pending -= 1
            state_ptr[0] = IN_PROGRESS
        else:
            state_ptr[0] = self.async_result
        return 0

    def ncclGroupStart(self):
        self.group_depth += 1
        return self._record("ncclGroupStart")

    def ncclGroupEnd(self):
        self.group_depth -= 1
        return self._start("group", "ncclGroupEnd")

    def ncclSend(self, ptr, count, datatype, peer, comm, stream):
        assert self.group_depth == 1
        return self._record("ncclSend", ptr, count, datatype, peer, _value(comm), stream)

    def ncclRecv(self, ptr, count, datatype, peer, comm, stream):
        assert self.group_depth == 1
        return self._record("ncclRecv", ptr, count, datatype, peer, _value(comm), stream)

    def ncclCommFinalize(self, comm):
        assert _value(comm) == COMM and self.live
        return self._start("finalize", "ncclCommFinalize")

    def ncclCommDestroy(self, comm):
        assert _value(comm) == COMM and self.live
        self.live = False
        return self._record("ncclCommDestroy", _value(comm))

    def ncclCommAbort(self, comm):
        assert _value(comm) == COMM and self.live
        self.live = False
        return self._record("ncclCommAbort", _value(comm))


class FakeMpiComm:
    """bcast, Get_rank and Get_size of an mpi4py communicator; rank 0's broadcast is what `from_root` says."""

    def __init__(self, rank=0, size=1, from_root=None):
        self.rank, self.size, self.from_root = rank, size, from_root
        self.sent = []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        assert root == 0
        self.sent.append(obj)
        return obj if self.rank == 0 else self.from_root


def make_comm(fake=None, rank=0, size=1, from_root=None, timeout=5.0):
    fake = fake or FakeNccl()
    library = NcclLibrary("<fake>", _functions=fake)
    return NcclComm(library, FakeMpiComm(rank, size, from_root), timeout=timeout), fake


# -- the library ---------------------------------------------------------------

def test_library_reports_version_and_error_strings():
    library = NcclLibrary("<fake>", _functions=FakeNccl())
    assert library.version == VERSION
    assert library.error_string(INVALID_ARGUMENT) == "invalid argument"


def test_every_function_called_has_a_declared_signature():
    # The fake takes any arguments; only the real CDLL converts them through argtypes, so a
    # function called without a signature would first misbehave on a machine with NCCL.
    source = Path(nccl.__file__).read_text()
    called = set(re.findall(r'\bcall\(\s*"(nccl\w+)"', source)) | set(re.findall(r"\bfn\.(nccl\w+)", source))
    assert called == set(nccl._SIGNATURES), called ^ set(nccl._SIGNATURES)


def test_a_library_without_the_2_14_functions_is_refused():
    old = types.SimpleNamespace(**{name: (lambda *a: 0) for name in nccl._SIGNATURES
                                   if name not in ("ncclCommInitRankConfig", "ncclCommFinalize", "ncclGetLastError")})
    with pytest.raises(NcclFailure, match=r"lacks ncclCommInitRankConfig, ncclCommFinalize.*2\.14\.0"):
        nccl._declare(old, "/old/libnccl.so")


def test_an_unloadable_file_raises_naming_it(tmp_path):
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_text("not a library")
    with pytest.raises(NcclFailure, match="cannot load the NCCL library .*libnccl.so.2"):
        NcclLibrary(str(bogus))


# -- initialization ------------------------------------------------------------

def test_config_is_the_initializer_with_blocking_off():
    comm, fake = make_comm()
    # The raw bytes NCCL reads: size_t size, unsigned magic, unsigned version, int blocking, int cgaClusterSize.
    size, magic, version, blocking, cga = struct.unpack("=QIIii", fake.config)
    assert size == len(fake.config) == 24
    assert magic == 0xCAFEBEEF
    assert version == VERSION
    assert blocking == 0
    assert cga == -(2**31)  # NCCL_CONFIG_UNDEF_INT: NCCL's default
    assert (comm.rank, comm.size) == (0, 1)


def _installed_header() -> Path | None:
    for lib in nccl._wheel_candidates():
        header = lib.parent.parent / "include" / "nccl.h"
        if header.is_file():
            return header
    return None


def test_constants_and_config_layout_match_the_installed_nccl_h():
    header = _installed_header()
    if header is None:
        pytest.skip("no nvidia-nccl wheel installed, so no nccl.h to compare with")
    text = header.read_text()
    body = re.search(r"typedef struct ncclConfig_v\d+ \{(.*?)\} ncclConfig_t;", text, re.DOTALL).group(1)
    fields = re.findall(r"^\s*[\w ]+?[\s*]+(\w+);", re.sub(r"/\*.*?\*/", "", body, flags=re.DOTALL), re.MULTILINE)
    assert fields[:5] == [name for name, _ in nccl._Config._fields_]
    assert "#define NCCL_CONFIG_UNDEF_INT INT_MIN" in text
    assert hex(nccl._API_MAGIC) in text.lower()  # NCCL_API_MAGIC since 2.29, inline before
    assert f"#define NCCL_UNIQUE_ID_BYTES {nccl._UNIQUE_ID_BYTES}" in text
    assert re.search(rf"ncclInProgress\s*=\s*{nccl._IN_PROGRESS},", text)
    assert re.search(rf"ncclUint8\s*=\s*{nccl._UINT8},", text)


def test_rank_0_creates_and_broadcasts_the_unique_id():
    mpi = FakeMpiComm(rank=0, size=2)
    fake = FakeNccl()
    NcclComm(NcclLibrary("<fake>", _functions=fake), mpi, timeout=5.0)
    assert mpi.sent == [(True, UID)]
    assert fake.uid == UID and fake.init_args == (2, 0)


def test_other_ranks_take_the_broadcast_id():
    other = bytes(reversed(UID))
    _, fake = make_comm(rank=1, size=2, from_root=(True, other))
    assert "ncclGetUniqueId" not in fake.names()
    assert fake.uid == other and fake.init_args == (2, 1)


def test_a_failed_unique_id_is_broadcast_so_no_rank_waits_for_it():
    fake = FakeNccl()
    fake.results["ncclGetUniqueId"] = INVALID_ARGUMENT
    mpi = FakeMpiComm(rank=0, size=2)
    with pytest.raises(NcclFailure, match="ncclGetUniqueId failed: invalid argument") as raised:
        NcclComm(NcclLibrary("<fake>", _functions=fake), mpi, timeout=5.0)
    assert mpi.sent == [(False, str(raised.value))]
    with pytest.raises(NcclFailure, match="rank 0 could not create the NCCL unique id: ncclGetUniqueId failed"):
        make_comm(rank=1, size=2, from_root=(False, str(raised.value)))


def test_init_polls_while_in_progress_then_succeeds():
    comm, fake = make_comm(FakeNccl(polls={"init": 3}))
    assert fake.names() == ["ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig"] + ["ncclCommGetAsyncError"] * 4
    assert not comm.aborted and fake.live


def test_polls_back_off_as_every_host_wait_does(monkeypatch):
    """NCCL's steps in progress are polled with bootstrap.poll (its backoff yields first, then sleeps), as
    every host-side wait is, not by a loop of their own."""
    attempts = []
    monkeypatch.setattr(bootstrap, "sleep_backoff", attempts.append)
    make_comm(FakeNccl(polls={"init": 3}))
    assert attempts == [0, 1, 2]


def test_init_timeout_aborts_and_names_the_step():
    fake = FakeNccl(polls={"init": FOREVER})
    with pytest.raises(NcclTimeout, match="ncclCommInitRankConfig on rank 0 of 1 was still in progress after"):
        make_comm(fake, timeout=0.05)
    assert fake.names()[-1] == "ncclCommAbort" and not fake.live


def test_init_async_error_aborts_and_carries_nccl_strings():
    fake = FakeNccl(async_result=REMOTE_ERROR)
    with pytest.raises(NcclFailure, match="remote process exited.*ncclResult_t 6.*the fake's last error"):
        make_comm(fake)
    assert "ncclCommAbort" in fake.names() and not fake.live


def test_init_refused_outright_raises_without_a_communicator():
    fake = FakeNccl(last_error=None)  # a library without ncclGetLastError: NCCL's string alone
    fake.results["ncclCommInitRankConfig"] = INVALID_ARGUMENT
    with pytest.raises(NcclFailure, match=r"ncclCommInitRankConfig failed: invalid argument \(ncclResult_t 4\)$"):
        make_comm(fake)
    assert "ncclCommAbort" not in fake.names()


def test_a_library_older_than_2_14_is_refused():
    with pytest.raises(NcclFailure, match=r"NCCL 2\.13\.4; pyhipa2a needs >= 2\.14\.0"):
        make_comm(FakeNccl(version=21304))


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        make_comm(timeout=0)


# -- exchange --------------------------------------------------------------------

def test_exchange_is_one_group_of_byte_sends_and_receives_skipping_empty_ones():
    comm, fake = make_comm(FakeNccl(polls={"group": 2}), size=4)
    fake.calls.clear()
    comm.exchange(sends=[(1, 0x1000, 64), (2, 0x2000, 0), (3, 0x2800, 8)],
                  recvs=[(2, 0x3000, 32), (1, 0x4000, 0)], stream=0xABC)
    assert fake.calls == [
        ("ncclGroupStart",),
        ("ncclSend", 0x1000, 64, 1, 1, COMM, 0xABC),   # ncclUint8: count is bytes
        ("ncclSend", 0x2800, 8, 1, 3, COMM, 0xABC),
        ("ncclRecv", 0x3000, 32, 1, 2, COMM, 0xABC),
        ("ncclGroupEnd",),
        ("ncclCommGetAsyncError",), ("ncclCommGetAsyncError",), ("ncclCommGetAsyncError",),
    ]
    assert fake.group_depth == 0


def test_exchange_with_nothing_to_move_calls_nothing():
    comm, fake = make_comm(size=2)
    fake.calls.clear()
    comm.exchange(sends=[(1, 0x1000, 0)], recvs=[], stream=0)
    assert fake.calls == []


def test_exchange_refuses_bad_entries_before_opening_a_group():
    comm, fake = make_comm(size=2)
    fake.calls.clear()
    with pytest.raises(ValueError, match="peer 2 is not a rank of this 2-rank"):
        comm.exchange(sends=[(0, 0x1000, 8)], recvs=[(2, 0x2000, 8)], stream=0)
    with pytest.raises(ValueError, match="negative byte count"):
        comm.exchange(sends=[(1, 0x1000, -1)], recvs=[], stream=0)
    assert fake.calls == []


def test_a_refused_send_still_closes_the_group():
    comm, fake = make_comm(size=2)
    fake.results["ncclSend"] = INVALID_ARGUMENT
    with pytest.raises(NcclFailure, match="ncclSend failed: invalid argument.*the fake's last error"):
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[(1, 0x2000, 8)], stream=0)
    assert fake.group_depth == 0 and fake.names()[-1] == "ncclGroupEnd"


def test_exchange_async_error_raises_nccl_strings_and_close_aborts():
    comm, fake = make_comm(size=2)
    fake.async_result = REMOTE_ERROR
    with pytest.raises(NcclFailure, match=r"ncclGroupEnd \(asynchronously\) failed: remote process exited"):
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    with pytest.raises(NcclFailure, match="remote process exited"):
        comm.poll()
    comm.close()
    assert fake.names()[-1] == "ncclCommAbort" and "ncclCommFinalize" not in fake.names()


def test_exchange_timeout_aborts():
    comm, fake = make_comm(FakeNccl(polls={"group": FOREVER}), size=2, timeout=0.05)
    with pytest.raises(NcclTimeout, match="ncclGroupEnd on rank 0 of 2 .* aborted"):
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    assert comm.aborted
    with pytest.raises(NcclFailure, match="aborted"):
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    comm.close()
    assert fake.names()[-1] == "ncclCommAbort" and not fake.live


# -- poll, abort, close ------------------------------------------------------------

def test_poll_is_quiet_while_healthy_or_in_progress():
    comm, fake = make_comm()
    comm.poll()
    fake.pending = 1
    comm.poll()


def test_abort_is_idempotent_and_ends_the_communicator():
    comm, fake = make_comm(size=2)
    comm.abort()
    comm.abort()
    assert comm.aborted
    for call in (lambda: comm.exchange([(1, 0x1000, 8)], [], 0), comm.poll):
        with pytest.raises(NcclFailure, match="aborted"):
            call()
    comm.close()
    comm.close()
    assert fake.names().count("ncclCommAbort") == 1 and fake.names()[-1] == "ncclCommAbort"


class StuckDevice(FakeNccl):
    """ncclCommAbort frees device memory, which waits for the whole device: here, until `drained` is set."""

    def __init__(self, abort_result=0, **kwargs):
        super().__init__(**kwargs)
        self.began, self.drained, self.abort_result = threading.Event(), threading.Event(), abort_result

    def ncclCommAbort(self, comm):
        super().ncclCommAbort(comm)
        self.began.set()
        self.drained.wait()
        return self.abort_result


def test_abort_returns_while_the_device_is_stuck_and_close_waits_for_it():
    """A stream stuck elsewhere on the device (the caller's) must not hang the call that reports a timeout:
    abort() returns at once; close() waits for NCCL's release, and raises what it reported."""
    fake = StuckDevice(abort_result=INVALID_ARGUMENT)
    comm, _ = make_comm(fake, size=2, timeout=5.0)
    drains = threading.Timer(1.0, fake.drained.set)  # (the device drains in a second)
    drains.start()
    try:
        comm.abort()
        assert not fake.drained.is_set(), "abort() waited for the device"
        assert comm.aborted and fake.began.wait(5.0)
        with pytest.raises(NcclFailure, match="ncclCommAbort failed: invalid argument"):
            comm.close()
    finally:
        fake.drained.set()
    comm.close()
    assert fake.names().count("ncclCommAbort") == 1


def test_close_leaves_an_abort_the_device_never_lets_finish_with_a_warning():
    fake = StuckDevice()
    comm, _ = make_comm(fake, size=2, timeout=0.05)
    try:
        comm.abort()
        with pytest.warns(RuntimeWarning, match="NCCL's abort on rank 0 still waits for the device after 0.1 s"):
            comm.close()
    finally:
        fake.drained.set()


def test_close_finalizes_then_destroys_once():
    comm, fake = make_comm(FakeNccl(polls={"finalize": 2}))
    fake.calls.clear()
    comm.close()
    assert fake.names() == ["ncclCommGetAsyncError", "ncclCommFinalize"] + ["ncclCommGetAsyncError"] * 3 + [
        "ncclCommDestroy"]
    comm.close()
    comm.abort()
    assert fake.names()[-1] == "ncclCommDestroy" and not comm.aborted
    with pytest.raises(NcclFailure, match="closed"):
        comm.exchange([(0, 0x1000, 8)], [], 0)


def test_close_whose_finalize_times_out_aborts_and_raises():
    comm, fake = make_comm(FakeNccl(polls={"finalize": FOREVER}), timeout=0.05)
    with pytest.raises(NcclTimeout, match="ncclCommFinalize"):
        comm.close()
    assert comm.aborted and fake.names()[-1] == "ncclCommAbort" and "ncclCommDestroy" not in fake.names()
    comm.close()
    assert fake.names()[-1] == "ncclCommAbort"


def test_close_whose_finalize_is_refused_aborts_and_raises():
    comm, fake = make_comm()
    fake.results["ncclCommFinalize"] = INVALID_ARGUMENT
    with pytest.raises(NcclFailure, match="ncclCommFinalize failed: invalid argument"):
        comm.close()
    assert comm.aborted and not fake.live


# -- finding the library ---------------------------------------------------------

@pytest.fixture
def nothing_installed(monkeypatch):
    monkeypatch.delenv(nccl.LIBRARY_VARIABLE, raising=False)
    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(nccl, "_wheel_candidates", list)
    monkeypatch.setattr(nccl, "_rocm_candidates", list)
    monkeypatch.setattr(nccl.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(nccl, "_loader_finds", lambda soname: False)


def test_variable_naming_a_missing_file_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(nccl.LIBRARY_VARIABLE, str(tmp_path / "nope.so"))
    with pytest.raises(NcclFailure, match=f"{nccl.LIBRARY_VARIABLE}=.*nope.so.* names no file"):
        nccl.find_library("cuda")


def test_variable_naming_a_file_wins(monkeypatch, tmp_path):
    library = tmp_path / "libnccl.so.2"
    library.write_bytes(b"")
    monkeypatch.setenv(nccl.LIBRARY_VARIABLE, str(library))
    assert nccl.find_library("cuda") == str(library)
    assert nccl.find_library("hip") == str(library)


def test_nothing_found_says_what_to_install(nothing_installed):
    with pytest.raises(NcclFailure) as raised:
        nccl.find_library("cuda")
    assert "pip install nvidia-nccl-cu13" in str(raised.value)
    assert nccl.LIBRARY_VARIABLE in str(raised.value)
    with pytest.raises(NcclFailure, match=f"no RCCL library found .*{nccl.LIBRARY_VARIABLE}"):
        nccl.find_library("hip")


def test_wheel_library_comes_before_the_system_one(nothing_installed, monkeypatch, tmp_path):
    wheel = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"")
    monkeypatch.setattr(nccl, "_wheel_candidates", lambda: [tmp_path / "missing.so", wheel])
    monkeypatch.setattr(nccl.ctypes.util, "find_library", lambda name: "libnccl.so.2")
    assert nccl.find_library("cuda") == str(wheel)


def test_system_library_found_by_the_loader(nothing_installed, monkeypatch):
    monkeypatch.setattr(nccl.ctypes.util, "find_library", lambda name: f"lib{name}.so.2")
    assert nccl.find_library("cuda") == "libnccl.so.2"
    assert nccl.find_library("hip") == "librccl.so.2"


def test_rocm_path_is_searched_first(monkeypatch, tmp_path):
    library = tmp_path / "lib" / "librccl.so.1"
    library.parent.mkdir()
    library.write_bytes(b"")
    monkeypatch.delenv(nccl.LIBRARY_VARIABLE, raising=False)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    assert nccl.find_library("hip") == str(library)


def test_wheel_candidates_point_into_the_nvidia_namespace():
    for path in nccl._wheel_candidates():
        assert path.parts[-4:] == ("nvidia", "nccl", "lib", "libnccl.so.2")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="'cuda' \\(NCCL\\) or 'hip' \\(RCCL\\)"):
        nccl.find_library("host")


# -- the real library --------------------------------------------------------------

@pytest.fixture(scope="module")
def real_library():
    kind = "hip" if os.path.exists("/dev/kfd") else "cuda"
    try:
        return NcclLibrary(nccl.find_library(kind))
    except NcclFailure as e:
        pytest.skip(f"no loadable NCCL/RCCL here: {e}")


def test_real_library_loads_and_speaks(real_library):
    assert real_library.version >= nccl.MIN_VERSION
    text = real_library.error_string(1)
    assert isinstance(text, str) and text and text != "ncclResult_t 1"
    assert "progress" in real_library.error_string(IN_PROGRESS).lower()


@pytest.fixture
def device():
    """(backend, stream) on device 0, with NCCL's library; everything made is released after the test."""
    from pyhipa2a.runtime import get_backend
    backend = get_backend()
    backend.open_device(0)
    stream = backend.stream_create()
    allocations = []
    yield backend, stream, allocations
    for ptr in allocations:
        backend.free(ptr)
    backend.stream_destroy(stream)
    backend.close()


def _self_comm(backend) -> NcclComm:
    from mpi4py import MPI
    return NcclComm(NcclLibrary(nccl.find_library(backend.kind)), MPI.COMM_SELF, timeout=60.0)


def _round_trip(backend, stream, allocations, nbytes, run):
    """Fill a source buffer with fresh bytes, zero the destination, `run()`, and check the bytes arrived."""
    if not allocations:
        allocations += [backend.malloc_ipc(nbytes), backend.malloc_ipc(nbytes)]
    src, dst = allocations
    data = np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8)
    backend.copy_to_device(src, data, stream)
    backend.memset(dst, 0, nbytes, stream)
    run(src, dst)
    backend.stream_synchronize(stream)
    out = np.empty(nbytes, np.uint8)
    backend.copy_to_host(out, dst, stream)
    np.testing.assert_array_equal(out, data)


@pytest.mark.gpu
def test_gpu_send_to_self(device):
    backend, stream, allocations = device
    comm = _self_comm(backend)
    try:
        handle = backend.stream_handle(stream)
        _round_trip(backend, stream, allocations, 5000,
                    lambda src, dst: comm.exchange([(0, src, 5000)], [(0, dst, 5000)], handle))
        comm.poll()
    finally:
        comm.close()
    assert not comm.aborted


@pytest.mark.gpu
def test_gpu_send_to_self_inside_a_captured_graph(device):
    backend, stream, allocations = device
    comm = _self_comm(backend)
    handle = backend.stream_handle(stream)
    nbytes = 4096
    try:
        # Connections are set up by the first exchange; capture the steady state.
        _round_trip(backend, stream, allocations, nbytes,
                    lambda src, dst: comm.exchange([(0, src, nbytes)], [(0, dst, nbytes)], handle))
        src, dst = allocations
        backend.capture_begin(stream)
        try:
            comm.exchange([(0, src, nbytes)], [(0, dst, nbytes)], handle)
        finally:
            graph = backend.capture_end(stream)
        try:
            for _ in range(2):  # each replay moves the bytes the buffers hold then
                _round_trip(backend, stream, allocations, nbytes, lambda *_: backend.graph_launch(graph, stream))
        finally:
            backend.graph_destroy(graph)
    finally:
        comm.close()
