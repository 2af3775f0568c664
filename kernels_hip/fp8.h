// fp8 dispatch. A token crosses as its fp8 row and one float32 scale per
// 128-element block of it (DeepSeek-V3's layout: element i of a row stands
// for code_i * scale[i / 128]). Each segment of a token (exchange.h) moves as
// one piece per lane, held in registers between where it comes from (the
// caller's fp8 row and scales, the caller's 16-bit row quantized here, a
// stage row, a peer's pushed words) and where it goes (a stage row, expert
// rows, a peer's inbox).
//
// Quantizing (pyhipa2a/reference.py says the same in NumPy): per block,
// amax = the largest |x|; inv = largest fp8 / amax and scale = amax / largest
// fp8, each rounded once in float32; code = fp8(x * inv), rounded once in
// float32, then to nearest-even fp8, saturating (portability.h). A block of
// zeros, or one whose amax is below 2^-112 (bf16 only: inv would overflow),
// is all zeros with scale 0. A block holding a NaN or an infinity is all NaN
// with a NaN scale: no finite value stands for it.
#pragma once
#include "exchange.h"
#include "formats.h"

#define A2A_FP8_BLOCK 128u
// A segment of an fp8 token is twice the elements of a 16-bit one (the
// host's x_seg_elems), so that it moves as many bytes and the call has as
// many items. Lane l's chunk u of it is its elements u * A2A_FP8_STEP + 16l
// .. +16 (one 16-byte access; 8 lanes cover a block); lane b below
// A2A_FP8_SEG_SCALES carries the scale of the segment's block b.
#define A2A_FP8_CHUNK 16u
#define A2A_FP8_STEP (A2A_WARP_SIZE * A2A_FP8_CHUNK)
#define A2A_FP8_SEG_SCALES (A2A_CHUNKS * A2A_FP8_STEP / A2A_FP8_BLOCK)
#define A2A_FP8_LANES_PER_BLOCK (A2A_FP8_BLOCK / A2A_FP8_CHUNK)

struct Fp8Piece {
  u32 w[4 * A2A_CHUNKS];  // chunk u's 16 codes: w[4u .. 4u + 4)
  float scale;
  u32 chunks;             // chunks of this lane inside the row: a prefix of the A2A_CHUNKS
  bool has_scale;         // the lane carries a scale (its block is inside the row)
};

// Which chunks and which scale of the segment from element `first` lane `lane` holds, for a row
// of `hidden` elements (a multiple of the block: whole blocks and chunks, never part of one).
A2A_DEVICE Fp8Piece empty_piece(u32 first, u32 hidden, u32 lane) {
  Fp8Piece p;
  p.chunks = 0;
  for (u32 u = 0; u < A2A_CHUNKS; ++u)
    if (first + u * A2A_FP8_STEP + lane * A2A_FP8_CHUNK < hidden) p.chunks = u + 1u;
  for (u32 i = 0; i < 4 * A2A_CHUNKS; ++i) p.w[i] = 0u;
  p.has_scale = lane < A2A_FP8_SEG_SCALES && first / A2A_FP8_BLOCK + lane < hidden / A2A_FP8_BLOCK;
  p.scale = 0.0f;
  return p;
}

struct BlockScale {
  float scale, inv;
  bool finite;
};

// amax_bits: the block's largest |x| as bits, which order like the values (a NaN's or an
// infinity's exceed every finite value's).
A2A_DEVICE BlockScale block_scale(u32 amax_bits, Fp8Format f) {
  if (amax_bits >= 0x7f800000u) return {__builtin_bit_cast(float, 0x7fc00000u), 0.0f, false};
  const float amax = __builtin_bit_cast(float, amax_bits);
  if (amax < a2a_pow2(-112)) return {0.0f, 0.0f, true};
  return {amax / f.largest(), f.largest() / amax, true};
}

// One lane's chunk of 16 codes (4 words) and its block's scale.
struct Fp8Chunk {
  u32 w[4];
  float scale;
};

