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
import time
import types
from pathlib import Path

import numpy as np
import pytest

from pyhipa2a.runtime import nccl
from pyhipa2a.runtime.nccl import NcclComm, NcclFailure, NcclLibrary, NcclTimeout

VERSION = 23203
COMM = 0x5EED
UID = bytes(range(128))
INTERNAL_ERROR, INVALID_ARGUMENT, REMOTE_ERROR, IN_PROGRESS = 3, 4, 6, 7
ERRORS = {0: b"no error", 3: b"internal error", 4: b"invalid argument",
          6: b"remote process exited or there was a network error", 7: b"NCCL operation in progress"}


def _value(arg):
    return arg.value if isinstance(arg, ctypes.c_void_p) else arg


class FakeNccl:
    """Stands in for the CDLL, blocking as the library's communicator is: each step in `stuck` ("init", "group",
    "finalize") waits for a peer that never comes, until ncclCommAbort ends it (NCCL then returns
    ncclInternalError); `results` says what a function returns instead of success; ncclCommGetAsyncError
    reports `async_result`. `handle_after`: seconds the init takes to write the communicator's handle."""

    def __init__(self, stuck=(), async_result=0, last_error=b"the fake's last error", version=VERSION,
                 handle_after=0.0):
        self.stuck, self.async_result, self.version, self.handle_after = set(stuck), async_result, version, handle_after
        self.results = {}  # C function name -> the code it returns instead of its usual one
        self.made_on_failure = True  # a failed init still made a communicator (to abort)
        self.calls = []
        self.group_depth = 0
        self.config = self.uid = None
        self.live = False  # a communicator exists and is neither destroyed nor aborted
        self.aborted = threading.Event()
        if last_error is not None:
            self.ncclGetLastError = lambda comm: last_error

    def _record(self, name, *args):
        self.calls.append((name, *args))
        return self.results.get(name, 0)

    def _step(self, step, name, *args):
        code = self._record(name, *args)
        if step in self.stuck:
            assert self.aborted.wait(10), f"{name} waited and nothing aborted it"
            return INTERNAL_ERROR
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
        if self.results.get("ncclCommInitRankConfig", 0) == 0 or self.made_on_failure:
            if self.handle_after:
                threading.Timer(self.handle_after, lambda: setattr(comm_ptr.contents, "value", COMM)).start()
            else:
                comm_ptr.contents.value = COMM
            self.live = True
        return self._step("init", "ncclCommInitRankConfig")

    def ncclCommGetAsyncError(self, comm, state_ptr):
        assert _value(comm) == COMM and self.live, "polled a communicator that does not exist"
        self.calls.append(("ncclCommGetAsyncError",))
        state_ptr[0] = self.async_result
        return 0

    def ncclGroupStart(self):
        self.group_depth += 1
        return self._record("ncclGroupStart")

    def ncclGroupEnd(self):
        self.group_depth -= 1
        return self._step("group", "ncclGroupEnd")

    def ncclSend(self, ptr, count, datatype, peer, comm, stream):
        assert self.group_depth == 1
        return self._record("ncclSend", ptr, count, datatype, peer, _value(comm), stream)

    def ncclRecv(self, ptr, count, datatype, peer, comm, stream):
        assert self.group_depth == 1
        return self._record("ncclRecv", ptr, count, datatype, peer, _value(comm), stream)

    def ncclCommFinalize(self, comm):
        assert _value(comm) == COMM and self.live
        return self._step("finalize", "ncclCommFinalize")

    def ncclCommDestroy(self, comm):
        assert _value(comm) == COMM and self.live
        self.live = False
        return self._record("ncclCommDestroy", _value(comm))

    def ncclCommAbort(self, comm):
        assert _value(comm) == COMM and self.live, "aborted a handle NCCL never wrote"
        self.live = False
        code = self._record("ncclCommAbort", _value(comm))
        self.aborted.set()
        return code


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


def _watch_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("pyhipa2a NCCL watch")}


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
    called = set(re.findall(r'\b(?:call|_bounded)\(\s*"(nccl\w+)"', source))
    called |= set(re.findall(r"\bfn\.(nccl\w+)", source))
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

def test_config_is_the_initializer_with_blocking_on():
    comm, fake = make_comm()
    # The raw bytes NCCL reads: size_t size, unsigned magic, unsigned version, int blocking, int cgaClusterSize.
    size, magic, version, blocking, cga = struct.unpack("=QIIii", fake.config)
    assert size == len(fake.config) == 24
    assert magic == 0xCAFEBEEF
    assert version == VERSION
    assert blocking == 1  # (a group's launch is one call; the watch bounds the calls that wait)
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


def test_init_is_one_call():
    comm, fake = make_comm()
    assert fake.names() == ["ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig"]
    assert not comm.aborted and fake.live


def test_init_timeout_aborts_from_the_watch_and_names_the_step():
    fake, before = FakeNccl(stuck={"init"}), _watch_threads()
    start = time.monotonic()
    with pytest.raises(NcclTimeout, match="ncclCommInitRankConfig on rank 0 of 1 had not returned after 0.1 s"):
        make_comm(fake, timeout=0.1)
    assert time.monotonic() - start < 2.0
    assert fake.names().count("ncclCommAbort") == 1 and not fake.live
    assert not _watch_threads() - before, "the failed init left its watch thread running"


def test_an_init_is_aborted_only_once_nccl_has_written_its_handle():
    """An abort without the handle would end nothing (and the init, returning later, would leak its
    communicator): the watch waits for NCCL to write it."""
    fake = FakeNccl(stuck={"init"}, handle_after=0.3)
    start = time.monotonic()
    with pytest.raises(NcclTimeout, match="ncclCommInitRankConfig"):
        make_comm(fake, timeout=0.05)
    assert time.monotonic() - start >= 0.3
    assert fake.calls[-1] == ("ncclCommAbort", COMM)


