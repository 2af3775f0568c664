// Expert-parallel dispatch and combine over the symmetric heap.
//
// dispatch (one kernel):
//   1. headers: block 0 writes this rank's routing rows and token count T
//      into every peer's inbox as tagged words (protocol.h: value and epoch
//      in one atomic 8-byte store, so no fence and no flag);
//   2. send: each token that another rank needs is either staged, segment
//      by segment, in our own symmetric heap, each segment's flag released
//      into the memory of every rank that needs it, or, in a pushed call
//      (below), written straight into those ranks' inboxes;
//   3. receive: every (source, token) waits for its routing row, keeps a
//      decoded copy, reserves rows for its experts here with local atomics
//      (meta: src_rank, src_token, src_k; and, as tagged words, where each
//      slot went); each segment of the token then waits for its flag (in our
//      memory) and is read ONCE over the link (not once per expert), or for
//      its pushed words, and is fanned out to its experts' rows of the
//      expert-major output;
//   4. the last warp to finish reserving publishes expert_num_tokens and
//      zeroes the counters for the next call, while the others fan out.
// combine (one kernel):
//   1. block 0 sends this rank's weights to every peer as tagged words;
//   2. for every peer's token with experts here: one contribution for the
//      owner, segment by segment: the raw expert row when the token has one
//      expert here (times the call's expert_scale, rounded to its format; the
//      owner weights it), else the fp32 sum of w * scale * row over its
//      experts here (rounded to the output's format when the caller
//      asked for narrow partials: half the bytes, one more rounding); left
//      in our own memory with a flag released into the owner's memory, or
//      pushed into the owner's inbox;
//   3. every token of ours is reduced as soon as its contributions are in:
//      our own experts' rows straight from expert_y, each peer's
//      contribution read from that peer's memory or from our inbox; fp32
//      accumulation, one rounding to the output dtype.
// In calls that stage, bulk data is pulled, never pushed; flags are pushed.
// A flag's release then waits only for writes to our own memory (a release
// after bulk stores to a peer waits for every store queued on the link:
// under load that cost tens of microseconds per flag in an earlier push
// design), and every wait polls local memory, not the link.
//
// Pushed calls. Pulling costs a chain of dependent link crossings (a flag
// release that waits for the staging copy, the flag's trip, then a read's
// round trip), which sets the time of small calls. A rank whose call has at
// most push_max_tokens tokens instead pushes its tokens, and later receives
// its contributions, as tagged words (value and epoch in one 8-byte word,
// like the headers): one crossing, no fence, no flag, at twice the bytes.
// The sender's choice travels in its token-count header (A2A_PUSHED), so the
// receivers of its tokens and the contributors to its tokens follow it.
//
// Flags and tagged words carry the call's epoch (never 0), so nothing is
// reset between calls. Headers, staged and pushed tokens alternate by epoch
// parity: a fast peer's next
// call cannot overwrite what a slow rank is still reading, since that peer's
// next-but-one dispatch needs our next header, which we send only after this
// call's combine is done. The other buffers (weights, contributions, pushed
// or not) are read by their readers before the barrier that the next call's
// headers form.
#include "profile.h"
#include "protocol.h"

struct A2AArgs {
  HeapView heap;
  // written by peers
  u64 off_tok_hdr;         // u64 [2][W][M][k]             tagged routing rows of every source
  u64 off_tok_count;       // u64 [2][W]                   tagged T of every source
  u64 off_w_in;            // u64 [W][M][k]                tagged weights of src's tokens (combine)
  u64 off_stage_flag;      // u32 [2][W][M][S]             epoch: segment s of src's staged token t is in
  u64 off_contrib_flag;    // u32 [W][M][S]                epoch: segment s of r's contribution to our t is in
  // read by peers
  u64 off_stage;           // u8  [2][M][x_row_bytes]      our tokens, for peers to pull
  u64 off_contrib;         // u8  [W][M][hidden * 4]       our contribution to token t of owner src
  // written by peers, pushed calls (see "Pushed calls" below)
  u64 off_push_tok;        // u64 [2][W][P][x_row_bytes/4] tagged words of src's token t
  u64 off_push_contrib;    // u64 [W][P][push_row_words]   tagged words of r's contribution to our t
  // local
  u64 off_recv_x;          // u8  [L][W*M][x_row_bytes]    expert_x
  u64 off_recv_meta;       // i32 [L][W*M][3]              expert_meta
  u64 off_counters;        // u32 [L]
  u64 off_num_tokens;      // i32 [L]                      expert_num_tokens
  u64 off_rows;            // i32 [W][M][k]                routing rows by (src, t), decoded, ours too
  u64 off_slot_of;         // i32 [W][M][k]                row of (src, t, j) in expert_x
  u64 off_slot_tag;        // u64 [W][M][k]                slot_of as tagged words, for the fan-out (this kernel)
  u64 off_arrived;         // u32 [1]                      warps that made their reservations (dispatch)
  u64 off_epoch;           // u32 [2]                      [0] last combined call, [1] last dispatched
  u64 off_status;          // u32 [4]                      first error of this rank
  u64 off_done;            // u32 [2]                      blocks done: [0] dispatch, [1] combine
  u64 host_status;         // u32 [4]                      its mirror in pinned host memory
  u64 prof;                // ProfBuffer*                  timelines (profiling build; 0 = off)
  i32 num_experts;
  i32 local_experts;
  i32 top_k;
  i32 max_tokens;
  i32 hidden;
  u32 x_row_bytes;
  u32 y_row_bytes;
  u32 seg_elems;           // a row moves as S = ceil(hidden / seg_elems) segments, one warp each
  u32 nseg;
  u32 push_max_tokens;     // P: a call of at most this many tokens pushes (0: never)
  u32 push_row_words;      // a pushed contribution's row: hidden rounded up to whole segments
  u32 narrow_partials;     // 1: partial sums cross in the output's 16-bit format, not fp32
  u32 trap_on_timeout;     // 1: a timeout aborts the kernel (on_timeout="trap")
  u32 pad;
  u64 timeout_ns;
};

struct DispatchCall {
  u64 x;          // [T][x_row_bytes]
  u64 indices;    // i32 [T][k]
  i32 num_tokens;
  u32 pad;
};

struct CombineCall {
  u64 expert_y;   // [L][W*M][y_row_bytes], local
  u64 weights;    // f32 [T][k]
  u64 out;        // [T][hidden]
  i32 num_tokens;
  float expert_scale;  // our expert rows count as expert_y * this (a fused elementwise epilogue; 1: none)
};

// The call's epoch lives on the device, not in the arguments, so a captured
// graph replays with a fresh epoch each time. Dispatch takes the successor of
// epoch[0] and leaves it in epoch[1]; its combine takes epoch[1] and leaves it
// in epoch[0]. No kernel writes the word it reads, so every block of a launch
// sees the same value (the previous launch wrote it). Never 0 (flags start
// zeroed), and odd and even alternate even across the wrap (inbox parity).
A2A_DEVICE u32 next_epoch(u32 e) { return e % 0xFFFFFFFEu + 1u; }

A2A_DEVICE u32 take_epoch(const A2AArgs& a, bool dispatch) {
  u32* words = sym<u32>(a.heap, a.heap.rank, a.off_epoch);
  const u32 e = dispatch ? next_epoch(a2a_load_relaxed_sys(&words[0])) : a2a_load_relaxed_sys(&words[1]);
  if (a2a_block() == 0 && a2a_thread() == 0) words[dispatch ? 1 : 0] = e;
  return e;
}

#define A2A_MAX_LOCAL_EXPERTS 1024  // the fake expert's prefix of the counts, in shared memory
#define A2A_MAX_WARPS_PER_BLOCK 32
#define A2A_MAX_BLOCK_THREADS 512  // MAX_BLOCK_THREADS in pyhipa2a/a2a.py
#define A2A_MAX_WORLD 32
#define A2A_PREFIX_WORDS (A2A_MAX_WORLD + 3)  // source_prefix's table
#define A2A_CHUNKS 4  // 8-element chunks per lane whose loads are issued together

struct WarpGrid {
  u32 lane, warp, warps, warp_in_block, warps_per_block;
};

A2A_DEVICE WarpGrid warp_grid() {
  const u32 per_block = a2a_block_dim() / A2A_WARP_SIZE, in_block = a2a_thread() / A2A_WARP_SIZE;
  return {a2a_lane(), a2a_block() * per_block + in_block, a2a_grid_dim() * per_block, in_block, per_block};
}

// Everything a kernel needs to know about this call, resolved once.
struct Ctx {
  const A2AArgs& a;
  HeapView h;
  u32 *status, *mirror;
  u64 prof;
  u64 deadline;
  u32 W, M, k, L, capacity, parity, epoch;
};