// A chunk of 16 elements of a 16-bit row (a and b: its two 16-byte halves) quantized with its
// block's scale (every lane of the warp calls: the block's lanes find its amax together).
// The amax is found on the 16-bit magnitudes (portability.h: a2a_amax16), then converted once.
// Out of line, called once per chunk: a segment's quantizing runs one copy of this code A2A_CHUNKS
// times instead of A2A_CHUNKS unrolled copies. Fetching unrolled code costs a warp more than running
// it (2.5 ns an instruction from L2, measured at commit 64bcea6); so did the segment's
// quantizing in dispatch, 4.7 us a segment beyond loading a given fp8 one (same commit).
template <typename Fmt>
A2A_DEVICE_CALLED Fp8Chunk quantize_chunk(vec16 a, vec16 b, u32 lane, Fp8Format f) {
  const u32 words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  u32 amax = a2a_amax16(words);
  for (u32 d = A2A_FP8_LANES_PER_BLOCK / 2u; d; d >>= 1) {
    const u32 other = (u32)a2a_shfl((int)amax, (int)(lane ^ d));
    amax = other > amax ? other : amax;
  }
  const BlockScale s = block_scale(__builtin_bit_cast(u32, Fmt::load((u16)amax)), f);
  Fp8Chunk c;
  c.scale = s.scale;
  for (u32 h = 0; h < 4; ++h) {
    const u32 lo = words[2 * h], hi = words[2 * h + 1];
    const float v0 = Fmt::load((u16)(lo & 0xffffu)) * s.inv, v1 = Fmt::load((u16)(lo >> 16)) * s.inv;
    const float v2 = Fmt::load((u16)(hi & 0xffffu)) * s.inv, v3 = Fmt::load((u16)(hi >> 16)) * s.inv;
    c.w[h] = s.finite ? a2a_float2_to_fp8(v0, v1, f) | a2a_float2_to_fp8(v2, v3, f) << 16 : f.nan() * 0x01010101u;
  }
  return c;
}

// The segment from element `first` of a 16-bit row, quantized (every lane of the warp calls).
template <typename Fmt>
A2A_DEVICE_CALLED Fp8Piece quantize_piece(const u16* row, u32 first, u32 hidden, u32 lane, Fp8Format f) {
  Fp8Piece p = empty_piece(first, hidden, lane);
  const bool vec = ((u64)row & 15u) == 0;  // (a chunk starts a multiple of 32 bytes into a row)
  vec16 raw[2 * A2A_CHUNKS];
  #pragma unroll
  for (u32 u = 0; u < A2A_CHUNKS; ++u) {  // every load issued before the first is used
    const u16* c = row + first + u * A2A_FP8_STEP + lane * A2A_FP8_CHUNK;
    raw[2 * u] = u < p.chunks ? load8(c, vec) : vec16{0u, 0u, 0u, 0u};
    raw[2 * u + 1] = u < p.chunks ? load8(c + 8, vec) : vec16{0u, 0u, 0u, 0u};
  }
  float scales[A2A_CHUNKS];
  #pragma unroll
  for (u32 u = 0; u < A2A_CHUNKS; ++u) {
    const Fp8Chunk c = quantize_chunk<Fmt>(raw[2 * u], raw[2 * u + 1], lane, f);
    for (u32 h = 0; h < 4; ++h) p.w[4 * u + h] = c.w[h];
    scales[u] = c.scale;
  }
  // Lane b takes block b's scale: chunk b / G (G blocks side by side in a chunk's step), held by
  // lane (b % G) * A2A_FP8_LANES_PER_BLOCK.
  constexpr u32 G = A2A_FP8_STEP / A2A_FP8_BLOCK;
  #pragma unroll
  for (u32 u = 0; u < A2A_CHUNKS; ++u) {
    const int sc = a2a_shfl(__builtin_bit_cast(int, scales[u]), (int)((lane % G) * A2A_FP8_LANES_PER_BLOCK));
    if (lane / G == u) p.scale = __builtin_bit_cast(float, sc);
  }
  return p;
}

// The segment from element `first` of an fp8 row and its scales (scales[0]: the row's first
// block): the caller's, or a stage row (ours, or a peer's over the link).
A2A_DEVICE Fp8Piece load_piece(const u8* codes, const float* scales, u32 first, u32 hidden, u32 lane) {
  Fp8Piece p = empty_piece(first, hidden, lane);
  const bool vec = ((u64)codes & 15u) == 0;
  for (u32 u = 0; u < A2A_CHUNKS; ++u) {
    if (u >= p.chunks) continue;
    const u8* c = codes + first + u * A2A_FP8_STEP + lane * A2A_FP8_CHUNK;
    if (vec) {
      const vec16 v = *reinterpret_cast<const vec16*>(c);
      p.w[4 * u] = v.x, p.w[4 * u + 1] = v.y, p.w[4 * u + 2] = v.z, p.w[4 * u + 3] = v.w;
    } else {
      for (u32 h = 0; h < 4; ++h)
        p.w[4 * u + h] = (u32)c[4 * h] | (u32)c[4 * h + 1] << 8 | (u32)c[4 * h + 2] << 16 | (u32)c[4 * h + 3] << 24;
    }
  }
  if (p.has_scale) p.scale = scales[first / A2A_FP8_BLOCK + lane];
  return p;
}