def test_init_failure_aborts_the_communicator_it_made_and_carries_nccl_strings():
    fake, before = FakeNccl(), _watch_threads()
    fake.results["ncclCommInitRankConfig"] = REMOTE_ERROR
    with pytest.raises(NcclFailure, match="remote process exited.*ncclResult_t 6.*the fake's last error"):
        make_comm(fake)
    assert "ncclCommAbort" in fake.names() and not fake.live
    assert not _watch_threads() - before


def test_init_refused_outright_raises_without_a_communicator():
    fake = FakeNccl(last_error=None)  # a library without ncclGetLastError: NCCL's string alone
    fake.results["ncclCommInitRankConfig"] = INVALID_ARGUMENT
    fake.made_on_failure = False
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
    comm, fake = make_comm(size=4)
    fake.calls.clear()
    comm.exchange(sends=[(1, 0x1000, 64), (2, 0x2000, 0), (3, 0x2800, 8)],
                  recvs=[(2, 0x3000, 32), (1, 0x4000, 0)], stream=0xABC)
    assert fake.calls == [
        ("ncclGroupStart",),
        ("ncclSend", 0x1000, 64, 1, 1, COMM, 0xABC),   # ncclUint8: count is bytes
        ("ncclSend", 0x2800, 8, 1, 3, COMM, 0xABC),
        ("ncclRecv", 0x3000, 32, 1, 2, COMM, 0xABC),
        ("ncclGroupEnd",),
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


def test_exchange_failure_raises_nccl_strings_and_close_aborts():
    comm, fake = make_comm(size=2)
    fake.results["ncclGroupEnd"] = fake.async_result = REMOTE_ERROR
    with pytest.raises(NcclFailure, match=r"ncclGroupEnd failed: remote process exited.*the fake's last error"):
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    with pytest.raises(NcclFailure, match="remote process exited"):
        comm.poll()
    comm.close()
    assert fake.names()[-1] == "ncclCommAbort" and "ncclCommFinalize" not in fake.names()


def test_exchange_timeout_aborts():
    before = _watch_threads()
    comm, fake = make_comm(FakeNccl(stuck={"group"}), size=2, timeout=0.05)
    with pytest.raises(NcclTimeout, match="ncclGroupEnd on rank 0 of 2 .* aborted"):
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    assert comm.aborted and fake.group_depth == 0
    with pytest.raises(NcclFailure, match="aborted"):
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    comm.close()
    assert fake.names()[-1] == "ncclCommAbort" and not fake.live
    assert not _watch_threads() - before


def test_an_idle_communicator_is_left_alone():
    """A call that returned is no longer watched: a healthy communicator idle for several timeouts stays."""
    comm, fake = make_comm(size=2, timeout=0.05)
    comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    time.sleep(0.3)
    assert not comm.aborted and "ncclCommAbort" not in fake.names()
    comm.close()


def test_an_abort_from_another_thread_ends_a_waiting_call_as_a_failure_not_a_timeout():
    comm, fake = make_comm(FakeNccl(stuck={"group"}), size=2, timeout=30.0)
    threading.Timer(0.1, comm.abort).start()
    with pytest.raises(NcclFailure, match="ncclGroupEnd failed: internal error") as raised:
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    assert not isinstance(raised.value, NcclTimeout) and comm.aborted
    comm.close()
    assert fake.names().count("ncclCommAbort") == 1


def test_an_interrupted_init_leaves_no_watch_thread():
    class Interrupted(FakeNccl):
        def ncclCommInitRankConfig(self, *args):
            raise KeyboardInterrupt
    before = _watch_threads()
    with pytest.raises(KeyboardInterrupt):
        make_comm(Interrupted())
    assert not _watch_threads() - before


def test_a_communicator_never_closed_is_collected_with_its_watch_thread():
    import gc
    before = _watch_threads()
    comm, _ = make_comm(timeout=0.04)
    assert len(_watch_threads() - before) == 1
    del comm
    gc.collect()
    deadline = time.monotonic() + 2.0
    while _watch_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _watch_threads() - before


def test_calls_within_the_timeout_are_left_alone():
    """The watch aborts only a call past its deadline: many quick calls spanning several timeouts pass."""
    comm, fake = make_comm(size=2, timeout=0.05)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        comm.exchange(sends=[(1, 0x1000, 8)], recvs=[], stream=0)
    assert not comm.aborted and "ncclCommAbort" not in fake.names()
    comm.close()


# -- poll, abort, close ------------------------------------------------------------

def test_poll_is_quiet_while_healthy_or_in_progress():
    comm, fake = make_comm()
    comm.poll()
    fake.async_result = IN_PROGRESS
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
    before = _watch_threads()
    comm, fake = make_comm()
    fake.calls.clear()
    comm.close()
    assert fake.names() == ["ncclCommGetAsyncError", "ncclCommFinalize", "ncclCommDestroy"]
    assert not _watch_threads() - before
    comm.close()
    comm.abort()
    assert fake.names()[-1] == "ncclCommDestroy" and not comm.aborted
    with pytest.raises(NcclFailure, match="closed"):
        comm.exchange([(0, 0x1000, 8)], [], 0)


def test_close_whose_finalize_times_out_aborts_and_raises():
    before = _watch_threads()
    comm, fake = make_comm(FakeNccl(stuck={"finalize"}), timeout=0.05)
    with pytest.raises(NcclTimeout, match="ncclCommFinalize"):
        comm.close()
    assert not _watch_threads() - before
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