A2A_DEVICE Ctx make_ctx(const A2AArgs& a, u32 epoch) {
  return {a, a.heap, sym<u32>(a.heap, a.heap.rank, a.off_status), reinterpret_cast<u32*>(a.host_status),
          a.prof, a2a_clock_ns() + a.timeout_ns, (u32)a.heap.world, (u32)a.max_tokens, (u32)a.top_k,
          (u32)a.local_experts, (u32)(a.heap.world * a.max_tokens), epoch & 1u, epoch};
}

// Every error a kernel of this file sees goes through here: the first one is
// kept (protocol.h), and with on_timeout="trap" a timeout then aborts the
// kernel, which leaves the process's device context unusable: every later
// device operation fails loudly, for callers that never synchronize.
A2A_DEVICE void report(const Ctx& x, u32 code, u32 peer, u32 what, u32 detail) {
  // Only the first reporter traps, once its report is in the host's mirror: a thread that traps
  // while another is still writing the mirror would leave the host an error it cannot name.
  if (a2a_report(x.status, x.mirror, code, peer, what, detail) && code == A2A_ERR_TIMEOUT && x.a.trap_on_timeout)
    a2a_trap();
}

// Every block calls this last, with its call's outputs. The last block to
// finish sees every other block's writes; when this rank's status holds an
// error (this call's, or an earlier one's that this call could not repair),
// it overwrites the outputs with all-ones bytes: NaN in every float format we
// write, -1 in the counts and the meta. A consumer that reads without asking
// then sees poison, not plausible data.
struct Poison {
  u8* p;
  u64 bytes;
};
template <u32 N>
A2A_DEVICE void poison_if_failed(const Ctx& x, u32 which, const Poison (&outputs)[N]) {
  if (!a2a_last_block(sym<u32>(x.h, x.h.rank, x.a.off_done) + which, false)) return;
  if (a2a_load_relaxed_sys(&x.status[0]) == A2A_OK) return;
  for (u32 i = 0; i < N; ++i) a2a_fill_bytes(outputs[i].p, outputs[i].bytes, 0xffu);
}

// Lane 0 polls, the warp follows: true once *flag == epoch; on timeout the
// report names `peer` and what was awaited.
A2A_DEVICE bool warp_wait(const Ctx& x, const u32* flag, u32 peer, u32 what, u32 detail, u32 lane) {
  int ok = 1;
  if (lane == 0 && !a2a_wait_flag(flag, x.epoch, x.deadline, x.status)) {
    report(x, A2A_ERR_TIMEOUT, peer, what, detail);
    ok = 0;
  }
  ok = a2a_shfl(ok, 0);
  a2a_wave_sync();
  return ok != 0;
}

// True in every lane when any lane below k has `flag` set.
A2A_DEVICE bool warp_any(bool flag, u32 lane, u32 k) {
  int any = 0;
  for (u32 i = 0; i < k; ++i) any |= a2a_shfl(flag && lane < k ? 1 : 0, (int)i);
  return any != 0;
}

// True in every lane when `ok` holds in every lane of the warp.
A2A_DEVICE bool warp_all(bool ok, u32 lane) {
  int all = ok ? 1 : 0;
  for (u32 d = 1; d < A2A_WARP_SIZE; d <<= 1) all &= a2a_shfl(all, (int)(lane ^ d));
  return all != 0;
}

// A routing row spread over a warp: lane j (< k) holds slot j's expert and
// whether it is valid. The contract says a row's experts are distinct and in
// [0, E); a slot that breaks it is skipped by senders and receivers alike
// (and reported by the owner), never written: a repeated expert could
// overflow its rows. All lanes load at once: one memory latency, not k.
struct RowSlot {
  i32 e;
  bool valid;
};

A2A_DEVICE RowSlot row_slot(i32 e, u32 lane, u32 k, i32 num_experts) {
  bool valid = lane < k && e >= 0 && e < num_experts;
  for (u32 i = 0; i < k; ++i) {
    const i32 other = a2a_shfl(e, (int)i);
    if (i < lane && other == e) valid = false;
  }
  return {e, valid};
}

A2A_DEVICE RowSlot load_row_slot(const i32* row, u32 lane, u32 k, i32 num_experts) {
  return row_slot(lane < k ? row[lane] : -1, lane, k, num_experts);
}

// Bit j set, in every lane: slot j is valid and lives on rank r.
A2A_DEVICE u32 slots_on(const RowSlot& s, u32 k, u32 L, u32 r) {
  u32 bits = 0;
  for (u32 i = 0; i < k; ++i) bits |= (u32)a2a_shfl(s.valid && (u32)s.e / L == r ? 1 : 0, (int)i) << i;
  return bits;
}

// Bit r set, in every lane: a valid slot lives on rank r.
A2A_DEVICE u32 ranks_hosting(const RowSlot& s, u32 k, u32 L) {
  u32 bits = 0;
  for (u32 i = 0; i < k; ++i) bits |= (u32)a2a_shfl(s.valid ? (int)(1u << ((u32)s.e / L)) : 0, (int)i);
  return bits;
}

// Lane r gets slots_on(s, k, L, r): every rank's slots at once.
A2A_DEVICE u32 lane_rank_slots(const RowSlot& s, u32 k, u32 L, u32 lane) {
  u32 bits = 0;
  for (u32 i = 0; i < k; ++i) {
    const i32 e = a2a_shfl(s.valid ? s.e : -1, (int)i);
    if (e >= 0 && (u32)e / L == lane) bits |= 1u << i;
  }
  return bits;
}

A2A_DEVICE u32 lowest_bit(u32 bits) { return a2a_ctz(bits); }

// Copy loops keep A2A_INFLIGHT 16-byte loads per lane in flight before the
// first store: a load-store-load chain would wait one full memory (or NVLink)
// latency per 512 bytes a warp moves, which the profiler showed dominating.
#define A2A_INFLIGHT A2A_CHUNKS  // = the 16-byte accesses per lane in one segment

// One warp copies `bytes` from `src` to each of `ndst` destinations
// (dst_base + slots[d] * bytes), reading the source once.
A2A_DEVICE void copy_row_fanout(u8* dst_base, u64 stride, const i32* slots, u32 ndst, const u8* src,
                                u32 bytes, u32 lane) {
  constexpr u32 W = A2A_WARP_SIZE, U = A2A_INFLIGHT;
  u32 done = 0;
  if ((((u64)dst_base | (u64)src | bytes | stride) & 15u) == 0) {
    const vec16* s = reinterpret_cast<const vec16*>(src);
    const u32 n = bytes / 16u;
    u32 i = lane;
    for (; i + (U - 1u) * W < n; i += U * W) {
      vec16 v[U];
      for (u32 u = 0; u < U; ++u) v[u] = s[i + u * W];
      for (u32 d = 0; d < ndst; ++d) {
        vec16* o = reinterpret_cast<vec16*>(dst_base + (u64)slots[d] * stride);
        for (u32 u = 0; u < U; ++u) o[i + u * W] = v[u];
      }
    }
    for (; i < n; i += W) {
      const vec16 v = s[i];
      for (u32 d = 0; d < ndst; ++d) reinterpret_cast<vec16*>(dst_base + (u64)slots[d] * stride)[i] = v;
    }
    done = bytes;
  }
  for (u32 i = done + lane; i < bytes; i += W) {  // unaligned rows: byte by byte
    const u8 v = src[i];
    for (u32 d = 0; d < ndst; ++d) dst_base[(u64)slots[d] * stride + i] = v;
  }
}

// One warp copies `bytes` (any size); 16-byte accesses for the aligned bulk,
// 4-byte ones for a 4-byte-aligned tail (routing rows, weights).
A2A_DEVICE void copy_row(u8* dst, const u8* src, u32 bytes, u32 lane) {
  const i32 zero = 0;
  const bool aligned = (((u64)dst | (u64)src) & 15u) == 0;
  const u32 bulk = aligned ? bytes / 16u * 16u : 0u;
  if (bulk) copy_row_fanout(dst, 0, &zero, 1, src, bulk, lane);
  if ((((u64)dst | (u64)src | bytes) & 3u) == 0) {
    for (u32 i = bulk / 4u + lane; i < bytes / 4u; i += A2A_WARP_SIZE)
      reinterpret_cast<u32*>(dst)[i] = reinterpret_cast<const u32*>(src)[i];
  } else {
    for (u32 i = bulk + lane; i < bytes; i += A2A_WARP_SIZE) dst[i] = src[i];
  }
}

// Byte range [first, first + bytes) of segment `seg` of a row of `row_bytes`
// whose elements are `itemsize` bytes.
struct Segment {
  u32 first, bytes;
};
A2A_DEVICE Segment segment(const Ctx& x, u32 seg, u32 row_bytes, u32 itemsize) {
  const u32 first = seg * x.a.seg_elems * itemsize;
  const u32 end = first + x.a.seg_elems * itemsize;
  return {first, (end < row_bytes ? end : row_bytes) - first};
}