// The piece into an fp8 row and its scales (16-byte aligned rows: stage rows, expert rows).
A2A_DEVICE void store_piece(u8* codes, float* scales, u32 first, u32 lane, const Fp8Piece& p) {
  for (u32 u = 0; u < A2A_CHUNKS; ++u)
    if (u < p.chunks)
      *reinterpret_cast<vec16*>(codes + first + u * A2A_FP8_STEP + lane * A2A_FP8_CHUNK) =
          vec16{p.w[4 * u], p.w[4 * u + 1], p.w[4 * u + 2], p.w[4 * u + 3]};
  if (p.has_scale) scales[first / A2A_FP8_BLOCK + lane] = p.scale;
}

// A pushed token's tagged words, segment by segment: segment s at s * (seg_elems / 4 +
// seg_elems / 128), its codes first (word i of lane l at i * warp + l: each store of the warp
// covers contiguous words), then its scales (lane b's at seg_elems / 4 + b). The host sizes
// the inbox for the widest warp's segments (pyhipa2a/config.py).
A2A_DEVICE u64 pushed_segment(u32 seg, u32 seg_elems) { return (u64)seg * (seg_elems / 4u + seg_elems / A2A_FP8_BLOCK); }

A2A_DEVICE void push_piece(u64* token, u32 seg, u32 seg_elems, u32 lane, const Fp8Piece& p, u32 epoch) {
  u64* words = token + pushed_segment(seg, seg_elems);
  for (u32 i = 0; i < 4 * A2A_CHUNKS; ++i)
    if (i < 4 * p.chunks) a2a_store_relaxed_sys_u64(&words[i * A2A_WARP_SIZE + lane], a2a_tag(p.w[i], epoch));
  if (p.has_scale)
    a2a_store_relaxed_sys_u64(&words[seg_elems / 4u + lane], a2a_tag(__builtin_bit_cast(u32, p.scale), epoch));
}

// The piece of a pushed token once its words carry the call's epoch; false on timeout (reported).
A2A_DEVICE bool take_piece(const Ctx& x, const u64* token, u32 seg, u32 lane, Fp8Piece& p, u32 src, u32 t) {
  const u32 se = x.a.x_seg_elems;
  p = empty_piece(seg * se, (u32)x.a.hidden, lane);
  const u64* words = token + pushed_segment(seg, se) + lane;
  const u32 n = 4u * p.chunks;
  // Every word of the piece, its scale's too, is loaded before any is looked at: one round trip a
  // try. (take_tagged, which looks at each word as it loads it, compiled here into a round trip
  // per chunk and one more for the scale: 4 us a piece on two H200s, against 1 for a 16-bit one.)
  for (u32 spins = 1;; ++spins) {
    u64 w[4 * A2A_CHUNKS];
    for (u32 i = 0; i < 4 * A2A_CHUNKS; ++i)
      if (i < n) w[i] = a2a_load_relaxed_sys_u64(words + (u64)i * A2A_WARP_SIZE);
    const u64 scale = p.has_scale ? a2a_load_relaxed_sys_u64(words + se / 4u) : 0u;
    bool all = !p.has_scale || (u32)(scale >> 32) == x.epoch;
    for (u32 i = 0; i < 4 * A2A_CHUNKS; ++i) {
      if (i < n) {
        p.w[i] = (u32)w[i];
        all = all && (u32)(w[i] >> 32) == x.epoch;
      }
    }
    if (all) {
      p.scale = __builtin_bit_cast(float, (u32)scale);
      return true;
    }
    if (!poll_on(x, spins, src, A2A_WAIT_DISPATCH, t)) return false;
  }
}

// Segment `seg` of the caller's token t, as dispatch's format X reads it.
template <u32 X>
A2A_DEVICE Fp8Piece piece_of_input(const Ctx& x, const DispatchCall& c, u32 t, u32 seg, u32 lane) {
  const u32 H = (u32)x.a.hidden, first = seg * x.a.x_seg_elems;
  const Fp8Format f{x.a.fp8_fnuz != 0u};
  if constexpr (X == A2A_X_QUANTIZE_F16) return quantize_piece<F16>((const u16*)c.x + (u64)t * H, first, H, lane, f);
  if constexpr (X == A2A_X_QUANTIZE_BF16) return quantize_piece<BF16>((const u16*)c.x + (u64)t * H, first, H, lane, f);
  return load_piece((const u8*)c.x + (u64)t * H, (const float*)c.x_scales + (u64)t * x.a.scale_cols, first, H, lane);
}

// A stage row: the token's codes, then its scales.
A2A_DEVICE float* stage_scales(u8* row, u32 hidden) { return reinterpret_cast<float*>(row + hidden); }
A2A_DEVICE const float* stage_scales(const u8* row, u32 hidden) { return reinterpret_cast<const float*>(row + hidden); }
