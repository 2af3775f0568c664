"""fp8: conversions and quantizing in the kernels' source (compiled for the host), the host twins and the
oracle (ml_dtypes), held to each other on every input that matters; how AllToAll plans its dtypes; and
fp8 dispatch under MPI against the oracle, both ways in, on the host backend and (marked gpu) on GPUs."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from pyhipa2a import reference
from pyhipa2a.dtypes import fp8_for_arch, plan_dtypes, resolve
from pyhipa2a.host_kernels import fp8 as twin
from tests.mpi_harness import BACKENDS, SHAPES, TRANSFER_MODES, env_backend, ranks_for, run_case, shape_id
from tests.native_build import build_native

ml_dtypes = pytest.importorskip("ml_dtypes")
FORMATS = {"float8_e4m3fn": False, "float8_e4m3fnuz": True}


def probe_values() -> np.ndarray:
    """Every fp16 value, every float32 next to an fp8 value and halfway between two, and a spread of
    random float32 of any magnitude, with the specials."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    grid = []
    for name in FORMATS:
        v = np.arange(256, dtype=np.uint8).view(resolve(name)).astype(np.float32)
        v = np.sort(v[np.isfinite(v)])
        mid = (v[1:] + v[:-1]) / 2  # exact ties
        grid += [v, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))]
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-140, 126, 200_000))).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, -1e-45], np.float32)
    values = np.concatenate([halves, *grid, spread, specials]).astype(np.float32)
    return np.concatenate([values, -values])


def oracle_codes(values: np.ndarray, name: str) -> np.ndarray:
    return reference.to_fp8(values, resolve(name)).view(np.uint8)


def check_codes(got: np.ndarray, values: np.ndarray, name: str) -> None:
    """Bit for bit against ml_dtypes; NaN inputs give the format's NaN (its sign is ours to choose)."""
    nan = np.isnan(values)
    want = oracle_codes(values, name)
    bad = np.flatnonzero((got != want) & ~nan)
    assert not len(bad), f"{name}: {values[bad[:5]]} -> {got[bad[:5]]}, ml_dtypes says {want[bad[:5]]}"
    assert np.all(np.isnan(got[nan].view(resolve(name)).astype(np.float32)))


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """tests/native/fp8_conversions.cpp built with the host's C++ compiler against kernels_hip/portability.h."""
    return build_native(tmp_path_factory.mktemp("fp8"), "fp8_conversions")


def test_kernel_conversions_match_ml_dtypes(native):
    """The kernels' own a2a_float_to_fp8 / a2a_fp8_to_float (portability.h), compiled for the host: e4m3fn
    as NVIDIA runs it, e4m3fnuz as MI300X would (no AMD GPU here: this is the check of its encoding)."""
    values = probe_values()
    out = subprocess.run([str(native)], input=values.tobytes(), capture_output=True, check=True).stdout
    n = len(values)
    assert len(out) == 2 * n + 2 * 256 * 4
    for i, name in enumerate(FORMATS):
        check_codes(np.frombuffer(out[i * n:(i + 1) * n], np.uint8), values, name)
        decoded = np.frombuffer(out[2 * n + i * 1024: 2 * n + (i + 1) * 1024], np.float32)
        want = np.arange(256, dtype=np.uint8).view(resolve(name)).astype(np.float32)
        assert np.array_equal(decoded, want, equal_nan=True), name
        assert np.array_equal(decoded.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])


