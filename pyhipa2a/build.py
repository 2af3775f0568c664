"""Build the device code ahead of time: `python -m pyhipa2a.build`.

kernels_hip/*.hip -> <name>.<gfx>.hsaco (AMD, hipcc or clang >= 17), <name>.sm_90.fatbin (NVIDIA sm_90 + PTX, nvcc);
csrc/*.c -> _<name>.abi3.so, repeated calls' plans in C (pyhipa2a.repeat); csrc/jax_ffi.cc -> _jax_ffi.so, XLA's
handler of pyhipa2a.jax, against the headers of the jaxlib installed here. Absent toolchains are skipped, one line
each; variants add `-D` defines and a name suffix. Standard library only: pip runs this before numpy is importable."""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "kernels_hip"
HOST_SOURCES = REPO / "csrc"
DEFAULT_OUT = Path(__file__).resolve().parent / "_code"
AMD_ARCHS = ("gfx942", "gfx90a")
CUDA_ARCHS = ("90",)
VARIANTS = {"": (), ".profile": ("-DA2A_PROFILE=1",)}  # name suffix -> extra compiler defines
MIN_CLANG = 17


def llvm_tools(tool: str, first=()) -> list[str]:
    """The copies of LLVM's `tool` here: `first`, then newest first versioned on PATH, Debian's, ROCm's, unversioned."""
    candidates = [*first, *(shutil.which(f"{tool}-{v}") for v in range(25, MIN_CLANG - 1, -1))]
    candidates += sorted(glob.glob(f"/usr/lib/llvm-*/bin/{tool}"), reverse=True)
    candidates += [f"/opt/rocm/llvm/bin/{tool}", shutil.which(tool)]
    return [path for path in candidates if path and os.path.exists(path)]


def find_clang() -> str | None:
    """hipcc first (ROCm), else the newest clang++ that knows --offload-arch."""
    hipcc = shutil.which("hipcc")
    if hipcc:
        return hipcc
    return next((path for path in llvm_tools("clang++") if clang_major(path) >= MIN_CLANG), None)


def find_objdump() -> str | None:
    """The llvm-objdump that ships with the clang we build with (older ones lack gfx942)."""
    clang = find_clang()
    beside_clang = [os.path.join(os.path.dirname(os.path.realpath(clang)), "llvm-objdump")] if clang else []
    return next(iter(llvm_tools("llvm-objdump", beside_clang)), None)


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


def find_c_compiler() -> str | None:
    """The compiler CPython was built with where it is here, else cc, gcc or clang."""
    names = (sysconfig.get_config_var("CC") or "").split()[:1] + ["cc", "gcc", "clang"]
    return next(filter(None, (shutil.which(name) for name in names)), None)


def build_host(out_dir: Path, log=print) -> list[Path]:
    """The C helpers where they build here; else one line says why, and repeated calls run their plans in Python."""
    cc, include = find_c_compiler(), sysconfig.get_paths()["include"]
    why = None
    if cc is None:
        why = "no C compiler found"
    elif not os.path.exists(os.path.join(include, "Python.h")):
        why = f"no Python.h in {include}"
    elif sysconfig.get_config_var("Py_GIL_DISABLED"):
        why = "a free-threaded CPython has no limited API"
    built = []
    for src in sorted(HOST_SOURCES.glob("*.c")) if why is None else ():
        out = out_dir / f"_{src.stem}.abi3.so"
        why = compile_failure([cc, "-O2", "-shared", "-fPIC", "-Wall", "-std=c11", f"-I{include}", "-o", str(out),
                               str(src)])
        if why is not None:
            break
        built.append(out)
    if why is None:
        log(f"pyhipa2a.build: C helpers with {cc}")
        return built
    for stale in (out_dir / f"_{src.stem}.abi3.so" for src in HOST_SOURCES.glob("*.c")):
        stale.unlink(missing_ok=True)  # (an older build's helper must not stand in for this one)
    log(f"pyhipa2a.build: skipping the C helpers (repeated calls run their plans in Python): {why}")
    return []