// ------------------------------------------------------------- dispatch ----

// Count header bit: the source pushes this call's tokens (and receives its
// contributions pushed); without it they are staged and pulled.
#define A2A_PUSHED 0x80000000u

// Block 0 writes our routing rows and token count (with A2A_PUSHED when we
// push) into every peer's inbox as tagged words, all threads at once; the
// count goes into our own inbox too, where combine finds our choice.
A2A_DEVICE void send_headers(const Ctx& x, const DispatchCall& c, const WarpGrid& g, bool push) {
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u32 me = (u32)x.h.rank, n = (u32)c.num_tokens * x.k;
  for (u32 r = 0; r < x.W; ++r) {
    A2A_PROF_START(t0);
    u64* rows = sym<u64>(x.h, (int)r, x.a.off_tok_hdr) + ((u64)x.parity * x.W + me) * x.M * x.k;
    for (u32 i = a2a_thread(); r != me && i < n; i += a2a_block_dim())
      a2a_store_relaxed_sys_u64(&rows[i], a2a_tag((u32)indices[i], x.epoch));
    if (a2a_thread() == 0)
      a2a_store_relaxed_sys_u64(sym<u64>(x.h, (int)r, x.a.off_tok_count) + x.parity * x.W + me,
                                a2a_tag((u32)c.num_tokens | (push ? A2A_PUSHED : 0u), x.epoch));
    if (r != me) A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_HEADERS, t0, r);
  }
}

// A step's items start at warp `first` and wrap around the grid. Steps start
// at different warps, so on small calls they run side by side instead of
// queueing in the same warps, and the warps that store to peers (block 0's
// headers, the senders) are not the ones whose releases must wait for those
// stores to land.
A2A_DEVICE u32 first_item(const WarpGrid& g, u32 first) { return (g.warp + g.warps - first % g.warps) % g.warps; }

// Each segment of each token some peer needs is copied into our stage; lane r
// then releases the segment's flag in the memory of peer r when r needs the
// token. The data stays here (the release waits only for our own memory) and
// the flag goes there (the peer polls its own memory, not the link).
A2A_DEVICE void stage_tokens(const Ctx& x, const DispatchCall& c, const WarpGrid& g) {
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u8* tokens = reinterpret_cast<const u8*>(c.x);
  const u32 me = (u32)x.h.rank, rb = x.a.x_row_bytes, S = x.a.nseg, itemsize = rb / (u32)x.a.hidden;
  u8* stage = sym<u8>(x.h, (int)me, x.a.off_stage) + (u64)x.parity * x.M * rb;
  for (u32 item = first_item(g, g.warps_per_block); item < (u32)c.num_tokens * S; item += g.warps) {
    const u32 t = item / S, seg = item % S;
    const RowSlot lane_slot = load_row_slot(indices + (u64)t * x.k, g.lane, x.k, x.a.num_experts);
    const u32 peers = ranks_hosting(lane_slot, x.k, x.L) & ~(1u << me);
    if (!peers) continue;
    A2A_PROF_START(t0);
    const Segment sg = segment(x, seg, rb, itemsize);
    copy_row(stage + (u64)t * rb + sg.first, tokens + (u64)t * rb + sg.first, sg.bytes, g.lane);
    a2a_wave_sync();
    if (g.lane < x.W && (peers >> g.lane & 1u)) {  // (a 64-lane wave must not shift by 32 or more)
      u32* flag = sym<u32>(x.h, (int)g.lane, x.a.off_stage_flag) + (((u64)x.parity * x.W + me) * x.M + t) * S + seg;
      a2a_store_release_sys(flag, x.epoch);
    }
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_STAGE, t0, me | t << 8);
  }
}

// Pushed rows move as 32-bit words: a lane owns words w0 + lane + i * warp,
// i < A2A_LANE_WORDS, of a segment starting at word w0 (a segment of a 16-bit
// row is A2A_LANE_WORDS words per lane), so each of a warp's accesses covers
// contiguous words. How many of them lie before `end`:
#define A2A_LANE_WORDS (A2A_CHUNKS * 4u)
A2A_DEVICE u32 lane_words(u32 first, u32 end) {
  if (first >= end) return 0u;
  const u32 n = (end - first + A2A_WARP_SIZE - 1u) / A2A_WARP_SIZE;
  return n < A2A_LANE_WORDS ? n : A2A_LANE_WORDS;
}

// True once the lane's `count` tagged words p[i * stride] carry the call's
// epoch (their values in v); false on timeout (reported, naming `peer`) or
// when this rank already failed. A word is read whole, so seeing the epoch
// is seeing the value: no fence, no flag.
template <u32 N>
A2A_DEVICE bool take_tagged(const Ctx& x, const u64* p, u32 stride, u32 count, u32 (&v)[N], u32 peer, u32 what,
                            u32 detail) {
  for (u32 spins = 1;; ++spins) {
    bool all = true;
    for (u32 i = 0; i < N; ++i) {
      if (i >= count) break;
      const u64 w = a2a_load_relaxed_sys_u64(p + (u64)i * stride);
      v[i] = (u32)w;
      all = all && (u32)(w >> 32) == x.epoch;
    }
    if (all) return true;
    if ((spins & 63u) == 0) {
      if (a2a_clock_ns() > x.deadline) {
        report(x, A2A_ERR_TIMEOUT, peer, what, detail);
        return false;
      }
      if (a2a_load_relaxed_sys(&x.status[0]) != A2A_OK) return false;
    }
    a2a_pause();
  }
}

// A pushed call: each segment of each token some peer needs goes straight
// into those peers' inboxes as tagged words; nothing is staged or flagged.
A2A_DEVICE void push_tokens(const Ctx& x, const DispatchCall& c, const WarpGrid& g) {
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u32 me = (u32)x.h.rank, words = x.a.x_row_bytes / 4u, S = x.a.nseg, P = x.a.push_max_tokens;
  for (u32 item = first_item(g, g.warps_per_block); item < (u32)c.num_tokens * S; item += g.warps) {
    const u32 t = item / S, seg = item % S;
    const RowSlot lane_slot = load_row_slot(indices + (u64)t * x.k, g.lane, x.k, x.a.num_experts);
    const u32 peers = ranks_hosting(lane_slot, x.k, x.L) & ~(1u << me);
    if (!peers) continue;
    A2A_PROF_START(t0);
    const u32 first = seg * A2A_LANE_WORDS * A2A_WARP_SIZE + g.lane, n = lane_words(first, words);
    const u32* token = reinterpret_cast<const u32*>(c.x) + (u64)t * words + first;
    u32 v[A2A_LANE_WORDS];
    for (u32 i = 0; i < A2A_LANE_WORDS; ++i)
      if (i < n) v[i] = token[i * A2A_WARP_SIZE];
    for (u32 bits = peers; bits; bits &= bits - 1u) {
      const u32 r = lowest_bit(bits);
      u64* inbox = sym<u64>(x.h, (int)r, x.a.off_push_tok) + (((u64)x.parity * x.W + me) * P + t) * words + first;
      for (u32 i = 0; i < A2A_LANE_WORDS; ++i)
        if (i < n) a2a_store_relaxed_sys_u64(&inbox[i * A2A_WARP_SIZE], a2a_tag(v[i], x.epoch));
    }
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_STAGE, t0, me | t << 8);
  }
}

