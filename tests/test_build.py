"""Ahead-of-time build: AMD code objects carry the memory-ordering instructions the protocol relies on."""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pyhipa2a import build
from pyhipa2a.errors import CodeObjectNotFound
from pyhipa2a.kernels import available_code_objects, select_code_object

DISPATCH = ["a2a_dispatch", "a2a_dispatch_fp8", "a2a_dispatch_quantize_f16", "a2a_dispatch_quantize_bf16"]
COMBINE = ["a2a_combine_f16", "a2a_combine_bf16", "a2a_combine_small_f16", "a2a_combine_small_bf16"]
FLAG_KERNELS = {"heap_check": ["heap_check"],  # (each exchange kernel also as its twin of calls in groups)
                "dispatch": DISPATCH + [name + "_placed" for name in DISPATCH],
                "combine": COMBINE + [name + "_phased" for name in COMBINE]}
WINDOW = 3  # instructions allowed between the cache operation and the flag access


def built_objects(out, suffix: str, **targets) -> Path:
    """Where every kernel source's `suffix` object (e.g. "gfx942.hsaco") is, built from the sources as they are
    now: the package's own (pyhipa2a/_code) where each of them there is newer than every source and the build
    script (the install, `python -m pyhipa2a.build`, just made them), else built into `out` now."""
    sources = sorted(build.SOURCES.glob("*.hip"))
    newest = max(p.stat().st_mtime_ns for p in (*build.SOURCES.iterdir(), Path(build.__file__)))
    installed = [build.DEFAULT_OUT / f"{src.stem}.{suffix}" for src in sources]
    if all(p.exists() and p.stat().st_mtime_ns > newest for p in installed):
        return build.DEFAULT_OUT
    built = build.build(out, variants=("",), log=lambda *_: None, **targets)
    assert {p.name for p in built} >= {p.name for p in installed}
    return out


@pytest.fixture(scope="module")
def gfx942_objects(tmp_path_factory):
    if build.find_clang() is None:
        pytest.skip("no hipcc or clang >= 17 to build gfx942 code objects")
    return built_objects(tmp_path_factory.mktemp("gfx942"), "gfx942.hsaco", amd_archs=("gfx942",), targets=("amd",))


@functools.lru_cache(maxsize=None)
def disassemble(path) -> dict[str, list[str]]:
    """Instructions per function symbol (each code object disassembled once a session: the callers only read)."""
    objdump = build.find_objdump()
    if objdump is None:
        pytest.skip("no llvm-objdump to disassemble the gfx942 code object")
    text = subprocess.run([objdump, "-d", "--triple=amdgcn-amd-amdhsa", "--mcpu=gfx942", str(path)],
                          capture_output=True, text=True, check=True).stdout
    functions, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:", line)
        if m:
            current = functions.setdefault(m.group(1), [])
        elif current is not None and line.startswith("\t"):
            current.append(line.split("//")[0].strip())
    return functions


def is_flag_store(ins: str) -> bool:
    return re.match(r"(flat|global)_store_dword\b", ins) is not None and ins.endswith("sc0 sc1")


def is_flag_load(ins: str) -> bool:
    return re.match(r"(flat|global)_load_dword\b", ins) is not None and ins.endswith("sc0 sc1")


def test_gfx942_is_plain_elf(gfx942_objects):
    for path in gfx942_objects.glob("*.hsaco"):
        head = path.read_bytes()[:64]
        assert head.startswith(b"\x7fELF"), f"{path.name} is not a plain ELF (an offload bundle?)"
        assert b"__CLANG_OFFLOAD_BUNDLE__" not in head


@pytest.mark.parametrize("module", sorted(FLAG_KERNELS))
def test_release_store_and_acquire_load(gfx942_objects, module):
    functions = disassemble(gfx942_objects / f"{module}.gfx942.hsaco")
    for kernel in FLAG_KERNELS[module]:
        body = functions[kernel]
        releases = [i for i, ins in enumerate(body) if is_flag_store(ins)
                    and any(b == "buffer_wbl2 sc0 sc1" for b in body[max(0, i - WINDOW):i])]
        acquires = [i for i, ins in enumerate(body) if is_flag_load(ins)
                    and any(b == "buffer_inv sc0 sc1" for b in body[i + 1:i + 1 + WINDOW])]
        assert releases, f"{kernel}: no system-scope store preceded by buffer_wbl2 sc0 sc1"
        assert acquires, f"{kernel}: no system-scope load followed by buffer_inv sc0 sc1"


