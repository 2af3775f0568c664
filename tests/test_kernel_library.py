"""KernelLibrary shares loaded modules per device context (no GPU needed: a recording backend)."""
from __future__ import annotations

import os

from pyhipa2a.kernels import KernelLibrary


class RecordingBackend:
    code_suffix = ".fatbin"

    def __init__(self, owner):
        self.owner, self.loads, self.unloads = owner, [], []

    def module_owner(self):
        return self.owner

    def module_load(self, image: bytes):
        self.loads.append(image)
        return f"module{len(self.loads)}"

    def module_unload(self, module) -> None:
        self.unloads.append(module)

    def module_function(self, module, name: str):
        return (module, name)


def code_dir(tmp_path, content=b"image-1"):
    (tmp_path / "combine.sm_90.fatbin").write_bytes(content)
    return tmp_path


def test_libraries_of_one_context_share_modules_and_never_unload_them(tmp_path):
    backend = RecordingBackend(owner=("cuda", 1234))
    first = KernelLibrary(backend, "sm_90", code_dir(tmp_path))
    f1 = first.kernel("a2a_combine_f16").function
    first.close()
    second = KernelLibrary(backend, "sm_90", tmp_path)
    f2 = second.kernel("a2a_combine_small_f16").function
    second.close()
    assert backend.loads == [b"image-1"] and backend.unloads == []
    assert f1[0] == f2[0] == "module1"
    other = RecordingBackend(owner=("cuda", 5678))  # another context loads its own
    KernelLibrary(other, "sm_90", tmp_path).kernel("a2a_combine_f16")
    assert other.loads == [b"image-1"]


def test_a_rebuilt_code_object_is_loaded_again(tmp_path):
    backend = RecordingBackend(owner=("cuda", 99))
    KernelLibrary(backend, "sm_90", code_dir(tmp_path)).kernel("a2a_combine_f16")
    path = tmp_path / "combine.sm_90.fatbin"
    path.write_bytes(b"image-2, longer")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    KernelLibrary(backend, "sm_90", tmp_path).kernel("a2a_combine_f16")
    assert backend.loads == [b"image-1", b"image-2, longer"]


def test_without_an_owner_each_library_loads_and_unloads_its_own(tmp_path):
    backend = RecordingBackend(owner=None)
    for _ in range(2):
        lib = KernelLibrary(backend, "sm_90", code_dir(tmp_path))
        lib.kernel("a2a_combine_f16")
        lib.close()
    assert backend.loads == [b"image-1", b"image-1"] and backend.unloads == ["module1", "module2"]