// Token counts of every source as a prefix: pre[src] = tokens of sources
// before src, pre[W] = all of them, pre[W + 1] the mask of sources that
// push and pre[W + 2] the most tokens of any source; `pre` is the block's
// (shared memory, A2A_PREFIX_WORDS), every warp of the block calls.
// Warp 0's lane r waits for r's header (when `wait`: dispatch, where our own
// is `my_header`; combine reads every header, ours too, as dispatch left
// them): one poller per block, not per warp, on the words peers write. Item
// spaces below are over tokens that exist, not over W * M slots (dense for
// the reservations; sources times the most tokens of any source for the
// token-major bulk steps): a call with one token per rank costs one item
// (or segment) per rank.
A2A_DEVICE bool source_prefix(const Ctx& x, u32 my_header, u32* pre, bool wait, const WarpGrid& g) {
  const u32 me = (u32)x.h.rank, lane = g.lane;
  if (g.warp_in_block == 0) {
    if (lane < x.W) {
      u32 n = 0;
      if (wait && lane == me) {
        n = my_header;
      } else {
        A2A_PROF_START(t0);
        const u64* count = sym<u64>(x.h, (int)me, x.a.off_tok_count) + x.parity * x.W + lane;
        if (!wait) {
          n = (u32)a2a_load_relaxed_sys_u64(count);  // dispatch saw it arrive
        } else if (!a2a_wait_tagged(count, x.epoch, x.deadline, x.status, n)) {
          report(x, A2A_ERR_TIMEOUT, lane, A2A_WAIT_DISPATCH, x.epoch);
          n = 0;
        }
        if (wait) A2A_PROF(x.prof, 0, A2A_TAG_DISPATCH_WAIT_HEADER, t0, lane);
      }
      pre[lane + 1] = n;
    }
    a2a_wave_sync();
    if (lane == 0) {
      u32 pushed = 0, most = 0;
      pre[0] = 0;
      for (u32 r = 1; r <= x.W; ++r) {
        const u32 n = (pre[r] & ~A2A_PUSHED) < x.M ? pre[r] & ~A2A_PUSHED : x.M;
        if (pre[r] & A2A_PUSHED) pushed |= 1u << (r - 1u);
        pre[r] = pre[r - 1] + n;
        most = n > most ? n : most;
      }
      pre[x.W + 1] = pushed;
      pre[x.W + 2] = most;
    }
  }
  a2a_block_sync();
  return a2a_shfl(lane == 0 ? (int)a2a_load_relaxed_sys(&x.status[0]) : 0, 0) == 0;
}

// Item q of a dense (source, token) space: its source and token.
A2A_DEVICE void locate(const u32* pre, u32 W, u32 q, u32& src, u32& t) {
  src = 0;
  while (src + 1u < W && pre[src + 1u] <= q) ++src;
  t = q - pre[src];
}

// Item q of a token-major space over n sources from `first` on (mod W): token
// q / n of source first + q % n; false when that source has fewer tokens (a
// gap: the space is n * the most tokens of any source). Bulk steps walk
// their tokens this way: all sources at once, each rank starting with its
// successor. Source-major order had every rank pulling from rank 0's memory
// first, then rank 1's, so one rank's links carried the whole wave while the
// others idled (it did not matter with two ranks).
A2A_DEVICE bool token_major(const u32* pre, u32 W, u32 first, u32 n, u32 q, u32& src, u32& t) {
  src = (first + q % n) % W;
  t = q / n;
  return t < pre[src + 1] - pre[src];
}

// The vector of token t of source src: ours straight from the caller, a
// peer's from its stage, over the link.
A2A_DEVICE const u8* token_vector(const Ctx& x, const DispatchCall& c, u32 src, u32 t) {
  const u32 rb = x.a.x_row_bytes;
  if (src == (u32)x.h.rank) return reinterpret_cast<const u8*>(c.x) + (u64)t * rb;
  return sym<u8>(x.h, (int)src, x.a.off_stage) + ((u64)x.parity * x.M + t) * rb;
}

// One warp per (src, t): lane j waits for slot j of the routing row (a peer's
// arrives as tagged words), keeps the decoded row for the fan-out and for
// combine, and reserves the expert row of slot j when that expert is ours
// (local atomics), writing its meta and slot_of (-1: not ours). The copiers of
// the token's segments poll a tagged copy of slot_of (value and epoch in one
// word): no flag, so no release, which would wait for every store this warp
// still has in flight, the headers' stores to peers included.
A2A_DEVICE bool reserve_rows(const Ctx& x, const DispatchCall& c, const WarpGrid& g, const u32* pre) {
  const u32 me = (u32)x.h.rank;
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u64* inbox = sym<u64>(x.h, (int)me, x.a.off_tok_hdr) + (u64)x.parity * x.W * x.M * x.k;
  u32* counters = sym<u32>(x.h, (int)me, x.a.off_counters);
  i32* meta = sym<i32>(x.h, (int)me, x.a.off_recv_meta);
  i32* rows = sym<i32>(x.h, (int)me, x.a.off_rows);
  i32* slot_of = sym<i32>(x.h, (int)me, x.a.off_slot_of);
  u64* slot_tag = sym<u64>(x.h, (int)me, x.a.off_slot_tag);
  bool reserved = false;  // whether this warp wrote anything the counts' publisher reads
  for (u32 item = first_item(g, g.warps / 4u); item < pre[x.W]; item += g.warps) {
    reserved = true;
    u32 src, t;
    locate(pre, x.W, item, src, t);
    const u64 at = ((u64)src * x.M + t) * x.k;
    i32 e = -1;
    bool ok = true;
    if (g.lane < x.k) {
      if (src == me) {
        e = indices[(u64)t * x.k + g.lane];
      } else {
        A2A_PROF_START(t0);
        u32 v = 0;
        ok = a2a_wait_tagged(&inbox[at + g.lane], x.epoch, x.deadline, x.status, v);
        if (!ok) report(x, A2A_ERR_TIMEOUT, src, A2A_WAIT_DISPATCH, x.epoch);
        e = (i32)v;
        if (g.lane == 0) A2A_PROF(x.prof, 0, A2A_TAG_DISPATCH_WAIT_HEADER, t0, src | t << 8);
      }
      rows[at + g.lane] = e;
    }
    if (warp_any(!ok, g.lane, x.k)) break;
    const RowSlot lane_slot = row_slot(e, g.lane, x.k, x.a.num_experts);
    const u32 here = slots_on(lane_slot, x.k, x.L, me);
    if (g.lane < x.k) {
      if (src == me && !lane_slot.valid)
        report(x, A2A_ERR_BAD_INDEX, me, t * x.k + g.lane, (u32)e);
      i32 slot = -1;
      if (here >> g.lane & 1u) {
        const u32 l = (u32)e % x.L;
        const u32 s = a2a_fetch_add_dev(&counters[l], 1u);
        if (s < x.capacity) {
          slot = (i32)(l * x.capacity + s);
          meta[(u64)slot * 3u] = (i32)src;
          meta[(u64)slot * 3u + 1u] = (i32)t;
          meta[(u64)slot * 3u + 2u] = (i32)g.lane;
        } else {
          report(x, A2A_ERR_CAPACITY, me, l, s);
        }
      }
      slot_of[at + g.lane] = slot;  // for combine (the next kernel)
      a2a_store_relaxed_sys_u64(&slot_tag[at + g.lane], a2a_tag((u32)slot, x.epoch));
    }
  }
  return reserved;
}

// Each segment of each (src, t) with experts here is copied by one warp to
// all of its expert rows, as soon as the slots and the segment are in: a
// staged segment is read over the link once its flag is here, a pushed one
// from our inbox once its words carry the epoch.
A2A_DEVICE void fan_out(const Ctx& x, const DispatchCall& c, const WarpGrid& g, const u32* pre) {
  __shared__ i32 slot_buf[A2A_MAX_WARPS_PER_BLOCK][32];
  i32* slots = slot_buf[g.warp_in_block];
  const u32 me = (u32)x.h.rank, rb = x.a.x_row_bytes, S = x.a.nseg, itemsize = rb / (u32)x.a.hidden;
  const u32 pushed = pre[x.W + 1], words = rb / 4u;
  const u64* slot_tag = sym<u64>(x.h, (int)me, x.a.off_slot_tag);
  u8* expert_x = sym<u8>(x.h, (int)me, x.a.off_recv_x);
  for (u32 item = first_item(g, g.warps / 2u); item < pre[x.W + 2] * x.W * S; item += g.warps) {
    u32 src, t;
    if (!token_major(pre, x.W, me + 1u, x.W, item / S, src, t)) continue;
    const u32 seg = item % S;
    A2A_PROF_START(t1);
    // Lane j waits for slot j's row (-1: not an expert of ours, or lost to a reported error).
    u32 slot_word[1] = {~0u};
    const bool known = g.lane >= x.k || take_tagged(x, &slot_tag[((u64)src * x.M + t) * x.k + g.lane], 1u, 1u,
                                                    slot_word, me, A2A_WAIT_DISPATCH, t);
    if (!warp_all(known, g.lane)) break;
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_SLOT, t1, src | t << 8);
    A2A_PROF_START(t3);
    const i32 slot = (i32)slot_word[0];
    u32 n = 0;
    for (u32 j = 0; j < x.k; ++j) {
      const i32 s = a2a_shfl(slot, (int)j);
      if (s >= 0) {
        if (g.lane == 0) slots[n] = s;
        ++n;
      }
    }
    if (!n) continue;
    if (src != me && (pushed >> src & 1u)) {
      const u32 first = seg * A2A_LANE_WORDS * A2A_WARP_SIZE + g.lane, count = lane_words(first, words);
      const u64* inbox = sym<u64>(x.h, (int)me, x.a.off_push_tok) +
                         (((u64)x.parity * x.W + src) * x.a.push_max_tokens + t) * words + first;
      u32 v[A2A_LANE_WORDS];
      const bool ok = take_tagged(x, inbox, A2A_WARP_SIZE, count, v, src, A2A_WAIT_DISPATCH, t);
      if (!warp_all(ok, g.lane)) break;
      A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_TOKEN, t3, src | t << 8);
      A2A_PROF_START(t2);
      a2a_wave_sync();
      for (u32 d = 0; d < n; ++d) {
        u32* row = reinterpret_cast<u32*>(expert_x + (u64)slots[d] * rb) + first;
        for (u32 i = 0; i < A2A_LANE_WORDS; ++i)
          if (i < count) row[i * A2A_WARP_SIZE] = v[i];
      }
      a2a_wave_sync();  // slots[] is reused by this warp's next item
      A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_FANOUT, t2, src | t << 8);
      continue;
    }
    const u32* staged = sym<u32>(x.h, (int)me, x.a.off_stage_flag) + (((u64)x.parity * x.W + src) * x.M + t) * S + seg;
    if (src != me && !warp_wait(x, staged, src, A2A_WAIT_DISPATCH, t, g.lane)) break;
    if (src != me) A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_TOKEN, t3, src | t << 8);
    A2A_PROF_START(t2);
    a2a_wave_sync();
    const Segment sg = segment(x, seg, rb, itemsize);
    const u8* vec = token_vector(x, c, src, t);
    copy_row_fanout(expert_x + sg.first, rb, slots, n, vec + sg.first, sg.bytes, g.lane);
    a2a_wave_sync();  // slots[] is reused by this warp's next item
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_FANOUT, t2, src | t << 8);
  }
}