def test_pushed_segment_is_one_round_trip(gfx942_objects):
    """Dispatch takes a pushed 16-bit segment (16 tagged words a lane, exchange.h: take_batch) with the
    loads of a try issued before it waits for any. Looking at each word as it was loaded (take_tagged)
    made a try 16 round trips in series, AMD's default path for small calls: that build's longest stretch
    of system-scope 8-byte loads with no wait for loads between was 7 (route counts'); this one's, 14."""
    body = disassemble(gfx942_objects / "dispatch.gfx942.hsaco")["a2a_dispatch"]
    longest = run = 0
    for ins in body:
        if re.match(r"(flat|global)_load_dwordx2\b", ins) and ins.endswith("sc0 sc1"):
            run += 1
            longest = max(longest, run)
        elif re.match(r"s_waitcnt\b.*vmcnt", ins):
            run = 0
    assert longest >= 12, f"a2a_dispatch: at most {longest} system-scope 8-byte loads in flight together"


def test_every_kernel_is_in_its_gfx942_code_object(gfx942_objects):
    from pyhipa2a.kernels import SIGNATURES
    for kernel, (module, _) in SIGNATURES.items():
        assert kernel in disassemble(gfx942_objects / f"{module}.gfx942.hsaco"), f"{kernel} missing from {module}"


def test_gfx90a_builds(tmp_path):
    if build.find_clang() is None:
        pytest.skip("no hipcc or clang >= 17")
    out = built_objects(tmp_path, "gfx90a.hsaco", amd_archs=("gfx90a",), targets=("amd",))
    for path in (out / f"{src.stem}.gfx90a.hsaco" for src in build.SOURCES.glob("*.hip")):
        assert path.read_bytes()[:4] == b"\x7fELF", path


def test_nvidia_fatbin_builds(tmp_path):
    from pyhipa2a.kernels import SIGNATURES
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    out = built_objects(tmp_path, "sm_90.fatbin", targets=("nvidia",))
    for kernel, (module, _) in SIGNATURES.items():  # (its cubin's string table: each name whole, NUL-ended)
        assert b"\0" + kernel.encode() + b"\0" in (out / f"{module}.sm_90.fatbin").read_bytes(), \
            f"{kernel} missing from {module}"


def test_c_helper_builds_and_loads(tmp_path):
    """The limited-API helper (csrc/repeat.c) builds where a C compiler and Python.h are, and loads."""
    import importlib.machinery
    import importlib.util
    import sysconfig
    if (build.find_c_compiler() is None
            or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))):
        pytest.skip("no C compiler or no Python.h")
    built = build.build_host(tmp_path, log=lambda *_: None)
    assert [p.name for p in built] == ["_repeat.abi3.so"]
    loader = importlib.machinery.ExtensionFileLoader("pyhipa2a._repeat", str(built[0]))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("pyhipa2a._repeat", built[0],
                                                                                      loader=loader))
    loader.exec_module(module)
    with pytest.raises(TypeError, match="plan is a tuple"):
        module.run(())


