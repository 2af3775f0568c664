// Expert-parallel dispatch and combine over the symmetric heap.
//
// dispatch: each (token, slot) pair reserves a row in the destination rank's
//   expert-major buffer with one system-scope atomic add on that rank's
//   per-expert counter, writes the token vector and its (src_rank, src_token,
//   src_k) meta there, and when the whole grid is done the last block
//   release-stores this call's epoch into every peer's dispatch flag for this
//   rank. The last block then acquires every peer's flag, so the counters are
//   final: it copies them out as expert_num_tokens and zeroes them for the
//   next call.
// combine: each expert rank pushes every received row of expert_y back to the
//   owner's (token, slot) row and release-stores a per-row epoch flag; the
//   owner reduces a token as soon as its k flags carry this epoch (weights
//   stay on the owner, accumulation in fp32 in slot order). Every rank then
//   tells every peer "done pushing" with an epoch flag, and no rank finishes
//   combine before all peers said so: a peer's next dispatch writes into our
//   receive buffers only after we stopped reading them.
// Flags carry the call's epoch (never 0), so no buffer is reset between calls
// except the counters, which the dispatch that filled them zeroes.
#include "protocol.h"

struct A2AArgs {
  HeapView heap;
  u64 off_recv_x;          // u8  [L][W*M][x_row_bytes]   expert_x
  u64 off_recv_meta;       // i32 [L][W*M][3]             expert_meta
  u64 off_counters;        // u32 [L]   row reservations by senders
  u64 off_num_tokens;      // i32 [L]   expert_num_tokens (output)
  u64 off_dispatch_flags;  // u32 [W]   flag w stored by sender w
  u64 off_combine_rows;    // u8  [M*k][y_row_bytes]       rows pushed back to the owner
  u64 off_combine_flags;   // u32 [M*k]
  u64 off_combine_done;    // u32 [W]   flag w stored by expert rank w
  u64 off_block_counters;  // u32 [2]   last-block counters: dispatch, combine
  u64 off_status;          // u32 [4]   first error of this rank
  u64 host_status;         // u32 [4]   its mirror in pinned host memory (device address)
  i32 num_experts;
  i32 local_experts;
  i32 top_k;
  i32 max_tokens;
  i32 hidden;
  u32 x_row_bytes;
  u32 y_row_bytes;
  u32 pad;
  u64 timeout_ns;
};

struct DispatchCall {
  u64 x;          // [T][x_row_bytes]
  u64 indices;    // i32 [T][k]
  i32 num_tokens;
  u32 epoch;
};

struct CombineCall {
  u64 expert_y;   // [L][W*M][y_row_bytes], local
  u64 weights;    // f32 [T][k]
  u64 out;        // [T][hidden]
  i32 num_tokens;
  u32 epoch;
};

#define A2A_MAX_LOCAL_EXPERTS 1024

struct WarpGrid {
  u32 lane, warp, warps;
};

A2A_DEVICE WarpGrid warp_grid() {
  const u32 per_block = a2a_block_dim() / A2A_WARP_SIZE;
  return {a2a_lane(), a2a_block() * per_block + a2a_thread() / A2A_WARP_SIZE,
          a2a_grid_dim() * per_block};
}

// One warp copies one row. Four 16-byte loads are in flight per lane before
// their stores, which keeps the NVLink/xGMI queue busy for long rows.
A2A_DEVICE void copy_row(u8* dst, const u8* src, u32 bytes, u32 lane) {
  if ((((u64)dst | (u64)src | bytes) & 15u) == 0) {
    vec16* d = reinterpret_cast<vec16*>(dst);
    const vec16* s = reinterpret_cast<const vec16*>(src);
    const u32 n = bytes / 16u, W = A2A_WARP_SIZE;
    u32 i = lane;
    for (; i + 3u * W < n; i += 4u * W) {
      vec16 v0 = s[i], v1 = s[i + W], v2 = s[i + 2u * W], v3 = s[i + 3u * W];
      d[i] = v0; d[i + W] = v1; d[i + 2u * W] = v2; d[i + 3u * W] = v3;
    }
    for (; i < n; i += W) d[i] = s[i];
  } else if ((((u64)dst | (u64)src | bytes) & 1u) == 0) {
    u16* d = reinterpret_cast<u16*>(dst);
    const u16* s = reinterpret_cast<const u16*>(src);
    for (u32 i = lane; i < bytes / 2u; i += A2A_WARP_SIZE) d[i] = s[i];
  } else {
    for (u32 i = lane; i < bytes; i += A2A_WARP_SIZE) dst[i] = src[i];
  }
}