// The warps that reserved rows (the first min(warps, tokens) from the
// reservations' first warp on) check in once their reservations are made;
// the last one publishes expert_num_tokens (every reservation is in by then)
// and zeroes the counters and itself for the next call, while the others fan
// out. With no token anywhere, the reservations' first warp publishes the
// zeros. Warps without reservations stay off the counter: on small calls
// thousands of them would queue on one address.
A2A_DEVICE void publish_counts_if_last(const Ctx& x, const WarpGrid& g, const u32* pre, bool reserved) {
  u32* arrived = sym<u32>(x.h, x.h.rank, x.a.off_arrived);
  const u32 checkins = pre[x.W] < g.warps ? pre[x.W] : g.warps;
  A2A_PROF_START(t0);
  int last = 0;
  if (checkins == 0) {
    last = first_item(g, g.warps / 4u) == 0u;
  } else {
    if (!reserved) return;
    a2a_wave_sync();  // the warp's reservations come before its check-in
    if (g.lane == 0) last = a2a_fetch_add_acq_rel_dev(arrived, 1u) == checkins - 1u;
  }
  if (!a2a_shfl(last, 0)) return;
  u32* counters = sym<u32>(x.h, x.h.rank, x.a.off_counters);
  i32* num_tokens = sym<i32>(x.h, x.h.rank, x.a.off_num_tokens);
  for (u32 l = g.lane; l < x.L; l += A2A_WARP_SIZE) {
    const u32 n = counters[l];
    num_tokens[l] = (i32)(n < x.capacity ? n : x.capacity);
    counters[l] = 0u;
  }
  if (g.lane == 0) *arrived = 0u;  // nobody else touches it until the next launch
  A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_COUNTS, t0, 0);
}

extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) a2a_dispatch(A2AArgs a, DispatchCall c) {
  const Ctx x = make_ctx(a, take_epoch(a, true));
  const WarpGrid g = warp_grid();
  A2A_PROF_START(t0);
  // Pushed words are read 4 bytes at a time (the host only enables pushing
  // for rows that are whole words).
  const bool push = (u32)c.num_tokens <= a.push_max_tokens && (c.x & 3u) == 0;
  if (a2a_block() == 0) send_headers(x, c, g, push);
  if (push)
    push_tokens(x, c, g);
  else
    stage_tokens(x, c, g);
  __shared__ u32 pre[A2A_PREFIX_WORDS];
  const bool ok = source_prefix(x, (u32)c.num_tokens | (push ? A2A_PUSHED : 0u), pre, true, g);
  const bool reserved = ok && reserve_rows(x, c, g, pre);
  if (ok) publish_counts_if_last(x, g, pre, reserved);
  if (ok) fan_out(x, c, g, pre);
  A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WARP, t0, 0);
  const u64 rows = (u64)x.L * x.capacity;
  const Poison outputs[3] = {{sym<u8>(x.h, x.h.rank, a.off_recv_x), rows * a.x_row_bytes},
                             {sym<u8>(x.h, x.h.rank, a.off_recv_meta), rows * 12u},
                             {sym<u8>(x.h, x.h.rank, a.off_num_tokens), (u64)x.L * 4u}};
  poison_if_failed(x, 0u, outputs);
}

// -------------------------------------------------------------- combine ----

// Element access for the two 16-bit formats combine reduces.
struct F16 {
  static A2A_DEVICE float load(u16 v) { return a2a_half_to_float(v); }
  static A2A_DEVICE u16 store(float f) { return a2a_float_to_half(f); }
};
struct BF16 {
  static A2A_DEVICE float load(u16 v) { return a2a_bf16_to_float(v); }
  static A2A_DEVICE u16 store(float f) { return a2a_float_to_bf16(f); }
};


// The 8 16-bit values in v, each times `scale`, rounded back to the format.
template <typename Fmt>
A2A_DEVICE vec16 scale8(vec16 v, float scale) {
  u32* w = &v.x;
  for (int i = 0; i < 4; ++i)
    w[i] = (u32)Fmt::store(Fmt::load((u16)(w[i] & 0xffffu)) * scale) |
           ((u32)Fmt::store(Fmt::load((u16)(w[i] >> 16)) * scale) << 16);
  return v;
}

// acc[0..8) += w * the 8 16-bit values in v.
template <typename Fmt>
A2A_DEVICE void fma8v(float* acc, float w, const vec16& v) {
  const u32 words[4] = {v.x, v.y, v.z, v.w};
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] += w * Fmt::load((u16)(words[q] & 0xffffu));
    acc[2 * q + 1] += w * Fmt::load((u16)(words[q] >> 16));
  }
}

A2A_DEVICE void add8v(float* acc, const vec16& a, const vec16& b) {
  const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  for (int q = 0; q < 8; ++q) acc[q] += __builtin_bit_cast(float, w[q]);
}

A2A_DEVICE void store8f(float* p, const float* acc) {
  vec16* o = reinterpret_cast<vec16*>(p);
  o[0] = vec16{__builtin_bit_cast(u32, acc[0]), __builtin_bit_cast(u32, acc[1]), __builtin_bit_cast(u32, acc[2]),
               __builtin_bit_cast(u32, acc[3])};
  o[1] = vec16{__builtin_bit_cast(u32, acc[4]), __builtin_bit_cast(u32, acc[5]), __builtin_bit_cast(u32, acc[6]),
               __builtin_bit_cast(u32, acc[7])};
}


template <typename Fmt>
A2A_DEVICE void store8(u16* p, const float* acc) {
  vec16 o;
  u32* w = &o.x;
  for (int q = 0; q < 4; ++q) w[q] = (u32)Fmt::store(acc[2 * q]) | ((u32)Fmt::store(acc[2 * q + 1]) << 16);
  *reinterpret_cast<vec16*>(p) = o;
}

// Block 0 writes our weights into every peer's inbox as tagged words.
A2A_DEVICE void send_weights(const Ctx& x, const CombineCall& c, const WarpGrid& g) {
  const u32* weights = reinterpret_cast<const u32*>(c.weights);  // the float's bits travel
  const u32 me = (u32)x.h.rank, n = (u32)c.num_tokens * x.k;
  for (u32 r = 0; r < x.W; ++r) {
    if (r == me) continue;
    A2A_PROF_START(t0);
    u64* w = sym<u64>(x.h, (int)r, x.a.off_w_in) + (u64)me * x.M * x.k;
    for (u32 i = a2a_thread(); i < n; i += a2a_block_dim()) a2a_store_relaxed_sys_u64(&w[i], a2a_tag(weights[i], x.epoch));
    A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_WEIGHTS, t0, r);
  }
}

