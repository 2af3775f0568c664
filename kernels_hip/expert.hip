// The fake expert of gpu-mode's benchmark (expert_y = expert_x * scale), as
// a kernel of its own: scripts and tests stand it in for a grouped GEMM. In
// fp8 dispatch it reads each fp8 row with its block scales and writes the
// 16-bit expert_y, as an fp8 grouped GEMM would.
#include "exchange.h"
#include "fp8.h"

// prefix[l] = sum of counts[0..l), for l in [0, L], for the whole block. The
// counts are loaded by all threads at once into shared memory; warp 0 then
// scans them a warp's width at a time with shuffles (a serial loop over
// global loads cost a memory latency per count). A count outside [0,
// capacity] (-1: a failed dispatch's poison) stands for all of its expert's
// rows: the poisoned rows then turn into poisoned expert_y (NaN times the
// scale is NaN), and nothing past the buffers is touched.
A2A_DEVICE void exclusive_prefix(u32* prefix, const i32* counts, u32 L, u32 capacity) {
  for (u32 l = a2a_thread(); l < L; l += a2a_block_dim())
    prefix[l + 1] = counts[l] >= 0 && (u32)counts[l] <= capacity ? (u32)counts[l] : capacity;
  a2a_block_sync();
  if (a2a_thread() < A2A_WARP_SIZE) {
    const u32 lane = a2a_lane();
    u32 base = 0;
    for (u32 l0 = 0; l0 < L; l0 += A2A_WARP_SIZE) {
      u32 v = l0 + lane < L ? prefix[l0 + lane + 1] : 0u;
      for (u32 d = 1; d < A2A_WARP_SIZE; d <<= 1) {  // inclusive scan across the warp
        const u32 up = (u32)a2a_shfl((int)v, (int)(lane >= d ? lane - d : lane));
        if (lane >= d) v += up;
      }
      if (l0 + lane < L) prefix[l0 + lane + 1] = base + v;
      base += (u32)a2a_shfl((int)v, A2A_WARP_SIZE - 1);
    }
    if (lane == 0) prefix[0] = 0u;
  }
  a2a_block_sync();
}

// Where the rows of each expert lie: packed (rows 0 .. n - 1 of its
// [capacity] rows), by source (expert_layout [L][W][2]: source s's rows of
// expert l from row s * M on, M = capacity / W), or contiguous (rows
// expert_offsets[l] .. + n - 1 of one [recv_rows] buffer).
struct Rows {
  const i32* layout;   // by source, else null
  const i32* offsets;  // contiguous, else null
  u32 sources;
  u32 recv_rows;
};

// Contiguous rows: whether expert_offsets hold every expert's counted rows,
// in order, from row 0, within the buffer (a failed dispatch's poison, R in
// every offset and -1 in every count, does not: the walk then takes every
// row, so that poisoned rows turn into poisoned expert_y and nothing past
// the buffer is touched). The same in every thread of the block.
A2A_DEVICE bool offsets_hold(const u32* prefix, const Rows& rows, u32 L) {
  __shared__ u32 broken;
  if (a2a_thread() == 0) broken = 0u;
  a2a_block_sync();
  for (u32 l = a2a_thread(); l < L; l += a2a_block_dim()) {
    const i32 first = rows.offsets[l], next = rows.offsets[l + 1];
    if ((l == 0 && first != 0) || first < 0 || next < first || (u32)next > rows.recv_rows ||
        (u32)(next - first) < prefix[l + 1] - prefix[l])
      broken = 1u;
  }
  a2a_block_sync();
  return !broken;
}

// Row index in the [L][capacity] expert-major buffer of the q-th received row
// (the same in every lane of the warp): packed, row i of its expert l; by
// source, lane s takes source s's count of l, and a scan across the warp
// finds the source whose rows hold the expert's i-th (a count outside [0, M],
// a failed dispatch's poison, stands for all of the source's rows, as the
// counts' prefix does above).
A2A_DEVICE u64 received_row(const u32* prefix, u32 L, u32 capacity, u32 q, const Rows& rows, u32 lane) {
  u32 lo = 0, hi = L;  // largest l with prefix[l] <= q
  while (hi - lo > 1u) { const u32 mid = (lo + hi) / 2u; if (prefix[mid] <= q) lo = mid; else hi = mid; }
  const u32 i = q - prefix[lo];
  if (rows.offsets) return (u64)rows.offsets[lo] + i;
  if (!rows.layout) return (u64)lo * capacity + i;
  const u32 W = rows.sources, M = capacity / W;
  const i32 c = lane < W ? rows.layout[((u64)lo * W + lane) * 2u + 1u] : 0;
  const u32 n = lane >= W ? 0u : c >= 0 && (u32)c <= M ? (u32)c : M;
  u32 upto = n;  // rows of sources 0 .. lane
  for (u32 d = 1; d < A2A_WARP_SIZE; d <<= 1) {
    const u32 up = (u32)a2a_shfl((int)upto, (int)(lane >= d ? lane - d : lane));
    if (lane >= d) upto += up;
  }
  // (No lane holds i only where the counts disagree with expert_num_tokens, which no dispatch writes:
  // the last source's last row then, so that nothing past the buffers is touched.)
  const u32 holders = (u32)a2a_ballot(lane < W && i < upto);
  const u32 s = holders ? lowest_bit(holders) : W - 1u;
  const u32 before = (u32)a2a_shfl((int)(upto - n), (int)s);
  return (u64)lo * capacity + s * M + (holders ? i - before : M - 1u);
}