def sixteen_bit_floats(name: str) -> np.ndarray:
    """Every 16-bit pattern of `name` (float16 or bfloat16) as float32."""
    return np.arange(65536, dtype=np.uint16).view(resolve(name)).astype(np.float32)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_sixteen_bit_magnitude_bits_order_like_magnitudes(name):
    """What a2a_amax16 (portability.h) relies on: for every pattern of either 16-bit format, ordering by
    its magnitude bits (sign cleared) orders |x| alike, with infinity above every finite value and
    every NaN above infinity; so the largest magnitude bits are the largest |x|, NaN when there is one."""
    bits = np.arange(65536, dtype=np.uint32)
    mags = np.abs(sixteen_bit_floats(name))
    order = np.argsort(bits & 0x7FFF, kind="stable")
    ordered, ordered_bits = mags[order], (bits & 0x7FFF)[order]
    nan = np.isnan(ordered)
    first_nan = np.argmax(nan)
    assert nan[first_nan:].all() and not nan[:first_nan].any()  # NaNs last
    up_to_inf = ordered[:first_nan]
    assert np.all(up_to_inf[1:] >= up_to_inf[:-1]) and up_to_inf[-1] == np.inf
    same_bits = ordered_bits[1:first_nan] == ordered_bits[:first_nan - 1]  # -x and x share them, and only they
    assert np.array_equal(same_bits, up_to_inf[1:] == up_to_inf[:-1])


@pytest.fixture(scope="module")
def native_amax(tmp_path_factory):
    """tests/native/fp8_amax.cpp: portability.h's a2a_amax16 built for the host (AMD's generic code)."""
    return build_native(tmp_path_factory.mktemp("amax"), "fp8_amax")


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_kernel_amax16_is_the_largest_magnitude(native_amax, name):
    """a2a_amax16 over chunks of 16 values (random, every pattern of the format once, and chunks with
    zeros, -0, infinities and NaN) is the bits of the largest |x| (NaN's when the chunk holds one)."""
    rng = np.random.default_rng(3)
    patterns = np.concatenate([rng.permutation(65536), rng.integers(0, 65536, 16 * 4096)]).astype(np.uint16)
    special = np.array([0x0000, 0x8000, 0x0001, 0x8001], np.uint16)
    inf, nan = (0x7C00, 0x7E00) if name == "float16" else (0x7F80, 0x7FC0)
    chunks = [np.full(16, v, np.uint16) for v in special]
    chunks += [np.array([0x8000 | inf] + [0x3C00] * 15, np.uint16), np.array([0x3C00] * 15 + [0x8000 | nan], np.uint16)]
    halves = np.concatenate([patterns] + chunks).reshape(-1, 16)
    out = subprocess.run([str(native_amax)], input=halves.tobytes(), capture_output=True, check=True).stdout
    got = np.frombuffer(out, np.uint16)
    assert len(got) == len(halves)
    assert np.array_equal(got, (halves & 0x7FFF).max(axis=1))
    values = np.abs(halves.view(resolve(name)).astype(np.float32))
    want = values.max(axis=1)  # (NaN where a row holds one: max propagates it)
    assert np.array_equal(got.view(resolve(name)).astype(np.float32), want, equal_nan=True)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_twin_conversions_match_ml_dtypes(name):
    values = probe_values()
    check_codes(twin.to_fp8(values, FORMATS[name]), values, name)
    want = np.arange(256, dtype=np.uint8).view(resolve(name)).astype(np.float32)
    assert np.array_equal(twin.from_fp8(np.arange(256, dtype=np.uint8), FORMATS[name]), want, equal_nan=True)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype16", ["float16", "bfloat16"])