// acc += sum over the experts j in `bits` of w[j] * scale * (8 * A2A_CHUNKS
// elements of expert_y row slots[j] from e0 on, in steps of a warp's width).
// The next expert's row is loaded before this one's is summed: one memory
// latency per chunk, not one per expert.
template <typename Fmt>
A2A_DEVICE void sum_rows(float (&acc)[A2A_CHUNKS][8], const u16* expert_y, const i32* slots, u32 bits,
                         const float* w, float scale, u32 H, u32 e0, u32 e_end) {
  constexpr u32 U = A2A_CHUNKS, STEP = A2A_WARP_SIZE * 8u;
  vec16 cur[U], nxt[U];
  u32 j = lowest_bit(bits);
  for (u32 u = 0; u < U; ++u)
    if (e0 + u * STEP < e_end) cur[u] = *reinterpret_cast<const vec16*>(expert_y + (u64)slots[j] * H + e0 + u * STEP);
  for (;;) {
    bits &= bits - 1u;
    const u32 jn = bits ? lowest_bit(bits) : j;
    for (u32 u = 0; u < U; ++u)
      if (bits && e0 + u * STEP < e_end)
        nxt[u] = *reinterpret_cast<const vec16*>(expert_y + (u64)slots[jn] * H + e0 + u * STEP);
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < e_end) fma8v<Fmt>(acc[u], w[j] * scale, cur[u]);
    if (!bits) break;
    for (u32 u = 0; u < U; ++u) cur[u] = nxt[u];
    j = jn;
  }
}

// The same for one element e (rows whose length is not a multiple of 8).
template <typename Fmt>
A2A_DEVICE float sum_rows_at(const u16* expert_y, const i32* slots, u32 bits, const float* w, float scale, u32 H,
                             u32 e) {
  float acc = 0.f;
  for (; bits; bits &= bits - 1u)
    acc += w[lowest_bit(bits)] * scale * Fmt::load(expert_y[(u64)slots[lowest_bit(bits)] * H + e]);
  return acc;
}

// Lane j (< k) loads row j of `slot_of` (the token's expert rows here) into
// slots[j] (the warp's shared copy, which the sums read); true in every lane
// when every expert in `bits` got a row (a slot lost to a reported capacity
// error has none).
A2A_DEVICE bool load_slots(i32* slots, const i32* slot_of, u32 bits, u32 k, u32 lane) {
  const i32 slot = lane < k ? slot_of[lane] : 0;
  if (lane < k) slots[lane] = slot;
  const bool ok = warp_all(lane >= k || !(bits >> lane & 1u) || slot >= 0, lane);
  a2a_wave_sync();
  return ok;
}

// One warp writes n 16-bit elements of src, each times `scale` and rounded
// back to the format, to dst: an expert's row through the fused epilogue,
// rounded as the expert's own output would be.
template <typename Fmt>
A2A_DEVICE void copy_row_scaled(u16* dst, const u16* src, u32 n, float scale, u32 lane) {
  constexpr u32 U = A2A_CHUNKS, STEP = A2A_WARP_SIZE * 8u;
  const u32 bulk = (((u64)dst | (u64)src) & 15u) == 0 ? n / 8u * 8u : 0u;
  for (u32 e0 = lane * 8u; e0 < bulk; e0 += U * STEP) {
    vec16 v[U];
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < bulk) v[u] = *reinterpret_cast<const vec16*>(src + e0 + u * STEP);
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < bulk) *reinterpret_cast<vec16*>(dst + e0 + u * STEP) = scale8<Fmt>(v[u], scale);
  }
  for (u32 e = bulk + lane; e < n; e += A2A_WARP_SIZE) dst[e] = Fmt::store(Fmt::load(src[e]) * scale);
}

// Elements [e_begin, e_end) of what rank `me` leaves for a token of a peer:
// its one expert row (times the call's expert_scale, rounded to the row's
// format) for the owner to weight, or the fp32 sum of w * scale * row over its
// experts (narrow partials: that sum rounded to the output's 16-bit format, a
// row like the raw one). `dst` is the token's contribution slot.
template <typename Fmt>
A2A_DEVICE void contribute(const Ctx& x, const u16* expert_y, const i32* slots, u32 here, const float* w,
                           float scale, u8* dst, u32 e_begin, u32 e_end, u32 lane) {
  const u32 H = (u32)x.a.hidden;
  if ((here & (here - 1u)) == 0) {
    const u16* row = expert_y + (u64)slots[lowest_bit(here)] * H;
    if (scale == 1.f)
      copy_row(dst + e_begin * 2u, reinterpret_cast<const u8*>(row + e_begin), (e_end - e_begin) * 2u, lane);
    else
      copy_row_scaled<Fmt>(reinterpret_cast<u16*>(dst) + e_begin, row + e_begin, e_end - e_begin, scale, lane);
    return;
  }
  float* out = reinterpret_cast<float*>(dst);
  u16* narrow = x.a.narrow_partials ? reinterpret_cast<u16*>(dst) : nullptr;
  const bool vec = H % 8u == 0 && ((u64)expert_y & 15u) == 0;
  constexpr u32 U = A2A_CHUNKS, STEP = A2A_WARP_SIZE * 8u;
  for (u32 e0 = e_begin + lane * 8u; vec && e0 < e_end; e0 += U * STEP) {
    float acc[U][8] = {};
    sum_rows<Fmt>(acc, expert_y, slots, here, w, scale, H, e0, e_end);
    for (u32 u = 0; u < U; ++u) {
      if (e0 + u * STEP >= e_end) continue;
      if (narrow)
        store8<Fmt>(narrow + e0 + u * STEP, acc[u]);
      else
        store8f(out + e0 + u * STEP, acc[u]);
    }
  }
  for (u32 e = e_begin + lane; !vec && e < e_end; e += A2A_WARP_SIZE) {
    const float sum = sum_rows_at<Fmt>(expert_y, slots, here, w, scale, H, e);
    if (narrow)
      narrow[e] = Fmt::store(sum);
    else
      out[e] = sum;
  }
}

// Where element e of a pushed contribution travels. Lane l sums elements
// c + 8l .. c + 8l + 7 of each chunk c of A2A_WARP_SIZE * 8 elements (as
// sum_rows does); their fp32 words go to c + i * warp + l (i < 8), or, two
// 16-bit elements a word, to c / 2 + i * warp + l (i < 4): each of a warp's
// stores, and each of the owner's loads, covers contiguous words.
A2A_DEVICE u32 pushed_f32_word(u32 e) {
  constexpr u32 STEP = A2A_WARP_SIZE * 8u;
  return e - e % STEP + e % 8u * A2A_WARP_SIZE + e % STEP / 8u;
}
A2A_DEVICE u32 pushed_pair_word(u32 e) {  // e even
  constexpr u32 STEP = A2A_WARP_SIZE * 8u;
  return (e - e % STEP) / 2u + e / 2u % 4u * A2A_WARP_SIZE + e % STEP / 8u;
}

// 8 consecutive 16-bit elements: one 16-byte load when `vec` (aligned), else
// eight 2-byte loads.
A2A_DEVICE vec16 load8(const u16* p, bool vec) {
  if (vec) return *reinterpret_cast<const vec16*>(p);
  vec16 v;
  u32* w = &v.x;
  for (u32 q = 0; q < 4; ++q) w[q] = (u32)p[2 * q] | (u32)p[2 * q + 1] << 16;
  return v;
}

// contribute() for an owner that pushed its call: the same values, as tagged
// words stored straight into the owner's inbox `dst` (hidden % 8 == 0 when
// pushing, so a lane's 8 elements are all in the row); 16-bit values two a
// word (raw rows, narrow partials), fp32 sums one a word.
template <typename Fmt>
A2A_DEVICE void push_contribution(const Ctx& x, const u16* expert_y, const i32* slots, u32 here, const float* w,
                                  float scale, u64* dst, u32 e_begin, u32 e_end, u32 lane) {
  const u32 H = (u32)x.a.hidden;
  const bool vec = ((u64)expert_y & 15u) == 0;
  constexpr u32 U = A2A_CHUNKS, STEP = A2A_WARP_SIZE * 8u;
  if ((here & (here - 1u)) == 0) {
    const u16* row = expert_y + (u64)slots[lowest_bit(here)] * H;
    for (u32 e = e_begin + lane * 8u; e < e_end; e += STEP) {
      const vec16 v = scale == 1.f ? load8(row + e, vec) : scale8<Fmt>(load8(row + e, vec), scale);
      const u32 words[4] = {v.x, v.y, v.z, v.w};
      u64* o = dst + pushed_pair_word(e);
      for (u32 q = 0; q < 4; ++q) a2a_store_relaxed_sys_u64(&o[q * A2A_WARP_SIZE], a2a_tag(words[q], x.epoch));
    }
    return;
  }
  for (u32 e0 = e_begin + lane * 8u; e0 < e_end; e0 += U * STEP) {
    float acc[U][8] = {};
    if (vec) {
      sum_rows<Fmt>(acc, expert_y, slots, here, w, scale, H, e0, e_end);
    } else {
      for (u32 u = 0; u < U; ++u)
        for (u32 i = 0; i < 8; ++i)
          if (e0 + u * STEP < e_end)
            acc[u][i] = sum_rows_at<Fmt>(expert_y, slots, here, w, scale, H, e0 + u * STEP + i);
    }
    for (u32 u = 0; u < U; ++u) {
      if (e0 + u * STEP >= e_end) continue;
      if (x.a.narrow_partials) {
        u64* o = dst + pushed_pair_word(e0 + u * STEP);
        for (u32 q = 0; q < 4; ++q)
          a2a_store_relaxed_sys_u64(
              &o[q * A2A_WARP_SIZE],
              a2a_tag((u32)Fmt::store(acc[u][2 * q]) | (u32)Fmt::store(acc[u][2 * q + 1]) << 16, x.epoch));
        continue;
      }
      u64* o = dst + pushed_f32_word(e0 + u * STEP);
      for (u32 i = 0; i < 8; ++i)
        a2a_store_relaxed_sys_u64(&o[i * A2A_WARP_SIZE], a2a_tag(__builtin_bit_cast(u32, acc[u][i]), x.epoch));
    }
  }
}