// The contract says a row's experts are distinct and in [0, E). Inputs that
// break it are reported, never written: a repeated expert could overflow the
// W*M rows reserved per expert.
A2A_DEVICE bool valid_expert(const i32* row, u32 j, i32 num_experts) {
  const i32 e = row[j];
  if (e < 0 || e >= num_experts) return false;
  for (u32 i = 0; i < j; ++i)
    if (row[i] == e) return false;
  return true;
}

extern "C" __global__ void a2a_dispatch(A2AArgs a, DispatchCall c) {
  const HeapView& h = a.heap;
  const u64 deadline = a2a_clock_ns() + a.timeout_ns;
  u32* status = sym<u32>(h, h.rank, a.off_status);
  u32* mirror = reinterpret_cast<u32*>(a.host_status);
  const WarpGrid g = warp_grid();
  const u32 k = (u32)a.top_k;
  const u32 capacity = (u32)(h.world * a.max_tokens);
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u8* x = reinterpret_cast<const u8*>(c.x);

  for (u32 p = g.warp; p < (u32)c.num_tokens * k; p += g.warps) {
    const u32 t = p / k, j = p % k;
    const i32* row = indices + (u64)t * k;
    if (!valid_expert(row, j, a.num_experts)) {
      if (g.lane == 0) a2a_report(status, mirror, A2A_ERR_BAD_INDEX, (u32)h.rank, t * k + j, (u32)row[j]);
      continue;
    }
    const int dst = row[j] / a.local_experts, l = row[j] % a.local_experts;
    int slot = 0;
    if (g.lane == 0) slot = (int)a2a_fetch_add_sys(sym<u32>(h, dst, a.off_counters) + l, 1u);
    slot = a2a_shfl(slot, 0);
    if ((u32)slot >= capacity) {
      if (g.lane == 0) a2a_report(status, mirror, A2A_ERR_CAPACITY, (u32)dst, (u32)l, (u32)slot);
      continue;
    }
    const u64 dst_row = (u64)l * capacity + (u32)slot;
    copy_row(sym<u8>(h, dst, a.off_recv_x) + dst_row * a.x_row_bytes, x + (u64)t * a.x_row_bytes,
             a.x_row_bytes, g.lane);
    if (g.lane < 3u) {
      const i32 meta[3] = {h.rank, (i32)t, (i32)j};
      sym<i32>(h, dst, a.off_recv_meta)[dst_row * 3u + g.lane] = meta[g.lane];
    }
  }

  if (!a2a_last_block(sym<u32>(h, h.rank, a.off_block_counters) + 0)) return;

  for (u32 peer = a2a_thread(); peer < (u32)h.world; peer += a2a_block_dim())
    a2a_store_release_sys(sym<u32>(h, (int)peer, a.off_dispatch_flags) + h.rank, c.epoch);
  const u32* flags = sym<u32>(h, h.rank, a.off_dispatch_flags);
  for (u32 peer = a2a_thread(); peer < (u32)h.world; peer += a2a_block_dim())
    if (!a2a_wait_flag(&flags[peer], c.epoch, deadline, status))
      a2a_report(status, mirror, A2A_ERR_TIMEOUT, peer, A2A_WAIT_DISPATCH, c.epoch);
  a2a_block_sync();

  u32* counters = sym<u32>(h, h.rank, a.off_counters);
  i32* num_tokens = sym<i32>(h, h.rank, a.off_num_tokens);
  for (u32 l = a2a_thread(); l < (u32)a.local_experts; l += a2a_block_dim()) {
    const u32 n = a2a_load_relaxed_sys(&counters[l]);
    num_tokens[l] = (i32)(n < capacity ? n : capacity);
    counters[l] = 0u;
  }
}

// Element access for the two 16-bit formats combine reduces.
struct F16 {
  static A2A_DEVICE float load(u16 v) { return a2a_half_to_float(v); }
  static A2A_DEVICE u16 store(float f) { return a2a_float_to_half(f); }
};
struct BF16 {
  static A2A_DEVICE float load(u16 v) { return a2a_bf16_to_float(v); }
  static A2A_DEVICE u16 store(float f) { return a2a_float_to_bf16(f); }
};