// The stand-in for a grouped GEMM used by scripts and tests (gpu-mode's fake
// expert: expert_y = expert_x * scale), applied to received rows only: warps
// walk the filled rows through the prefix of the counts, 8 elements a lane
// (every row of a contiguous buffer whose offsets are poison).
template <typename Fmt>
A2A_DEVICE void scale_rows(const u16* x, u16* y, const i32* counts, const Rows& rows, u32 L, u32 capacity,
                           u32 hidden, float scale) {
  __shared__ u32 prefix[A2A_MAX_LOCAL_EXPERTS + 1];
  exclusive_prefix(prefix, counts, L, capacity);
  const bool held = !rows.offsets || offsets_hold(prefix, rows, L);
  const WarpGrid g = warp_grid();
  for (u32 q = g.warp; q < (held ? prefix[L] : rows.recv_rows); q += g.warps) {
    const u64 row = (held ? received_row(prefix, L, capacity, q, rows, g.lane) : q) * hidden;
    copy_row_scaled<Fmt>(y + row, x + row, hidden, scale, g.lane);
  }
}

// `layout`: expert_layout of a call laid out by source (its `sources` ranks), `offsets`: expert_offsets of a
// contiguous one (its buffers of `recv_rows` rows), or both 0: packed rows.
#define A2A_ROWS Rows{(const i32*)layout, (const i32*)offsets, sources, recv_rows}
extern "C" __global__ void expert_scale_f16(u64 x, u64 y, u64 counts, u64 layout, u64 offsets, u32 sources,
                                            u32 recv_rows, u32 L, u32 capacity, u32 hidden, float scale) {
  scale_rows<F16>((const u16*)x, (u16*)y, (const i32*)counts, A2A_ROWS, L, capacity, hidden, scale);
}
extern "C" __global__ void expert_scale_bf16(u64 x, u64 y, u64 counts, u64 layout, u64 offsets, u32 sources,
                                             u32 recv_rows, u32 L, u32 capacity, u32 hidden, float scale) {
  scale_rows<BF16>((const u16*)x, (u16*)y, (const i32*)counts, A2A_ROWS, L, capacity, hidden, scale);
}

// The fp8 rows' fake expert: y = (code * block scale) * scale, each product
// rounded once in float32, then rounded to the 16-bit output (as
// pyhipa2a/reference.py's fake expert of an fp8 dispatch).
template <typename Fmt>
A2A_DEVICE void dequantize_rows(const u8* x, const float* scales, u16* y, const i32* counts, const Rows& rows, u32 L,
                                u32 capacity, u32 hidden, float scale, Fp8Format f) {
  __shared__ u32 prefix[A2A_MAX_LOCAL_EXPERTS + 1];
  exclusive_prefix(prefix, counts, L, capacity);
  const bool held = !rows.offsets || offsets_hold(prefix, rows, L);
  const WarpGrid g = warp_grid();
  const u32 cols = hidden / A2A_FP8_BLOCK;
  for (u32 q = g.warp; q < (held ? prefix[L] : rows.recv_rows); q += g.warps) {
    const u64 row = held ? received_row(prefix, L, capacity, q, rows, g.lane) : q;
    const u8* codes = x + row * hidden;
    for (u32 e0 = g.lane * 8u; e0 < hidden; e0 += A2A_WARP_SIZE * 8u) {  // 8 elements of one block a lane
      const float block = scales[row * cols + e0 / A2A_FP8_BLOCK];
      const u64 w = *reinterpret_cast<const u64*>(codes + e0);
      float out[8];
      for (u32 i = 0; i < 4; ++i) {
        float lo, hi;
        a2a_fp8x2_to_float((u32)(w >> (16u * i)) & 0xffffu, f, lo, hi);
        out[2 * i] = lo * block * scale;
        out[2 * i + 1] = hi * block * scale;
      }
      u16* dst = y + row * hidden + e0;
      if (((u64)dst & 15u) == 0) {
        store8<Fmt>(dst, out);
      } else {  // a caller's `out` off 16-byte alignment
        for (u32 i = 0; i < 8; ++i) dst[i] = Fmt::store(out[i]);
      }
    }
  }
}

extern "C" __global__ void expert_dequantize_f16(u64 x, u64 scales, u64 y, u64 counts, u64 layout, u64 offsets,
                                                 u32 sources, u32 recv_rows, u32 L, u32 capacity, u32 hidden,
                                                 float scale, u32 fnuz) {
  dequantize_rows<F16>((const u8*)x, (const float*)scales, (u16*)y, (const i32*)counts, A2A_ROWS, L, capacity, hidden,
                       scale, Fp8Format{fnuz != 0u});
}
extern "C" __global__ void expert_dequantize_bf16(u64 x, u64 scales, u64 y, u64 counts, u64 layout, u64 offsets,
                                                  u32 sources, u32 recv_rows, u32 L, u32 capacity, u32 hidden,
                                                  float scale, u32 fnuz) {
  dequantize_rows<BF16>((const u8*)x, (const float*)scales, (u16*)y, (const i32*)counts, A2A_ROWS, L, capacity, hidden,
                        scale, Fp8Format{fnuz != 0u});
}