// A warp's scratch in shared memory: a token's expert rows and weights.
struct WarpScratch {
  i32* slots;
  float* w;
};

template <typename Fmt>
A2A_DEVICE void send_contributions(const Ctx& x, const CombineCall& c, const WarpGrid& g, WarpScratch sc) {
  const u32 me = (u32)x.h.rank, H = (u32)x.a.hidden, S = x.a.nseg;
  const u16* expert_y = reinterpret_cast<const u16*>(c.expert_y);
  const i32* rows = sym<i32>(x.h, (int)me, x.a.off_rows);
  const i32* slot_of = sym<i32>(x.h, (int)me, x.a.off_slot_of);
  const u64* w_in = sym<u64>(x.h, (int)me, x.a.off_w_in);
  const u64 stride = (u64)H * 4u;
  __shared__ u32 pre[A2A_PREFIX_WORDS];
  source_prefix(x, 0u, pre, false, g);  // the headers came with dispatch
  const u32 pushed = pre[x.W + 1], peers = x.W - 1u;  // our own tokens are reduced straight from expert_y
  for (u32 item = first_item(g, g.warps_per_block); item < pre[x.W + 2] * peers * S; item += g.warps) {
    a2a_wave_sync();  // the scratch is rewritten for this item
    u32 src, t;
    if (!token_major(pre, x.W, me + 1u, peers, item / S, src, t)) continue;
    const u32 seg = item % S;
    const RowSlot lane_slot = load_row_slot(rows + ((u64)src * x.M + t) * x.k, g.lane, x.k, x.a.num_experts);
    const u32 here = slots_on(lane_slot, x.k, x.L, me);
    if (!here) continue;
    if (!load_slots(sc.slots, slot_of + ((u64)src * x.M + t) * x.k, here, x.k, g.lane))
      continue;  // the owner's wait ends on the reported error
    const u32 e_begin = seg * x.a.seg_elems, e_end = e_begin + x.a.seg_elems < H ? e_begin + x.a.seg_elems : H;
    const float* w = nullptr;  // a single row goes back unweighted: no need to wait for the weights
    if (here & (here - 1u)) {
      A2A_PROF_START(t0);
      bool ok = true;
      if (g.lane < x.k && (here >> g.lane & 1u)) {
        u32 bits = 0;
        ok = a2a_wait_tagged(&w_in[((u64)src * x.M + t) * x.k + g.lane], x.epoch, x.deadline, x.status, bits);
        if (!ok) report(x, A2A_ERR_TIMEOUT, src, A2A_WAIT_WEIGHTS, x.epoch);
        sc.w[g.lane] = __builtin_bit_cast(float, bits);
      }
      if (warp_any(!ok, g.lane, x.k)) break;
      a2a_wave_sync();
      A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_WAIT_WEIGHTS, t0, src | t << 8);
      w = sc.w;
    }
    A2A_PROF_START(t1);
    if (pushed >> src & 1u) {  // straight into the owner's inbox, no flag
      u64* inbox = sym<u64>(x.h, (int)src, x.a.off_push_contrib) +
                   ((u64)me * x.a.push_max_tokens + t) * x.a.push_row_words;
      push_contribution<Fmt>(x, expert_y, sc.slots, here, w, c.expert_scale, inbox, e_begin, e_end, g.lane);
      A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_CONTRIBUTE, t1, src | t << 8);
      continue;
    }
    contribute<Fmt>(x, expert_y, sc.slots, here, w, c.expert_scale,
                    sym<u8>(x.h, (int)me, x.a.off_contrib) + ((u64)src * x.M + t) * stride, e_begin, e_end, g.lane);
    a2a_wave_sync();
    if (g.lane == 0)  // the data stays here, the flag goes to the owner
      a2a_store_release_sys(sym<u32>(x.h, (int)src, x.a.off_contrib_flag) + ((u64)me * x.M + t) * S + seg, x.epoch);
    A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_CONTRIBUTE, t1, src | t << 8);
  }
}

// acc[u] += peer r's part of token t in chunk u (the lane's 8 elements from
// e0 + u * STEP): a raw row times its weight when r hosts one of t's experts
// (`bits`), else a partial sum (fp32, or a 16-bit row when narrow); read from
// r's memory when pulled, from our inbox when pushed (false: its words never
// came, reported). A 16-bit part is `raw` below; a narrow sum's weight is 1.
template <typename Fmt>
A2A_DEVICE bool add_peer_part(const Ctx& x, float (&acc)[A2A_CHUNKS][8], u32 r, u32 t, u32 bits, const float* w,
                              u32 e0, u32 e_end, bool pushed) {
  constexpr u32 U = A2A_CHUNKS, STEP = A2A_WARP_SIZE * 8u;
  const u32 me = (u32)x.h.rank;
  const bool single = (bits & (bits - 1u)) == 0, raw = single || x.a.narrow_partials;
  const float wr = single ? w[lowest_bit(bits)] : 1.f;
  if (pushed) {
    const u64* in = sym<u64>(x.h, (int)me, x.a.off_push_contrib) + ((u64)r * x.a.push_max_tokens + t) * x.a.push_row_words;
    for (u32 u = 0; u < U; ++u) {
      if (e0 + u * STEP >= e_end) continue;
      if (raw) {
        u32 v[4];
        if (!take_tagged(x, in + pushed_pair_word(e0 + u * STEP), A2A_WARP_SIZE, 4, v, r, A2A_WAIT_COMBINE_ROW, t))
          return false;
        fma8v<Fmt>(acc[u], wr, vec16{v[0], v[1], v[2], v[3]});
      } else {
        u32 v[8];
        if (!take_tagged(x, in + pushed_f32_word(e0 + u * STEP), A2A_WARP_SIZE, 8, v, r, A2A_WAIT_COMBINE_ROW, t))
          return false;
        for (u32 i = 0; i < 8; ++i) acc[u][i] += __builtin_bit_cast(float, v[i]);
      }
    }
    return true;
  }
  const u8* part = sym<u8>(x.h, (int)r, x.a.off_contrib) + ((u64)me * x.M + t) * x.a.hidden * 4u;
  if (raw) {
    const u16* row = reinterpret_cast<const u16*>(part);
    vec16 v[U];
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < e_end) v[u] = *reinterpret_cast<const vec16*>(row + e0 + u * STEP);
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < e_end) fma8v<Fmt>(acc[u], wr, v[u]);
  } else {
    const vec16* f = reinterpret_cast<const vec16*>(reinterpret_cast<const float*>(part) + e0);
    for (u32 u = 0; u < U; ++u)
      if (e0 + u * STEP < e_end) add8v(acc[u], f[u * STEP / 4u], f[u * STEP / 4u + 1u]);
  }
  return true;
}

// The same for one element e (rows that are not 16-byte aligned).
template <typename Fmt>
A2A_DEVICE bool add_peer_part_at(const Ctx& x, float& acc, u32 r, u32 t, u32 bits, const float* w, u32 e,
                                 bool pushed) {
  const u32 me = (u32)x.h.rank;
  const bool single = (bits & (bits - 1u)) == 0, raw = single || x.a.narrow_partials;
  const float wr = single ? w[lowest_bit(bits)] : 1.f;
  if (pushed) {
    const u64* in = sym<u64>(x.h, (int)me, x.a.off_push_contrib) + ((u64)r * x.a.push_max_tokens + t) * x.a.push_row_words;
    u32 v[1];
    if (!take_tagged(x, in + (raw ? pushed_pair_word(e & ~1u) : pushed_f32_word(e)), 1u, 1u, v, r,
                     A2A_WAIT_COMBINE_ROW, t))
      return false;
    acc += raw ? wr * Fmt::load((u16)(v[0] >> (e & 1u) * 16u)) : __builtin_bit_cast(float, v[0]);
    return true;
  }
  const u8* part = sym<u8>(x.h, (int)r, x.a.off_contrib) + ((u64)me * x.M + t) * x.a.hidden * 4u;
  acc += raw ? wr * Fmt::load(reinterpret_cast<const u16*>(part)[e]) : reinterpret_cast<const float*>(part)[e];
  return true;
}