// out[t] = sum_j w[t, j] * rows[t, j], fp32 in slot order, one warp per token.
template <typename Fmt>
A2A_DEVICE void reduce_token(u16* out, const u8* rows, u32 row_bytes, const float* w, u32 k,
                             u32 hidden, u32 lane) {
  const bool vec = (((u64)out | (u64)rows | row_bytes) & 15u) == 0;
  const u32 vec_elems = vec ? (hidden / 8u) * 8u : 0u;
  for (u32 c = lane * 8u; c < vec_elems; c += A2A_WARP_SIZE * 8u) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (u32 j = 0; j < k; ++j) {
      const vec16 v = *reinterpret_cast<const vec16*>(rows + j * row_bytes + c * 2u);
      const u32 words[4] = {v.x, v.y, v.z, v.w};
      for (int q = 0; q < 4; ++q) {
        acc[2 * q] += w[j] * Fmt::load((u16)(words[q] & 0xffffu));
        acc[2 * q + 1] += w[j] * Fmt::load((u16)(words[q] >> 16));
      }
    }
    vec16 o;
    u32* ow = &o.x;
    for (int q = 0; q < 4; ++q)
      ow[q] = (u32)Fmt::store(acc[2 * q]) | ((u32)Fmt::store(acc[2 * q + 1]) << 16);
    *reinterpret_cast<vec16*>(out + c) = o;
  }
  for (u32 c = vec_elems + lane; c < hidden; c += A2A_WARP_SIZE) {
    float acc = 0.f;
    for (u32 j = 0; j < k; ++j)
      acc += w[j] * Fmt::load(reinterpret_cast<const u16*>(rows + j * row_bytes)[c]);
    out[c] = Fmt::store(acc);
  }
}

// prefix[l] = sum of counts[0..l), for l in [0, L]. Warp 0 does it: each lane
// sums a contiguous chunk, lane 0 scans the chunk sums, each lane fills in its
// chunk. Keeps a long serial loop over L global loads off the critical path.
A2A_DEVICE void exclusive_prefix(u32* prefix, const i32* counts, u32 L) {
  __shared__ u32 chunk_base[A2A_WARP_SIZE];
  if (a2a_thread() < A2A_WARP_SIZE) {
    const u32 lane = a2a_lane(), per = (L + A2A_WARP_SIZE - 1) / A2A_WARP_SIZE;
    const u32 lo = lane * per < L ? lane * per : L, hi = lo + per < L ? lo + per : L;
    u32 sum = 0;
    for (u32 l = lo; l < hi; ++l) sum += (u32)counts[l];
    chunk_base[lane] = sum;
    a2a_wave_sync();
    if (lane == 0) {
      u32 run = 0;
      for (u32 i = 0; i < A2A_WARP_SIZE; ++i) { const u32 c = chunk_base[i]; chunk_base[i] = run; run += c; }
      prefix[L] = run;
    }
    a2a_wave_sync();
    u32 run = chunk_base[lane];
    for (u32 l = lo; l < hi; ++l) { prefix[l] = run; run += (u32)counts[l]; }
  }
  a2a_block_sync();
}

// Row index in the [L][capacity] expert-major buffer of the q-th received row.
A2A_DEVICE u64 received_row(const u32* prefix, u32 L, u32 capacity, u32 q) {
  u32 lo = 0, hi = L;  // largest l with prefix[l] <= q
  while (hi - lo > 1u) { const u32 mid = (lo + hi) / 2u; if (prefix[mid] <= q) lo = mid; else hi = mid; }
  return (u64)lo * capacity + (q - prefix[lo]);
}

