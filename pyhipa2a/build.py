"""Build the device code ahead of time: `python -m pyhipa2a.build`.

Every `kernels_hip/*.hip` file becomes one code object per target:
  <name>.<gfx>.hsaco    for AMD (gfx942, gfx90a), by hipcc or clang >= 17
  <name>.sm_90.fatbin   for NVIDIA (sm_90 machine code + compute_90 PTX), by nvcc
A toolchain that is absent is skipped with one line saying so. Variants (e.g.
the profiling build) add `-D` defines and a suffix to the name.

Standard library only: `pip install` runs this before numpy may be importable.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "kernels_hip"
DEFAULT_OUT = Path(__file__).resolve().parent / "_code"
AMD_ARCHS = ("gfx942", "gfx90a")
CUDA_ARCHS = ("90",)
# name suffix -> extra compiler defines
VARIANTS = {"": (), ".profile": ("-DA2A_PROFILE=1",)}
MIN_CLANG = 17


def find_clang() -> str | None:
    """hipcc first (ROCm), else the newest clang++ that knows --offload-arch."""
    hipcc = shutil.which("hipcc")
    if hipcc:
        return hipcc
    candidates = [shutil.which(f"clang++-{v}") for v in range(25, MIN_CLANG - 1, -1)]
    candidates += sorted(glob.glob("/usr/lib/llvm-*/bin/clang++"), reverse=True)
    candidates += ["/opt/rocm/llvm/bin/clang++", shutil.which("clang++")]
    for path in candidates:
        if path and os.path.exists(path) and clang_major(path) >= MIN_CLANG:
            return path
    return None


def find_objdump() -> str | None:
    """The llvm-objdump that ships with the clang we build with (older ones lack gfx942)."""
    clang = find_clang()
    candidates = [os.path.join(os.path.dirname(os.path.realpath(clang)), "llvm-objdump")] if clang else []
    candidates += [shutil.which(f"llvm-objdump-{v}") for v in range(25, MIN_CLANG - 1, -1)]
    candidates += sorted(glob.glob("/usr/lib/llvm-*/bin/llvm-objdump"), reverse=True)
    candidates += ["/opt/rocm/llvm/bin/llvm-objdump", shutil.which("llvm-objdump")]
    return next((c for c in candidates if c and os.path.exists(c)), None)


def clang_major(path: str) -> int:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r"clang version (\d+)", out)
    return int(m.group(1)) if m else 0


def amd_command(compiler: str, arch: str, src: Path, out: Path, defines) -> list[str]:
    cmd = [compiler, "-x", "hip", f"--offload-arch={arch}", "--offload-device-only",
           "--no-gpu-bundle-output", "-O3", "-std=c++17", "-Wall", *defines, "-o", str(out), str(src)]
    if not compiler.endswith("hipcc"):
        # Plain clang: no HIP headers or device libraries; portability.h covers what we use.
        cmd[1:1] = ["-nogpulib", "-nogpuinc"]
    return cmd


def nvidia_command(nvcc: str, archs, src: Path, out: Path, defines) -> list[str]:
    gencode = []
    for cc in archs:
        gencode += ["-gencode", f"arch=compute_{cc},code=sm_{cc}"]
    newest = max(archs)
    gencode += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]  # PTX for newer GPUs
    return [nvcc, "-x", "cu", "-fatbin", *gencode, "-O3", "-std=c++17", *defines, "-o", str(out), str(src)]


def run(cmd: list[str], env=None) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"build failed: {' '.join(cmd)}\n{result.stdout}{result.stderr}")


def build(out_dir: Path = DEFAULT_OUT, amd_archs=AMD_ARCHS, cuda_archs=CUDA_ARCHS,
          targets=("amd", "nvidia"), variants=tuple(VARIANTS), log=print) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(SOURCES.glob("*.hip"))
    built: list[Path] = []
    if "amd" in targets:
        clang = find_clang()
        if clang is None:
            log(f"pyhipa2a.build: skipping AMD ({', '.join(amd_archs)}): no hipcc or clang >= {MIN_CLANG} found")
        else:
            # clang finds lld next to its real binary (Debian puts it in /usr/lib/llvm-N/bin).
            env = dict(os.environ, PATH=os.path.dirname(os.path.realpath(clang)) + os.pathsep + os.environ.get("PATH", ""))
            for src in sources:
                for variant in variants:
                    for arch in amd_archs:
                        out = out_dir / f"{src.stem}{variant}.{arch}.hsaco"
                        run(amd_command(clang, arch, src, out, VARIANTS[variant]), env)
                        built.append(out)
            log(f"pyhipa2a.build: AMD {', '.join(amd_archs)} with {clang}")
    if "nvidia" in targets:
        nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
        if not nvcc:
            log("pyhipa2a.build: skipping NVIDIA (sm_" + ", sm_".join(cuda_archs) + "): no nvcc found")
        else:
            for src in sources:
                for variant in variants:
                    out = out_dir / f"{src.stem}{variant}.sm_{min(cuda_archs)}.fatbin"
                    run(nvidia_command(nvcc, cuda_archs, src, out, VARIANTS[variant]))
                    built.append(out)
            log(f"pyhipa2a.build: NVIDIA sm_{', sm_'.join(cuda_archs)} + PTX with {nvcc}")
    return built


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyhipa2a.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: pyhipa2a/_code)")
    p.add_argument("--amd-arch", default=",".join(AMD_ARCHS), help="comma-separated gfx targets")
    p.add_argument("--cuda-arch", default=",".join(CUDA_ARCHS), help="comma-separated compute capabilities")
    p.add_argument("--only", choices=("amd", "nvidia"), help="build one vendor only")
    args = p.parse_args(argv)
    targets = (args.only,) if args.only else ("amd", "nvidia")
    built = build(args.out, tuple(filter(None, args.amd_arch.split(","))),
                  tuple(filter(None, args.cuda_arch.split(","))), targets)
    print(f"pyhipa2a.build: {len(built)} code objects in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