def jaxlib_headers() -> Path | None:
    """jaxlib's own XLA FFI headers (what jax.ffi.include_dir() names), found without importing JAX."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return None
    include = Path(spec.origin).parent / "include"
    return include if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


def build_jax_handler(out_dir: Path, log=print) -> list[Path]:
    """XLA's handler of pyhipa2a.jax where jaxlib and a C++ compiler are here; else one line says why."""
    out = out_dir / "_jax_ffi.so"
    include = jaxlib_headers()
    cxx = next(filter(None, (shutil.which(name) for name in ("c++", "g++", "clang++"))), None)
    why = "jaxlib is not installed" if include is None else "no C++ compiler found" if cxx is None else None
    if why is None:
        why = compile_failure([cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-Wall", "-DNDEBUG", "-isystem",
                               str(include), "-o", str(out), str(HOST_SOURCES / "jax_ffi.cc")])
    if why is None:
        log(f"pyhipa2a.build: JAX's handler with {cxx} against {include}")
        return [out]
    out.unlink(missing_ok=True)  # (an older build's handler must not stand in for this one)
    log(f"pyhipa2a.build: skipping JAX's handler (pyhipa2a.jax then runs on JAX's CPU platform only): {why}")
    return []


def run(cmd: list[str], env=None) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"build failed: {' '.join(cmd)}\n{result.stdout}{result.stderr}")


def compile_failure(cmd: list[str]) -> str | None:
    """Runs `cmd`: None where it succeeds, else why not (its first line of output, else the command)."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode == 0:
        return None
    lines = (result.stdout + result.stderr).splitlines() or [f"build failed: {' '.join(cmd)}"]
    return f"the compiler failed: {lines[0]}"


def run_all(commands: list, env=None) -> None:
    """Each command, as many at once as there are CPUs (each compile is one process and one core); the
    first that fails raises once the others are done."""
    workers = max(1, min(len(commands), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for done in [pool.submit(run, cmd, env) for cmd in commands]:
            done.result()


def build(out_dir: Path = DEFAULT_OUT, amd_archs=AMD_ARCHS, cuda_archs=CUDA_ARCHS,
          targets=("amd", "nvidia", "host"), variants=tuple(VARIANTS), log=print) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(SOURCES.glob("*.hip"))
    built: list[Path] = []
    if "amd" in targets:
        clang = find_clang()
        if clang is None:
            log(f"pyhipa2a.build: skipping AMD ({', '.join(amd_archs)}): no hipcc or clang >= {MIN_CLANG} found")
        else:
            # clang finds lld next to its real binary (Debian puts it in /usr/lib/llvm-N/bin).
            env = dict(os.environ,
                       PATH=os.path.dirname(os.path.realpath(clang)) + os.pathsep + os.environ.get("PATH", ""))
            jobs = [(src, variant, arch, out_dir / f"{src.stem}{variant}.{arch}.hsaco")
                    for src in sources for variant in variants for arch in amd_archs]
            run_all([amd_command(clang, arch, src, out, VARIANTS[variant]) for src, variant, arch, out in jobs], env)
            built += [out for *_, out in jobs]
            log(f"pyhipa2a.build: AMD {', '.join(amd_archs)} with {clang}")
    if "nvidia" in targets:
        nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
        if not nvcc:
            log("pyhipa2a.build: skipping NVIDIA (sm_" + ", sm_".join(cuda_archs) + "): no nvcc found")
        else:
            jobs = [(src, variant, out_dir / f"{src.stem}{variant}.sm_{min(cuda_archs)}.fatbin")
                    for src in sources for variant in variants]
            run_all([nvidia_command(nvcc, cuda_archs, src, out, VARIANTS[variant]) for src, variant, out in jobs])
            built += [out for *_, out in jobs]
            log(f"pyhipa2a.build: NVIDIA sm_{', sm_'.join(cuda_archs)} + PTX with {nvcc}")
    if "host" in targets:
        built += build_host(out_dir, log)
        built += build_jax_handler(out_dir, log)
    return built


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pyhipa2a.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: pyhipa2a/_code)")
    p.add_argument("--amd-arch", default=",".join(AMD_ARCHS), help="comma-separated gfx targets")
    p.add_argument("--cuda-arch", default=",".join(CUDA_ARCHS), help="comma-separated compute capabilities")
    p.add_argument("--only", choices=("amd", "nvidia", "host"), help="build one kind only (host: the C helpers)")
    args = p.parse_args(argv)
    targets = (args.only,) if args.only else ("amd", "nvidia", "host")
    built = build(args.out, tuple(filter(None, args.amd_arch.split(","))),
                  tuple(filter(None, args.cuda_arch.split(","))), targets)
    print(f"pyhipa2a.build: {len(built)} code objects in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