template <typename Fmt>
A2A_DEVICE void combine(const A2AArgs& a, const CombineCall& c) {
  const HeapView& h = a.heap;
  const u64 deadline = a2a_clock_ns() + a.timeout_ns;
  u32* status = sym<u32>(h, h.rank, a.off_status);
  u32* mirror = reinterpret_cast<u32*>(a.host_status);
  const WarpGrid g = warp_grid();
  const u32 k = (u32)a.top_k, L = (u32)a.local_experts;
  const u32 capacity = (u32)(h.world * a.max_tokens);

  // Rows received per local expert, as a prefix sum: row q of the flattened
  // received set lives at expert l with prefix[l] <= q < prefix[l+1].
  __shared__ u32 prefix[A2A_MAX_LOCAL_EXPERTS + 1];
  exclusive_prefix(prefix, sym<i32>(h, h.rank, a.off_num_tokens), L);

  const i32* meta = sym<i32>(h, h.rank, a.off_recv_meta);
  const u8* expert_y = reinterpret_cast<const u8*>(c.expert_y);
  for (u32 q = g.warp; q < prefix[L]; q += g.warps) {
    const u64 row = received_row(prefix, L, capacity, q);
    const int src = meta[row * 3u];
    const u32 slot = (u32)meta[row * 3u + 1u] * k + (u32)meta[row * 3u + 2u];
    copy_row(sym<u8>(h, src, a.off_combine_rows) + (u64)slot * a.y_row_bytes,
             expert_y + row * a.y_row_bytes, a.y_row_bytes, g.lane);
    a2a_wave_sync();
    if (g.lane == 0) a2a_store_release_sys(sym<u32>(h, src, a.off_combine_flags) + slot, c.epoch);
  }

  const bool last = a2a_last_block(sym<u32>(h, h.rank, a.off_block_counters) + 1);
  if (last)
    for (u32 peer = a2a_thread(); peer < (u32)h.world; peer += a2a_block_dim())
      a2a_store_release_sys(sym<u32>(h, (int)peer, a.off_combine_done) + h.rank, c.epoch);

  const u32* flags = sym<u32>(h, h.rank, a.off_combine_flags);
  const u8* rows = sym<u8>(h, h.rank, a.off_combine_rows);
  const float* weights = reinterpret_cast<const float*>(c.weights);
  u16* out = reinterpret_cast<u16*>(c.out);
  for (u32 t = g.warp; t < (u32)c.num_tokens; t += g.warps) {
    // Lane j waits for slot j; the owner cannot tell which peer is late
    // from the row alone, so the report names the row and the rank waiting.
    if (g.lane < k && !a2a_wait_flag(&flags[t * k + g.lane], c.epoch, deadline, status))
      a2a_report(status, mirror, A2A_ERR_TIMEOUT, (u32)h.rank, A2A_WAIT_COMBINE_ROW, t * k + g.lane);
    a2a_wave_sync();
    const int failed = a2a_shfl(g.lane == 0 ? (int)a2a_load_relaxed_sys(&status[0]) : 0, 0);
    if (failed) break;
    reduce_token<Fmt>(out + (u64)t * a.hidden, rows + (u64)t * k * a.y_row_bytes, a.y_row_bytes,
                      weights + (u64)t * k, k, (u32)a.hidden, g.lane);
  }

  if (!last) return;
  const u32* done = sym<u32>(h, h.rank, a.off_combine_done);
  for (u32 peer = a2a_thread(); peer < (u32)h.world; peer += a2a_block_dim())
    if (!a2a_wait_flag(&done[peer], c.epoch, deadline, status))
      a2a_report(status, mirror, A2A_ERR_TIMEOUT, peer, A2A_WAIT_COMBINE_DONE, c.epoch);
}

extern "C" __global__ void a2a_combine_f16(A2AArgs a, CombineCall c) { combine<F16>(a, c); }
extern "C" __global__ void a2a_combine_bf16(A2AArgs a, CombineCall c) { combine<BF16>(a, c); }

// The stand-in for a grouped GEMM used by scripts and tests (gpu-mode's fake
// expert: expert_y = expert_x * scale), applied to received rows only: warps
// walk the filled rows through the prefix of the counts, 8 elements a lane.
template <typename Fmt>
A2A_DEVICE void scale_rows(const u16* x, u16* y, const i32* counts, u32 L, u32 capacity, u32 hidden,
                           float scale) {
  __shared__ u32 prefix[A2A_MAX_LOCAL_EXPERTS + 1];
  exclusive_prefix(prefix, counts, L);
  const WarpGrid g = warp_grid();
  const bool vec = (((u64)x | (u64)y | (hidden * 2u)) & 15u) == 0;
  const u32 vec_elems = vec ? hidden / 8u * 8u : 0u;
  for (u32 q = g.warp; q < prefix[L]; q += g.warps) {
    const u64 row = received_row(prefix, L, capacity, q) * hidden;
    for (u32 c = g.lane * 8u; c < vec_elems; c += A2A_WARP_SIZE * 8u) {
      vec16 v = *reinterpret_cast<const vec16*>(x + row + c);
      u32* w = &v.x;
      for (int i = 0; i < 4; ++i)
        w[i] = (u32)Fmt::store(Fmt::load((u16)(w[i] & 0xffffu)) * scale) |
               ((u32)Fmt::store(Fmt::load((u16)(w[i] >> 16)) * scale) << 16);
      *reinterpret_cast<vec16*>(y + row + c) = v;
    }
    for (u32 c = vec_elems + g.lane; c < hidden; c += A2A_WARP_SIZE)
      y[row + c] = Fmt::store(Fmt::load(x[row + c]) * scale);
  }
}

extern "C" __global__ void expert_scale_f16(u64 x, u64 y, u64 counts, u32 L, u32 capacity, u32 hidden,
                                            float scale) {
  scale_rows<F16>((const u16*)x, (u16*)y, (const i32*)counts, L, capacity, hidden, scale);
}
extern "C" __global__ void expert_scale_bf16(u64 x, u64 y, u64 counts, u32 L, u32 capacity, u32 hidden,
                                             float scale) {
  scale_rows<BF16>((const u16*)x, (u16*)y, (const i32*)counts, L, capacity, hidden, scale);
}