def test_jax_handler_builds_against_jaxlibs_headers(tmp_path):
    """XLA's handler of pyhipa2a.jax (csrc/jax_ffi.cc) builds against the installed jaxlib's headers and
    exports what pyhipa2a.jax loads: the handler, the site registry (sites numbered, retired when their
    object closes), and the site layout it checks."""
    import ctypes
    if build.jaxlib_headers() is None:
        pytest.skip("jaxlib is not installed")
    lines = []
    built = build.build_jax_handler(tmp_path, log=lines.append)
    assert [p.name for p in built] == ["_jax_ffi.so"], lines
    lib = ctypes.CDLL(str(built[0]))
    lib.pyhipa2a_ffi_site_bytes.restype = ctypes.c_uint64
    from pyhipa2a.jax import FfiSite
    assert lib.pyhipa2a_ffi_site_bytes() == ctypes.sizeof(FfiSite)
    places = (ctypes.c_uint64 * len(FfiSite._fields_))()
    lib.pyhipa2a_ffi_site_layout(places)
    assert list(places) == [getattr(FfiSite, name).offset for name, _ in FfiSite._fields_]
    assert lib.pyhipa2a_ffi_launch
    lib.pyhipa2a_ffi_site.restype = ctypes.c_int64
    lib.pyhipa2a_ffi_retire.argtypes = [ctypes.c_int64]
    site = FfiSite(call_bytes=16)
    first, second = (lib.pyhipa2a_ffi_site(ctypes.byref(site)) for _ in range(2))
    assert (first, second) == (1, 2)  # numbered in order, never by address
    site.call_bytes = 129
    assert lib.pyhipa2a_ffi_site(ctypes.byref(site)) == 0  # call arguments past the handler's room
    assert lib.pyhipa2a_ffi_retire(first) == 1 and lib.pyhipa2a_ffi_retire(7) == 0
    # Ranks that are devices of one process: the program names the first rank's site, each names the next
    # rank's (made last to first, as pyhipa2a.jax makes them), and a call runs the one on its GPU.
    lib.pyhipa2a_ffi_site_on.restype = ctypes.c_int64
    lib.pyhipa2a_ffi_site_on.argtypes = [ctypes.c_int64, ctypes.c_int32]
    chain, after = [], 0
    for device in (2, 1, 0):
        site.call_bytes, site.device, site.next = 16, device, after
        after = lib.pyhipa2a_ffi_site(ctypes.byref(site))
        chain.insert(0, after)
    head = chain[0]
    assert [lib.pyhipa2a_ffi_site_on(head, d) for d in (0, 1, 2)] == chain
    assert lib.pyhipa2a_ffi_site_on(head, 5) == -2  # no rank on that GPU: refused, naming the object's GPUs
    assert lib.pyhipa2a_ffi_site_on(99, 0) == 0
    lib.pyhipa2a_ffi_retire(chain[1])
    assert lib.pyhipa2a_ffi_site_on(head, 0) == head and lib.pyhipa2a_ffi_site_on(head, 2) == -1


@pytest.mark.parametrize("why", ["the compiler fails", "free-threaded"])
def test_c_helper_that_cannot_be_built_is_one_line(tmp_path, monkeypatch, why):
    """A compiler that fails on the helper, or a CPython without the limited API, skips it with one line
    (plans then run in Python) rather than failing the install."""
    import sysconfig
    if why == "the compiler fails":
        monkeypatch.setattr(build, "find_c_compiler", lambda: "false")  # (exits 1, as a failing compiler)
        monkeypatch.setattr(build.os.path, "exists", lambda p: True)
        expected = "the compiler failed"
    else:
        config = sysconfig.get_config_var
        monkeypatch.setattr(build.sysconfig, "get_config_var",
                            lambda name: 1 if name == "Py_GIL_DISABLED" else config(name))
        if build.find_c_compiler() is None:
            pytest.skip("no C compiler: the line says that instead")
        expected = "free-threaded"
    lines = []
    assert build.build_host(tmp_path, log=lines.append) == []
    assert len(lines) == 1 and lines[0].startswith("pyhipa2a.build: skipping the C helpers") and expected in lines[0]
    assert not list(tmp_path.glob("*.abi3.so"))


def test_missing_toolchain_is_one_line(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(build.os.path, "exists", lambda p: False)
    assert build.build(tmp_path, log=lines.append) == []
    # AMD, NVIDIA, the C helpers, JAX's handler: one line each
    assert len(lines) == 4 and all(line.startswith("pyhipa2a.build: skipping") for line in lines), lines


def test_code_object_selection(tmp_path):
    for name in ("a2a.gfx942.hsaco", "a2a.gfx90a.hsaco", "a2a.sm_90.fatbin", "a2a.profile.gfx942.hsaco"):
        (tmp_path / name).write_bytes(b"x")
    found = available_code_objects(tmp_path, "a2a")
    assert set(found) == {"gfx942", "gfx90a", "sm_90"}
    assert select_code_object("gfx942", found, "a2a").name == "a2a.gfx942.hsaco"
    assert select_code_object("sm_100", found, "a2a").name == "a2a.sm_90.fatbin"  # PTX runs on newer GPUs
    with pytest.raises(CodeObjectNotFound, match=r"gfx1100.*available: gfx90a, gfx942, sm_90"):
        select_code_object("gfx1100", found, "a2a")
    with pytest.raises(CodeObjectNotFound, match=r"sm_80"):
        select_code_object("sm_80", found, "a2a")
    with pytest.raises(CodeObjectNotFound, match="python -m pyhipa2a.build"):
        select_code_object("gfx942", {}, "a2a")