def test_twin_quantizes_as_the_oracle(name, dtype16):
    """Blocks of every kind: normal, zeros, a wide range (fp8 subnormals), amax below 2^-112, the 16-bit
    format's extremes, NaN and infinities; codes and scales bit for bit, and what the oracle says of them."""
    rng = np.random.default_rng(7)
    dt = resolve(dtype16)
    x = (rng.standard_normal((24, 512)) * np.exp2(rng.integers(-20, 10, (24, 1)))).astype(np.float32)
    x[1, :128] = 0
    x[2, :] = -0.0
    x[3, :128] = np.exp2(-rng.integers(0, 20, 128)) * rng.choice([-1, 1], 128)
    x[4, :128] = 1e-38 if dtype16 == "bfloat16" else 6e-8
    x[5, 3], x[6, 200], x[7, 400] = np.nan, np.inf, -np.inf
    x[8, :] = float(np.finfo(np.float16).max) if dtype16 == "float16" else 3e38
    x = x.astype(dt)
    codes, scales = twin.quantize(x, FORMATS[name])
    want_codes, want_scales = reference.quantize_fp8(x, resolve(name))
    assert np.array_equal(codes, want_codes.view(np.uint8))
    assert np.array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    assert np.all(want_scales[1, 0] == 0) and np.all(want_codes.view(np.uint8)[1, :128] == 0)  # zeros: no NaN
    nan_blocks = [(5, 0), (6, 1), (7, 3)]
    for t, b in nan_blocks:
        assert np.isnan(want_scales[t, b]) and np.all(np.isnan(want_codes[t, 128 * b:128 * (b + 1)].astype(np.float32)))
    finite = np.isfinite(want_scales)
    back = reference.dequantize_fp8(want_codes, want_scales)
    block_max = np.abs(x.astype(np.float32)).reshape(24, 4, 128).max(axis=2)
    err = np.abs(back - x.astype(np.float32)).reshape(24, 4, 128).max(axis=2)
    # Round to nearest: half an fp8 step of the block's largest binade at most (2^-4 of amax), plus
    # the flush of the tiny blocks.
    assert np.all(err[finite] <= block_max[finite] * 2.0 ** -4 + 2.0 ** -112)


def test_plan_dtypes():
    assert ([d.name for d in plan_dtypes("bfloat16", "float8_e4m3", None)[:3]]
            == ["bfloat16", "float8_e4m3fn", "bfloat16"])
    ins, moved, out, asked = plan_dtypes("float8_e4m3fnuz", None, "float16")
    assert (ins.name, moved.name, out.name, asked) == ("float8_e4m3fnuz", "float8_e4m3fnuz", "float16",
                                                       "float8_e4m3fnuz")
    assert plan_dtypes("float16", None, None)[3] is None
    with pytest.raises(TypeError, match="give out_dtype"):
        plan_dtypes("float8_e4m3", None, None)
    with pytest.raises(TypeError, match="only to fp8"):
        plan_dtypes("float16", "bfloat16", None)
    with pytest.raises(TypeError, match="must be the same or None"):
        plan_dtypes("float8_e4m3fn", "float8_e4m3fnuz", "float16")
    for other in ("float16", "float32", "garbage", 5):  # (fp8 x moves as it is: no other dispatch_dtype means anything)
        with pytest.raises(TypeError, match=f"must be the same or None, not {other!r}"):
            plan_dtypes("float8_e4m3", other, "bfloat16")
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        plan_dtypes("bfloat16", "float8_e4m3", "float8_e4m3fn")


def test_fp8_by_device():
    assert fp8_for_arch("float8_e4m3", "gfx942").name == "float8_e4m3fnuz"
    assert fp8_for_arch("float8_e4m3", "sm_90").name == "float8_e4m3fn"
    assert fp8_for_arch("float8_e4m3fnuz", "host").name == "float8_e4m3fnuz"
    with pytest.raises(TypeError, match="gfx90a, which has none"):
        fp8_for_arch("float8_e4m3", "gfx90a")
    with pytest.raises(TypeError, match="gfx942 uses float8_e4m3fnuz"):
        fp8_for_arch("float8_e4m3fn", "gfx942")


CASE = "tests.cases.fp8_cases:"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_bad_inputs(backend):
    run_case(CASE + "case_fp8_bad_inputs", ranks_for(backend), env_backend(backend))


# fp8 dispatch (e4m3 and block scales), both ways in. The host twins emulate both encodings; a GPU
# takes its own ("float8_e4m3": e4m3fn on NVIDIA, e4m3fnuz on MI300X).
FP8_SHAPES = [s for s in SHAPES["tests"] if s["hidden_dim"] % 128 == 0]
FP8_WAYS = ["quantize", "given"]


def fp8_name(fmt: str, backend: str) -> str:
    return fmt if backend == "host" else "float8_e4m3"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("way", FP8_WAYS)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=shape_id)