// y[t] = our own experts' rows of t times their weights (and expert_scale), read straight from
// expert_y, plus each peer's part (add_peer_part); one warp per segment of a
// token. Lane r works out which of t's slots live on rank r. Pulled parts
// wait for their flags first; pushed ones are taken word by word.
template <typename Fmt>
A2A_DEVICE void reduce_tokens(const Ctx& x, const CombineCall& c, const WarpGrid& g, WarpScratch sc) {
  __shared__ u32 here_buf[A2A_MAX_WARPS_PER_BLOCK][A2A_MAX_WORLD];
  u32* here = here_buf[g.warp_in_block];
  const u32 me = (u32)x.h.rank, H = (u32)x.a.hidden, S = x.a.nseg;
  const float* weights = reinterpret_cast<const float*>(c.weights);
  const u16* expert_y = reinterpret_cast<const u16*>(c.expert_y);
  const float scale = c.expert_scale;  // of our own rows; a peer's part comes scaled by the peer
  u16* out = reinterpret_cast<u16*>(c.out);
  const bool vec = H % 8u == 0 && (((u64)out | (u64)expert_y) & 15u) == 0;
  // Our dispatch's choice, from the header it left in our own inbox.
  const u64* own_header = sym<u64>(x.h, (int)me, x.a.off_tok_count) + x.parity * x.W + me;
  const bool pushed = ((u32)a2a_load_relaxed_sys_u64(own_header) & A2A_PUSHED) != 0;
  for (u32 item = first_item(g, g.warps / 2u); item < (u32)c.num_tokens * S; item += g.warps) {
    const u32 t = item / S, seg = item % S;
    A2A_PROF_START(t1);
    // The token's routing row, its rows here and its weights, loaded by all lanes at once.
    const RowSlot lane_slot = load_row_slot(sym<i32>(x.h, (int)me, x.a.off_rows) + ((u64)me * x.M + t) * x.k, g.lane,
                                            x.k, x.a.num_experts);
    const u32 on_lane_rank = lane_rank_slots(lane_slot, x.k, x.L, g.lane);
    if (g.lane < x.W) here[g.lane] = on_lane_rank;
    if (g.lane < x.k) sc.w[g.lane] = weights[(u64)t * x.k + g.lane];
    const u32 here_me = a2a_shfl((int)on_lane_rank, (int)me);
    const bool own_rows = load_slots(sc.slots, sym<i32>(x.h, (int)me, x.a.off_slot_of) + ((u64)me * x.M + t) * x.k,
                                     here_me, x.k, g.lane);
    const u32 mine = own_rows ? here_me : 0u;  // a lost slot: reported already
    const float* w = sc.w;
    const i32* own = sc.slots;
    const u32 e_begin = seg * x.a.seg_elems, e_end = e_begin + x.a.seg_elems < H ? e_begin + x.a.seg_elems : H;
    constexpr u32 U = A2A_CHUNKS, STEP = A2A_WARP_SIZE * 8u;
    // Our own part of the lane's first chunk (on GPUs a segment is one chunk
    // per lane) is summed before waiting, while the peers' parts are on the way.
    const u32 e_first = e_begin + g.lane * 8u;
    float acc[U][8] = {};
    if (vec && mine && e_first < e_end) sum_rows<Fmt>(acc, expert_y, own, mine, w, scale, H, e_first, e_end);
    bool ok = true;
    for (u32 r = 0; r < x.W && ok && !pushed; ++r) {
      if (!here[r] || r == me) continue;
      A2A_PROF_START(t0);
      const u32* flag = sym<u32>(x.h, (int)me, x.a.off_contrib_flag) + ((u64)r * x.M + t) * S + seg;
      ok = warp_wait(x, flag, r, A2A_WAIT_COMBINE_ROW, t, g.lane);
      A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_WAIT_CONTRIB, t0, r | t << 8);
    }
    if (!ok) break;
    for (u32 e0 = e_first; vec && e0 < e_end; e0 += U * STEP) {
      if (e0 != e_first) {
        for (u32 u = 0; u < U; ++u)
          for (u32 i = 0; i < 8; ++i) acc[u][i] = 0.f;
        if (mine) sum_rows<Fmt>(acc, expert_y, own, mine, w, scale, H, e0, e_end);
      }
      for (u32 r = 0; r < x.W && ok; ++r)
        if (here[r] && r != me) ok = add_peer_part<Fmt>(x, acc, r, t, here[r], w, e0, e_end, pushed);
      for (u32 u = 0; u < U; ++u)
        if (ok && e0 + u * STEP < e_end) store8<Fmt>(out + (u64)t * H + e0 + u * STEP, acc[u]);
    }
    for (u32 e = e_begin + g.lane; !vec && e < e_end; e += A2A_WARP_SIZE) {
      float acc = mine ? sum_rows_at<Fmt>(expert_y, own, mine, w, scale, H, e) : 0.f;
      for (u32 r = 0; r < x.W && ok; ++r)
        if (here[r] && r != me) ok = add_peer_part_at<Fmt>(x, acc, r, t, here[r], w, e, pushed);
      if (ok) out[(u64)t * H + e] = Fmt::store(acc);
    }
    if (!warp_all(ok, g.lane)) break;  // a pushed part never came: reported
    a2a_wave_sync();  // here[] is rewritten for the warp's next item
    A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_REDUCE, t1, me | t << 8);
  }
}

template <typename Fmt>
A2A_DEVICE void combine(const A2AArgs& a, const CombineCall& c) {
  const Ctx x = make_ctx(a, take_epoch(a, false));
  const WarpGrid g = warp_grid();
  A2A_PROF_START(t0);
  __shared__ i32 slot_buf[A2A_MAX_WARPS_PER_BLOCK][32];
  __shared__ float w_buf[A2A_MAX_WARPS_PER_BLOCK][32];
  const WarpScratch sc{slot_buf[g.warp_in_block], w_buf[g.warp_in_block]};
  if (a2a_block() == 0) send_weights(x, c, g);
  send_contributions<Fmt>(x, c, g, sc);
  // A lane may still read the warp's scratch (sc.slots, sc.w) for the last
  // contribution it pushed (that path skips the loop's closing sync) when
  // another lane starts rewriting it for its first token.
  a2a_wave_sync();
  reduce_tokens<Fmt>(x, c, g, sc);
  A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_WARP, t0, 0);
  const Poison outputs[1] = {{reinterpret_cast<u8*>(c.out), (u64)c.num_tokens * a.y_row_bytes}};
  poison_if_failed(x, 1u, outputs);
}

extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) a2a_combine_f16(A2AArgs a, CombineCall c) { combine<F16>(a, c); }
extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) a2a_combine_bf16(A2AArgs a, CombineCall c) { combine<BF16>(a, c); }

// ------------------------------------------------------- fake expert ----

// prefix[l] = sum of counts[0..l), for l in [0, L], for the whole block. The
// counts are loaded by all threads at once into shared memory; warp 0 then
// scans them a warp's width at a time with shuffles (a serial loop over
// global loads cost a memory latency per count).
A2A_DEVICE void exclusive_prefix(u32* prefix, const i32* counts, u32 L) {
  for (u32 l = a2a_thread(); l < L; l += a2a_block_dim()) prefix[l + 1] = (u32)counts[l];
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

// Row index in the [L][capacity] expert-major buffer of the q-th received row.
A2A_DEVICE u64 received_row(const u32* prefix, u32 L, u32 capacity, u32 q) {
  u32 lo = 0, hi = L;  // largest l with prefix[l] <= q
  while (hi - lo > 1u) { const u32 mid = (lo + hi) / 2u; if (prefix[mid] <= q) lo = mid; else hi = mid; }
  return (u64)lo * capacity + (q - prefix[lo]);
}

// The stand-in for a grouped GEMM used by scripts and tests (gpu-mode's fake
// expert: expert_y = expert_x * scale), applied to received rows only: warps
// walk the filled rows through the prefix of the counts, 8 elements a lane.
template <typename Fmt>
A2A_DEVICE void scale_rows(const u16* x, u16* y, const i32* counts, u32 L, u32 capacity, u32 hidden,
                           float scale) {
  __shared__ u32 prefix[A2A_MAX_LOCAL_EXPERTS + 1];
  exclusive_prefix(prefix, counts, L);
  const WarpGrid g = warp_grid();
  for (u32 q = g.warp; q < prefix[L]; q += g.warps) {
    const u64 row = received_row(prefix, L, capacity, q) * hidden;
    copy_row_scaled<Fmt>(y + row, x + row, hidden, scale, g.lane);
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
