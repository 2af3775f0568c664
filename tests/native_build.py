"""Builds a tests/native/*.cpp program against kernels_hip/portability.h with the host's C++ compiler
(A2A_HOST_EMULATION: the header's shared part, the same text the kernels compile)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.mpi_harness import REPO


def compiler() -> str | None:
    return next(filter(None, map(shutil.which, ("c++", "g++", "clang++", "clang++-19"))), None)


def build_native(out_dir: Path, name: str) -> Path:
    """tests/native/<name>.cpp built into out_dir; skips the test where the host has no C++ compiler."""
    cxx = compiler()
    if cxx is None:
        pytest.skip("no C++ compiler for the host")
    exe = out_dir / name
    subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-DA2A_HOST_EMULATION", f"-I{REPO / 'kernels_hip'}",
                    "-o", str(exe), str(REPO / "tests" / "native" / f"{name}.cpp")], check=True)
    return exe