def test_fp8_gpumode_test_shapes(shape, way, backend):
    ranks = ranks_for(backend)
    if shape["num_experts"] % ranks:
        pytest.skip(f"{shape['num_experts']} experts do not divide over {ranks} ranks")
    run_case(CASE + "case_fp8", ranks, env_backend(backend),
             args=(way, "float8_e4m3", "bfloat16", shape["num_experts"] // ranks, shape["experts_per_token"],
                   shape["hidden_dim"], shape["max_num_tokens"], "random", "random", "normal", 2, shape["seed"]))


# (format, 16-bit dtype, E per rank, k, H, M, token counts, routing, values, transfer mode)
FP8_EDGE_CASES = {
    "some_ranks_empty": ("float8_e4m3fn", "bfloat16", 4, 3, 256, 16, "some_empty", "random", "normal", "mixed"),
    "all_ranks_empty": ("float8_e4m3fn", "float16", 2, 2, 128, 8, "all_empty", "random", "normal", "pull"),
    "T_equals_M": ("float8_e4m3fnuz", "bfloat16", 4, 4, 512, 32, "full", "random", "normal", "pull"),
    "one_hot_expert_full_capacity": ("float8_e4m3fn", "float16", 4, 4, 256, 32, "full", "hot", "normal", "push"),
    "k1": ("float8_e4m3fnuz", "float16", 4, 1, 384, 16, "random", "random", "normal", "mixed"),
    "edges_fn": ("float8_e4m3fn", "float16", 4, 4, 1024, 12, "full", "random", "edges", "mixed"),
    "edges_fnuz": ("float8_e4m3fnuz", "bfloat16", 4, 4, 1024, 12, "full", "random", "edges", "mixed"),
    "nonfinite_fn": ("float8_e4m3fn", "bfloat16", 4, 4, 1152, 8, "full", "random", "nonfinite", "pull"),
    "nonfinite_fnuz": ("float8_e4m3fnuz", "float16", 4, 4, 1152, 8, "full", "random", "nonfinite", "push"),
    "partial_segment_pushed": ("float8_e4m3fn", "bfloat16", 4, 4, 1152, 8, "staggered", "random", "normal", "mixed"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("way", FP8_WAYS)
@pytest.mark.parametrize("name", sorted(FP8_EDGE_CASES))
def test_fp8_edge_cases(name, way, backend):
    fmt, in16, per_rank, k, H, M, counts, routing, values, mode = FP8_EDGE_CASES[name]
    # The cases that push do so with pushed tokens (their fp8 pieces: fp8.h), which sm_90's default
    # protocol does not use (test_publish_modes).
    run_case(CASE + "case_fp8", ranks_for(backend), env_backend(backend),
             env={**TRANSFER_MODES[mode][0],
                  "PYHIPA2A_PUBLISH": "auto" if mode == "pull" else "system"},
             args=(way, fp8_name(fmt, backend), in16, per_rank, k, H, M, counts, routing, values, 2, 13))


# fp8 rows (and their scales) laid out by source or contiguous: both ways in, pulled, pushed (its fp8
# pieces) and mixed, the fake expert's dequantizing kernel reading each expert's rows where they lie.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("way", FP8_WAYS)
@pytest.mark.parametrize("mode", sorted(TRANSFER_MODES))
@pytest.mark.parametrize("row_layout", ["by_source", "contiguous/8"])
def test_fp8_rows_laid_out(way, mode, row_layout, backend):
    run_case(CASE + "case_fp8", ranks_for(backend), env_backend(backend),
             env={**TRANSFER_MODES[mode][0],
                  "PYHIPA2A_PUBLISH": "auto" if mode == "pull" else "system"},
             args=(way, fp8_name("float8_e4m3fn", backend), "bfloat16", 4, 4, 1024, 32,
                   TRANSFER_MODES[mode][1], "random", "normal", 2, 19, row_layout))
