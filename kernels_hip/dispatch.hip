// Expert-parallel dispatch over the symmetric heap (protocol: exchange.h).
//
// The sender decides where every row lands, so nothing stands between a
// token's arrival and its copy into expert_x but the local copy itself:
//   1. route (a block per chunk of our tokens, see route below): each valid
//      slot (t, j) takes the next place among the rows its chunk sends to
//      expert e (a counter in shared memory), and the row goes to every
//      rank, us too, as tagged words packing e and that place (protocol.h:
//      value and epoch in one atomic 8-byte store, so no fence and no
//      flag); then each rank gets the chunk's count for each of its
//      experts; block 0 also sends our token count; weights given to
//      dispatch follow their slots' routing words (to the expert's rank and
//      to our own w_in), so combine sends none;
//   2. send: each token that another rank needs is either staged, segment
//      by segment, in our own symmetric heap, each segment's flag published
//      into the memory of every rank that needs it (portability.h:
//      a2a_publish_own_sys), or, in a pushed call (below) whose flags would
//      need a system-scope release, written straight into those ranks'
//      inboxes;
//   3. receive: one warp per segment of each (source, token) takes the
//      routing row and the counts of the chunks before the token's (all
//      sent at the start, so they are usually in), works out its rows --
//      packed, expert l's rows hold source 0's chunks first, in order, then
//      source 1's; by source (row_layout="by_source"), source s's chunks
//      from row s * M on; contiguous, packed from expert l's first row of
//      one buffer (publish_offsets); each row at the place its sender chose -- then
//      takes the segment (a staged one read ONCE over the link after its
//      flag, a pushed one from our inbox) and copies it to each of its
//      expert rows; the warp of segment 0 also writes the rows' meta
//      (src_rank, src_token, src_k) and, for combine, the decoded routing
//      row and where each slot went;
//   4. a few warps sum every chunk's count of each of our experts into
//      expert_num_tokens (by source, each source's sum into expert_layout
//      too; contiguous, one warp then sums them into each expert's first
//      row), while the others copy.
// No receiver-side reservation, no hand-off between warps, no grid-wide step
// (a failed call's poisoning waits for the grid: finish in exchange.h).
//
// The steps are templates on X, how x becomes expert_x (A2A_X_* in
// exchange.h): 16-bit rows are copied as bytes; fp8 rows (given, or
// quantized from 16-bit ones on the way) move as fp8.h's pieces with their
// block scales. One kernel per X, so the 16-bit kernel is what it was. And
// one per Placed: whether rows may be placed by every expert's total
// (row_align: contiguous rows) or counted as they land (groups); the other
// kernel compiles neither, so a call that uses neither runs no step of
// theirs (pyhipa2a/legs.py picks the kernel by the configuration and call).
#include "fp8.h"

// A routing slot as it travels: e + E * place (place: its index among the
// rows its route chunk sends to expert e), or A2A_NO_SLOT for a slot that breaks
// the contract (out of range, or repeating an earlier expert of its row),
// which nobody writes. The host keeps E * M below 2^31 (quot by E is exact there).
#define A2A_NO_SLOT 0xffffffffu
// Routing goes by chunks of a call's tokens (route_chunk tokens, chosen by
// the host: kernels.route_chunk), one block each, so that routing a large
// call takes little longer than a small one. A chunk's places count from zero for
// each expert: the receiver puts a chunk's rows after those of every chunk
// before it (packed: all chunks of the sources before, then the source's own
// earlier chunks; by source: the source's own earlier chunks only), from the
// counts each chunk sends. Work is in shared
// memory: the chunk's routing rows (read with many loads in flight, so that
// a slot's check against the earlier slots of its row is a few shared
// reads, not a chain of global ones) and a counter per expert (an atomic
// there costs tens of nanoseconds, one on global memory most of a
// microsecond) for A2A_ROUTE_WINDOW experts at a time: more experts take
// more passes.
#define A2A_ROUTE_TILE 2048u  // slots read into shared memory at once (whole rows: a chunk may take several)
#define A2A_ROUTE_WINDOW 1024u
#define A2A_ROUTE_LOADS 8u  // loads of the chunk a thread has in flight at once; also MAX_ROUTE_CHUNKS
                            // (pyhipa2a/kernels.py), so that sum_counts takes a source's chunks at once
#define A2A_ROUTE_STORES 4u  // placed slots a thread reads before it stores them (8 spilled registers on sm_90
                             // in the kernel's receiving steps)
#define A2A_ROUTE_SKIP 0xfffffffeu  // a slot this pass does not send: its expert is another pass's (E >
                                    // A2A_ROUTE_WINDOW), or it broke the contract and went in the first
static_assert(A2A_MAX_WORLD <= 256, "route keeps a slot's rank in a byte");

// The chunks of a call of `tokens` tokens.
// The chunks of a call of max_tokens tokens: the rows of the count tables.
A2A_DEVICE u32 route_chunks(const Ctx& x) { return x.a.div_chunks.d; }
// A source's count words of each chunk, for all our experts: [W][route_chunks][L] by parity.
A2A_DEVICE u64* chunk_counts(const Ctx& x, u32 rank) {
  return sym<u64>(x.h, (int)rank, x.a.off_expert_counts) + (u64)x.parity * x.W * route_chunks(x) * x.L;
}

// Weight `w` (its bits) of our slot i = t * k + j, as a tagged word: to the
// rank of its expert (`host`; our own rank for a void slot), whose
// contribution to token t may need it, and to our own w_in, where combine
// reads the weights of our own reduce (so nothing but dispatch reads the
// caller's array).
A2A_DEVICE void send_weight(const Ctx& x, u32 host, u32 i, u32 w) {
  const u32 me = (u32)x.h.rank;
  const u64 at = (u64)me * x.M * x.k + i, word = a2a_tag(w, x.epoch);
  if (host != me) a2a_store_relaxed_sys_u64(sym<u64>(x.h, (int)host, x.a.off_w_in) + at, word);
  a2a_store_relaxed_sys_u64(sym<u64>(x.h, (int)me, x.a.off_w_in) + at, word);
}

// Routing word v of the tile's slot i, to every rank (the tile lies at the
// same byte offset, tile_at, in every rank's heap); nothing for A2A_ROUTE_SKIP.
A2A_DEVICE void send_routing_word(const Ctx& x, u64 tile_at, u32 i, u32 v) {
  for (u32 r = 0; v != A2A_ROUTE_SKIP && r < x.W; ++r)
    a2a_store_relaxed_sys_u64(sym<u64>(x.h, (int)r, tile_at) + i, a2a_tag(v, x.epoch));
}

// One block, chunk `chunk` of our routing rows: every slot gets its place
// (the next count of its expert's counter) and goes to every rank as a
// tagged word, then the chunk's count for every expert goes to the rank that
// hosts it; with the caller's weights each slot's weight follows its routing
// word (send_weight). A chunk past our tokens (up to route_chunks) sends zero
// counts, so that every rank's counts are a dense table. Our own copies land
// in our own inbox: the receiving steps read ours where they read the
// peers'. A slot that breaks the contract (out of range, or repeating an
// earlier expert of its row) travels as A2A_NO_SLOT, in the first pass.
A2A_DEVICE void route(const Ctx& x, const DispatchCall& c, const WarpGrid& g, u32 chunk) {
  __shared__ u32 counters[A2A_ROUTE_WINDOW];
  __shared__ i32 tile[A2A_ROUTE_TILE];
  // A thread's own slots of the tile, placed (a routing word, or A2A_ROUTE_SKIP) and, with the weights, the
  // rank each one's weight goes to: shared memory, where registers would spill.
  __shared__ u32 placed[A2A_ROUTE_TILE];
  __shared__ u8 weight_host[A2A_ROUTE_TILE];
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u32* weights = reinterpret_cast<const u32*>(c.weights);  // the float's bits travel
  const u32 me = (u32)x.h.rank, n = (u32)c.num_tokens * x.k, E = (u32)x.a.num_experts;
  const u32 start = chunk * x.a.route_chunk * x.k, size = x.a.route_chunk * x.k;
  const u32 end = start >= n ? start : n - start < size ? n : start + size;  // the chunk's slots
  const u32 tile_slots = quot(x.a.div_k, A2A_ROUTE_TILE) * x.k;  // whole rows
  A2A_PROF_START(t0);
  for (u32 first = 0; first < E; first += A2A_ROUTE_WINDOW) {
    const u32 last = E - first < A2A_ROUTE_WINDOW ? E : first + A2A_ROUTE_WINDOW;
    for (u32 i = a2a_thread(); i < last - first; i += a2a_block_dim()) counters[i] = 0u;
    for (u32 base = start; base < end; base += tile_slots) {
      const u32 count = end - base < tile_slots ? end - base : tile_slots;
      for (u32 i0 = a2a_thread(); i0 < count; i0 += A2A_ROUTE_LOADS * a2a_block_dim()) {
        i32 e[A2A_ROUTE_LOADS];  // every load issued before the first store: `indices` might be shared memory
        for (u32 u = 0; u < A2A_ROUTE_LOADS; ++u)
          if (i0 + u * a2a_block_dim() < count) e[u] = indices[base + i0 + u * a2a_block_dim()];
        for (u32 u = 0; u < A2A_ROUTE_LOADS; ++u)
          if (i0 + u * a2a_block_dim() < count) tile[i0 + u * a2a_block_dim()] = e[u];
      }
      a2a_block_sync();  // the tile is in (and, before the first tile, the counters are zero)
      // With more slots than threads, the tile's slots are all placed, in shared memory, before any is
      // stored: a slot at a time, each placed behind the stores of the one before into the peers, routing
      // took 14.3 us at 4006 tokens a rank; this way, with the row's earlier slots read together, 11.9
      // (docs/PREFILL.md: routing).
      const bool weigh = weights && first == 0;  // the weights go in the first pass
      const bool one_each = count <= a2a_block_dim();  // a slot a thread: stored as soon as placed
      // (the tile's routing words, at the same offset in every rank's heap)
      const u64 tile_at = x.a.off_tok_hdr + (((u64)x.parity * x.W + me) * x.M * x.k + base) * 8u;
      for (u32 i = a2a_thread(); i < count; i += a2a_block_dim()) {
        const u32 j = rem(x.a.div_k, base + i);
        const i32 e = tile[i];
        bool repeated = false;  // (the row's earlier slots read together: one behind another was a chain)
        for (u32 q = 1; q <= j; ++q) repeated |= tile[i - q] == e;
        const bool valid = e >= 0 && e < (i32)E && !repeated;
        if (!valid && first == 0 && !(e < 0 && x.a.void_slots)) report(x, A2A_ERR_BAD_INDEX, me, base + i, (u32)e);
        const bool now = valid ? (u32)e >= first && (u32)e < last : first == 0;  // else another pass sends it
        const u32 v = !now    ? A2A_ROUTE_SKIP
                      : valid ? (u32)e + E * a2a_add_shared(&counters[(u32)e - first], 1u)
                              : A2A_NO_SLOT;
        if (one_each) send_routing_word(x, tile_at, i, v);
        if (!one_each) placed[i] = v;
        if (weigh) weight_host[i] = (u8)(valid ? quot(x.a.div_L, (u32)e) : me);
      }
      // (each thread reads back only its own slots; the sync has every warp place before any stores, as measured)
      if (!one_each) a2a_block_sync();
      for (u32 i0 = a2a_thread(); !one_each && i0 < count; i0 += A2A_ROUTE_STORES * a2a_block_dim()) {
        u32 v[A2A_ROUTE_STORES];  // every read before the first store
        for (u32 u = 0; u < A2A_ROUTE_STORES; ++u)
          v[u] = i0 + u * a2a_block_dim() < count ? placed[i0 + u * a2a_block_dim()] : A2A_ROUTE_SKIP;
        for (u32 u = 0; u < A2A_ROUTE_STORES; ++u) send_routing_word(x, tile_at, i0 + u * a2a_block_dim(), v[u]);
      }
      // (a slot's weight at a time, each load behind the stores before it: arrays of them spilled registers on
      // sm_90 in the kernel's receiving steps; timed at gpu-mode's sizes only, with --weights-at dispatch)
      for (u32 i = a2a_thread(); weigh && i < count; i += a2a_block_dim())
        send_weight(x, weight_host[i], base + i, weights[base + i]);
      a2a_block_sync();  // the tile is read before the next one overwrites it
    }
    if (start == end) a2a_block_sync();  // (no tile: the counters' zeroes must still be in)
    for (u32 i = first + a2a_thread(); i < last; i += a2a_block_dim()) {
      u32 l;
      const u32 r = quot_rem(x.a.div_L, i, l);
      a2a_store_relaxed_sys_u64(chunk_counts(x, r) + ((u64)me * route_chunks(x) + chunk) * x.L + l,
                                a2a_tag(counters[i - first], x.epoch));
    }
    a2a_block_sync();  // the counts are out before the next window zeroes the counters
  }
  A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_HEADERS, t0, me | chunk << 8);
}

// The sending steps' first warp: that of the first block that routes no
// chunk, so that a token leaves at once, beside the routing blocks (which
// start at block 0 and take their block-wide steps), not after them.
A2A_DEVICE u32 first_sender(const Ctx& x, const WarpGrid& g) { return route_chunks(x) * g.warps_per_block; }

// Each token some peer needs is copied into our stage, then its segments' flags are released in
// the memory of every peer r that needs the token (the data stays here, and each peer polls its
// own memory, not the link). A call with a token for every warp stages whole tokens: the item's
// flags go out at once, each lane releasing some of them after one sync of the warp, so a token
// pays one fence where each of its segments paid one (docs/PREFILL.md: staging). Fewer tokens go
// a segment an item, so that the grid's warps all stage and each token's first segment leaves at once.
// An x that lies in our x_stage (`in_heap`: exchange.h, x in the heap) is pulled from there: only the flags go.
template <u32 X>
A2A_DEVICE void stage_tokens(const Ctx& x, const DispatchCall& c, const WarpGrid& g, bool in_heap) {
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u8* tokens = reinterpret_cast<const u8*>(c.x);
  const u32 me = (u32)x.h.rank, rb = x.a.x_row_bytes, S = x.a.x_nseg, itemsize = rb / (u32)x.a.hidden;
  const u32 tb = x.a.token_bytes, whole = (u32)c.num_tokens >= g.warps;
  const u32 segs = whole ? S : 1u, items = whole ? (u32)c.num_tokens : (u32)c.num_tokens * S;
  u8* stage = sym<u8>(x.h, (int)me, x.a.off_stage) + (u64)x.parity * x.M * tb;
  for (u32 item = first_item(g, first_sender(x, g)); item < items; item += g.warps) {
    u32 seg = 0;
    const u32 t = whole ? item : quot_rem(x.a.div_x_nseg, item, seg);
    const RowSlot lane_slot = load_row_slot(indices + (u64)t * x.k, g.lane, x.k, x.a.num_experts);
    const u32 peers = ranks_hosting(lane_slot, x.k, x.a.div_L) & ~(1u << me);
    if (!peers) continue;
    A2A_PROF_START(t0);
    u8* row = stage + (u64)t * tb;
    if constexpr (X == A2A_X_COPY) {
      const Segment sg = whole ? Segment{0u, rb} : segment(x, seg, rb, itemsize);
      if (!in_heap) copy_row(row + sg.first, tokens + (u64)t * rb + sg.first, sg.bytes, g.lane);
    } else {
      for (u32 s = seg; s < seg + segs; ++s)
        store_piece(row, stage_scales(row, (u32)x.a.hidden), s * x.a.x_seg_elems, g.lane,
                    piece_of_input<X>(x, c, t, s, g.lane));
    }
    a2a_wave_sync();
    for (u32 i = g.lane; i < x.W * segs; i += A2A_WARP_SIZE) {  // flag (peer r, segment seg + i / W)
      u32 r;
      const u32 s = seg + quot_rem(x.a.div_W, i, r);
      if (!(peers >> r & 1u)) continue;
      u32* flag = sym<u32>(x.h, (int)r, x.a.off_stage_flag) + (((u64)x.parity * x.W + me) * x.M + t) * S + s;
      a2a_publish_own_sys(flag, x.epoch, x.a.gpu_fence_publish);
    }
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_STAGE, t0, me | t << 8);
  }
}

// A pushed call: each segment of each token some peer needs goes straight
// into those peers' inboxes as tagged words; nothing is staged or flagged.
template <u32 X>
A2A_DEVICE void push_tokens(const Ctx& x, const DispatchCall& c, const WarpGrid& g) {
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u32 me = (u32)x.h.rank, words = x.a.x_row_bytes / 4u, S = x.a.x_nseg, P = x.a.push_max_tokens;
  const u32 stride = x.a.push_token_words;
  for (u32 item = first_item(g, first_sender(x, g)); item < (u32)c.num_tokens * S; item += g.warps) {
    u32 seg;
    const u32 t = quot_rem(x.a.div_x_nseg, item, seg);
    const RowSlot lane_slot = load_row_slot(indices + (u64)t * x.k, g.lane, x.k, x.a.num_experts);
    const u32 peers = ranks_hosting(lane_slot, x.k, x.a.div_L) & ~(1u << me);
    if (!peers) continue;
    A2A_PROF_START(t0);
    if constexpr (X != A2A_X_COPY) {
      const Fp8Piece p = piece_of_input<X>(x, c, t, seg, g.lane);
      for (u32 bits = peers; bits; bits &= bits - 1u) {
        const u32 r = lowest_bit(bits);
        u64* token = sym<u64>(x.h, (int)r, x.a.off_push_tok) + (((u64)x.parity * x.W + me) * P + t) * stride;
        push_piece(token, seg, x.a.x_seg_elems, g.lane, p, x.epoch);
      }
      A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_STAGE, t0, me | t << 8);
      continue;
    }
    const u32 first = seg * A2A_LANE_WORDS * A2A_WARP_SIZE + g.lane, n = lane_words(first, words);
    const u32* token = reinterpret_cast<const u32*>(c.x) + (u64)t * words + first;
    u32 v[A2A_LANE_WORDS];
    for (u32 i = 0; i < A2A_LANE_WORDS; ++i)
      if (i < n) v[i] = token[i * A2A_WARP_SIZE];
    for (u32 bits = peers; bits; bits &= bits - 1u) {
      const u32 r = lowest_bit(bits);
      u64* inbox = sym<u64>(x.h, (int)r, x.a.off_push_tok) + (((u64)x.parity * x.W + me) * P + t) * stride + first;
      for (u32 i = 0; i < A2A_LANE_WORDS; ++i)
        if (i < n) a2a_store_relaxed_sys_u64(&inbox[i * A2A_WARP_SIZE], a2a_tag(v[i], x.epoch));
    }
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_STAGE, t0, me | t << 8);
  }
}

// The vector of token t of source src: ours straight from the caller, a
// peer's over the link from its stage, or from its x_stage where its x lies
// there (`in_heap`).
A2A_DEVICE const u8* token_vector(const Ctx& x, const DispatchCall& c, u32 src, u32 t, bool in_heap) {
  if (src == (u32)x.h.rank) return reinterpret_cast<const u8*>(c.x) + (u64)t * x.a.x_row_bytes;
  if (in_heap) return sym<u8>(x.h, (int)src, x.a.off_x_stage) + (u64)t * x.a.x_row_bytes;
  return sym<u8>(x.h, (int)src, x.a.off_stage) + ((u64)x.parity * x.M + t) * x.a.token_bytes;
}

// The sum of count words first .. first + n - 1 of our expert l in the dense
// table (source-major, then chunk): A2A_ROUTE_LOADS loads in flight at a
// time, each taken again until it carries the epoch; false on timeout
// (reported, naming the source of the first word missing) or when this rank
// already failed. No load at all for n = 0.
A2A_DEVICE bool sum_counts(const Ctx& x, u32 l, u32 first, u32 n, u32& sum) {
  const u64* counts = chunk_counts(x, (u32)x.h.rank) + (u64)first * x.L + l;
  sum = 0;
  for (u32 q0 = 0; q0 < n; q0 += A2A_ROUTE_LOADS) {
    for (u32 spins = 1;; ++spins) {
      u64 w[A2A_ROUTE_LOADS];
      for (u32 u = 0; u < A2A_ROUTE_LOADS; ++u)
        if (q0 + u < n) w[u] = a2a_load_relaxed_sys_u64(counts + (u64)(q0 + u) * x.L);
      u32 missing = n, part = 0;
      for (u32 u = 0; u < A2A_ROUTE_LOADS; ++u) {
        if (q0 + u >= n) break;
        if ((u32)(w[u] >> 32) != x.epoch && missing == n) missing = q0 + u;
        part += (u32)w[u];
      }
      if (missing == n) {
        sum += part;
        break;
      }
      if ((spins & 63u) == 0) {
        if (a2a_clock_ns() > x.deadline) {
          report(x, A2A_ERR_TIMEOUT, quot(x.a.div_chunks, first + missing), A2A_WAIT_DISPATCH, x.epoch);
          return false;
        }
        if (a2a_load_relaxed_sys(&x.status[0]) != A2A_OK) return false;
      }
      a2a_pause();
    }
  }
  return true;
}

// The call's outputs, where its DispatchCall names them (our own buffers, or the caller's).
struct Outputs {
  u8* x;
  i32* meta;
  float* scales;
  i32* num_tokens;
  i32* layout;
  i32* offsets;
};

A2A_DEVICE Outputs outputs_of(const DispatchCall& c) {
  return {(u8*)c.expert_x,          (i32*)c.expert_meta,   (float*)c.expert_scales,
          (i32*)c.expert_num_tokens, (i32*)c.expert_layout, (i32*)c.expert_offsets};
}

// A tagged word that this rank's own warps write from its peers' words (contiguous rows: an expert's
// rows, its first row). Those warps report a late peer by name, so this wait gives up once the status
// holds an error and reports no timeout of its own before a second timeout has passed: that bound is
// for a fault of ours, not for a peer. False when it gives up.
A2A_DEVICE bool take_own(const Ctx& x, const u64* p, u32& v) {
  for (u32 spins = 1;; ++spins) {
    const u64 w = a2a_load_relaxed_sys_u64(p);
    if ((u32)(w >> 32) == x.epoch) {
      v = (u32)w;
      return true;
    }
    if ((spins & 63u) == 0) {
      if (a2a_load_relaxed_sys(&x.status[0]) != A2A_OK) return false;
      if (a2a_clock_ns() > x.deadline + x.a.timeout_ns) {
        report(x, A2A_ERR_TIMEOUT, (u32)x.h.rank, A2A_WAIT_DISPATCH, 0u);
        return false;
      }
    }
    a2a_pause();
  }
}

// Lane j (< k) of the warp on token t of source src gets the row of
// expert_x that slot j fills here (-1: its expert is not ours, or the slot is
// void), each row at the place its sender chose in its chunk, after expert
// l's rows from the chunks before t's: packed, those of every source before
// src and src's own earlier chunks (expert l's rows hold source 0's chunks
// first, then source 1's), from row l * W * M, or contiguous from expert l's
// first row (row_starts); by source (expert_layout), src's own earlier
// chunks after row src * M, so a token of its source's first chunk (every
// token of a small call) reads no count at all. `expert_here`: the row's
// expert here (l). With `record` (the warp of the token's first segment) the
// lane also writes the row's meta and, for combine, the decoded routing slot
// and its row. False in every lane when a word never came (reported).
template <bool Placed>
A2A_DEVICE bool expert_rows(const Ctx& x, i32* expert_meta, u32 src, u32 t, bool record, u32 lane, i32& row,
                            u32& expert_here) {
  const u32 me = (u32)x.h.rank, align = Placed ? x.a.row_align : 0u;
  const u64 at = ((u64)src * x.M + t) * x.k + lane;
  bool ok = true;
  row = -1;
  if (lane < x.k) {
    u32 v[1] = {A2A_NO_SLOT};
    ok = take_tagged(x, sym<u64>(x.h, (int)me, x.a.off_tok_hdr) + (u64)x.parity * x.W * x.M * x.k + at, 1u, 1u, v,
                     src, A2A_WAIT_DISPATCH, t);
    u32 expert, l;
    const u32 place = quot_rem(x.a.div_E, v[0], expert);  // (v[0] = e + E * place)
    const i32 e = ok && v[0] != A2A_NO_SLOT ? (i32)expert : -1;
    if (e >= 0 && quot_rem(x.a.div_L, (u32)e, l) == me) {
      expert_here = l;
      const u32 chunk = quot(x.a.div_chunk, t), from = src * route_chunks(x);
      u32 before = 0, first = 0;
      ok = sum_counts(x, l, x.a.by_source ? from : 0u, x.a.by_source ? chunk : from + chunk, before);
      if (ok && align) ok = take_own(x, local<u64>(x.a, x.a.off_row_starts) + l, first);
      // (below W * M, or R contiguous, while senders keep the protocol and the rows fit)
      const u32 r = (x.a.by_source ? src * x.M : 0u) + first + before + place;
      if (ok && r < (align ? x.a.recv_rows : x.capacity))
        row = (i32)(align ? r : l * x.capacity + r);
      else if (ok)
        report(x, A2A_ERR_CAPACITY, me, l, r);
    }
    if (record) {
      sym<i32>(x.h, (int)me, x.a.off_rows)[at] = e;
      sym<i32>(x.h, (int)me, x.a.off_slot_of)[at] = row;
      if (row >= 0) {
        i32* meta = expert_meta + (u64)row * 3u;
        const u32 R = x.a.region_tokens;  // a node's part of a multi-node call: name the token's true source
        meta[0] = (i32)(R ? t / R * x.W + src : src);
        meta[1] = (i32)(R ? t % R : t);
        meta[2] = (i32)lane;
      }
    }
  }
  return warp_all(ok);
}

// Rows of group `group` this warp just wrote (each lane its own row): as
// many more as the segments written of each, in the warp's stripe of the
// group's counter, after the rows (watch_groups adds up the stripes).
A2A_DEVICE void count_landed(const Ctx& x, const WarpGrid& g, i32 row, u32 group, u32 segments) {
  a2a_release_before_barrier_dev();
  a2a_wave_sync();  // every lane's part of every row is written
  if (row >= 0)
    a2a_fetch_add_acq_rel_dev(local<u32>(x.a, x.a.off_group_landed) + group_stripe(g.warp, group), segments);
}

// Segment `seg` of token t of source `src` to its n rows here (slots[], lane 0's writes): a staged
// segment is read over the link once its flag is here (from src's x_stage where its x lies there:
// `in_heap`), a pushed one from our inbox once its words carry the epoch. False where a peer never
// delivered (reported).
template <u32 X>
A2A_DEVICE bool move_segment(const Ctx& x, const DispatchCall& c, const Outputs& out, const WarpGrid& g, u32 src,
                             u32 t, u32 seg, const i32* slots, u32 n, bool pushed, bool in_heap) {
  const u32 me = (u32)x.h.rank, rb = x.a.x_row_bytes, S = x.a.x_nseg, itemsize = rb / (u32)x.a.hidden;
  const u32 words = rb / 4u, H = (u32)x.a.hidden;
  u8* expert_x = out.x;
  A2A_PROF_START(t3);
  if constexpr (X != A2A_X_COPY) {
    Fp8Piece p;
    if (src == me) {
      p = piece_of_input<X>(x, c, t, seg, g.lane);
    } else if (pushed) {
      const u64* token = sym<u64>(x.h, (int)me, x.a.off_push_tok) +
                         (((u64)x.parity * x.W + src) * x.a.push_max_tokens + t) * x.a.push_token_words;
      if (!warp_all(take_piece(x, token, seg, g.lane, p, src, t))) return false;
    } else {
      const u32* staged = sym<u32>(x.h, (int)me, x.a.off_stage_flag) + (((u64)x.parity * x.W + src) * x.M + t) * S + seg;
      if (!warp_wait(x, staged, src, A2A_WAIT_DISPATCH, t, g.lane)) return false;
      const u8* row = token_vector(x, c, src, t, false);  // (fp8 rows are always staged)
      p = load_piece(row, stage_scales(row, H), seg * x.a.x_seg_elems, H, g.lane);
    }
    if (src != me) A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_TOKEN, t3, src | t << 8);
    A2A_PROF_START(t2);
    a2a_wave_sync();
    for (u32 d = 0; d < n; ++d)
      store_piece(expert_x + (u64)slots[d] * rb, out.scales + (u64)slots[d] * x.a.scale_cols, seg * x.a.x_seg_elems,
                  g.lane, p);
    a2a_wave_sync();  // slots[] is rewritten for this warp's next token
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_FANOUT, t2, src | t << 8);
    return true;
  }
  if (src != me && pushed) {
    const u32 first = seg * A2A_LANE_WORDS * A2A_WARP_SIZE + g.lane, count = lane_words(first, words);
    const u64* inbox = sym<u64>(x.h, (int)me, x.a.off_push_tok) +
                       (((u64)x.parity * x.W + src) * x.a.push_max_tokens + t) * x.a.push_token_words + first;
    u32 v[A2A_LANE_WORDS];
    const bool ok = take_batch(x, inbox, A2A_WARP_SIZE, count, v, src, A2A_WAIT_DISPATCH, t);
    if (!warp_all(ok)) return false;
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_TOKEN, t3, src | t << 8);
    A2A_PROF_START(t2);
    a2a_wave_sync();
    for (u32 d = 0; d < n; ++d) {
      u32* row = reinterpret_cast<u32*>(expert_x + (u64)slots[d] * rb) + first;
      for (u32 i = 0; i < A2A_LANE_WORDS; ++i)
        if (i < count) row[i * A2A_WARP_SIZE] = v[i];
    }
    a2a_wave_sync();  // slots[] is rewritten for this warp's next token
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_FANOUT, t2, src | t << 8);
    return true;
  }
  const u32* staged = sym<u32>(x.h, (int)me, x.a.off_stage_flag) + (((u64)x.parity * x.W + src) * x.M + t) * S + seg;
  if (src != me && !warp_wait(x, staged, src, A2A_WAIT_DISPATCH, t, g.lane)) return false;
  if (src != me) A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_TOKEN, t3, src | t << 8);
  A2A_PROF_START(t2);
  a2a_wave_sync();
  const Segment sg = segment(x, seg, rb, itemsize);
  const u8* vec = token_vector(x, c, src, t, in_heap);
  copy_row_fanout(expert_x + sg.first, rb, slots, n, vec + sg.first, sg.bytes, g.lane);
  a2a_wave_sync();  // slots[] is rewritten for this warp's next token
  A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_FANOUT, t2, src | t << 8);
  return true;
}

// The peers whose x this block read where it lies (x in the heap), a word each: zeroed before make_ctx's
// barrier, set by the copying warps, looked at by check_heap_sources.
A2A_DEVICE u32* heap_sources_read() {
  __shared__ u32 read[A2A_MAX_WORLD];
  return read;
}

// x in the heap, when a source fails: its stream goes on past a failed call, and x_stage is written again
// after it (its caller's next NumPy x, or x_buffer()), maybe while we still read this call's rows. Its
// status word, read after every read of this block's (the barrier, then a fence), says whether it failed;
// if so this call fails too, naming it (A2A_ERR_PEER), instead of handing out rows that may be another
// call's. (On the way of a call that succeeds, the caller writes x_stage only after its combine, which
// waits for our contributions: kernels_hip/exchange.h.)
A2A_DEVICE void check_heap_sources(const Ctx& x) {
  a2a_block_sync();
  const u32 src = a2a_thread();
  if (src >= x.W || !heap_sources_read()[src]) return;
  a2a_fence_sys();
  const u32 code = a2a_load_relaxed_sys(sym<u32>(x.h, (int)src, x.a.off_status));
  if (code != A2A_OK) report(x, A2A_ERR_PEER, src, A2A_WAIT_DISPATCH, code);
}

// Each (src, t) with experts here goes to all of its expert rows, a warp an item: each warp's first
// from first_item, the rest (in a call with more items than warps) handed out as the warps ask
// (take_item). While there are tokens enough for every warp, an item is a whole token: its warp
// places its rows once (expert_rows: the routing, and the count sums before it) for all of its
// segments. The tokens left over, all of a small call's, go a segment an item, so that every warp
// stays busy to the end. (At prefill sizes, placing the rows again for every segment took
// a quarter of the fan-out's time: docs/PREFILL.md.)
template <u32 X, bool Placed>
A2A_DEVICE void fan_out(const Ctx& x, const DispatchCall& c, const Outputs& out, const WarpGrid& g, const u32* pre) {
  __shared__ i32 slot_buf[A2A_MAX_WARPS_PER_BLOCK][32];
  i32* slots = slot_buf[g.warp_in_block];
  // (x in the heap is for 16-bit rows: the other kernels' sources never lie there)
  const u32 me = (u32)x.h.rank, S = x.a.x_nseg, pushed = pre[x.W + 1], in_heap = X == A2A_X_COPY ? pre[x.W + 4] : 0u;
  const u32 tokens = pre[x.W + 2] * x.W;  // (src, t), every source counted as the one with the most tokens
  const u32 whole = tokens - tokens % g.warps, items = whole + (tokens - whole) * S;
  // (handed only where some warp has a second item: else nothing to balance, no ask to wait for)
  ItemHand hand{A2A_ITEMS_DISPATCH, items > g.warps, 0};
  for (u32 item = first_item(g, g.warps / 2u); item < items; item = hand.next(x, g, item)) {
    hand.ask(x, g.lane);
    u32 seg = 0;
    const u32 q = item < whole ? item : whole + quot_rem(x.a.div_x_nseg, item - whole, seg);
    const u32 segs = item < whole ? S : 1u;
    u32 src, t;
    if (!token_major(pre, x.W, me + 1u, x.a.div_W, q, src, t)) continue;
    A2A_PROF_START(t1);
    i32 slot;  // lane j: slot j's row here, or -1
    u32 l = 0;  // lane j: slot j's expert here
    if (!expert_rows<Placed>(x, out.meta, src, t, seg == 0, g.lane, slot, l)) break;
    const u32 G = Placed ? c.groups : 0u, group = G ? l * G / x.L : 0u;
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_HEADER, t1, src | t << 8);
    u32 n = 0;
    for (u32 j = 0; j < x.k; ++j) {
      const i32 s = a2a_shfl(slot, (int)j);
      if (s >= 0) {
        if (g.lane == 0) slots[n] = s;
        ++n;
      }
    }
    if (!n) continue;
    bool ok = true;
    for (u32 end = seg + segs; ok && seg < end; ++seg)
      ok = move_segment<X>(x, c, out, g, src, t, seg, slots, n, pushed >> src & 1u, in_heap >> src & 1u);
    if constexpr (X == A2A_X_COPY)
      if (src != me && (in_heap >> src & 1u) && g.lane == 0) heap_sources_read()[src] = 1u;
    if (!ok) break;
    if (G) count_landed(x, g, slot, group, segs);
  }
}

// dispatch(groups=G): group g holds our experts l with l * G / L == g, and
// its readiness word rises once every row of it is written (the caller's
// stream waits for it on the device: pyhipa2a.groups), with
// expert_num_tokens and, contiguous, expert_offsets. One warp watches, the
// last of the grid (given no other work, unless the grid is that warp):
// once every expert's rows are counted (publish_counts' tagged totals) and
// placed (publish_offsets' row starts), lane g knows how many row segments
// group g takes, and polls the group's stripes (count_landed) until they
// add up to that; then it raises the word. A failed call raises every word
// once its outputs are poisoned (finish), so no waiting stream is left
// behind.
A2A_DEVICE void watch_groups(const Ctx& x, u32 G, const WarpGrid& g) {
  const u64* totals = local<u64>(x.a, x.a.off_expert_totals);
  const u64* starts = local<u64>(x.a, x.a.off_row_starts);
  const u32* landed = local<u32>(x.a, x.a.off_group_landed);
  const u32 grp = g.lane;
  // The row segments of each group: lane i takes experts i, i + A2A_WARP_SIZE, ..., so that the warp's waits
  // for the totals are in flight together. (Taken one after another by every lane, they held a grouped
  // dispatch of 128 tokens to 128 experts a rank at 82 us, against 25 without groups, at commit 1607218.)
  __shared__ u32 wants[A2A_MAX_GROUPS];
  if (grp < A2A_MAX_GROUPS) wants[grp] = 0u;
  a2a_wave_sync();
  bool ok = true;
  for (u32 l = g.lane; l < x.L && ok; l += A2A_WARP_SIZE) {
    u32 n = 0, first = 0;
    ok = take_own(x, totals + l, n) && (!x.a.row_align || take_own(x, starts + l, first));
    if (ok) a2a_add_shared(&wants[l * G / x.L], n * x.a.x_nseg);
  }
  if (!warp_all(ok)) return;
  a2a_wave_sync();
  const u32 want = grp < G ? wants[grp] : 0u;  // lane g: the row segments of group g
  a2a_fence_sys();  // what the taken words cover (the counts, expert_offsets) before any word we raise
  bool raised = grp >= G;
  for (u32 spins = 1; !warp_all(raised); ++spins) {
    if (!raised) {
      u32 sum = 0;
      for (u32 stripe = 0; stripe < A2A_GROUP_STRIPES; ++stripe)
        sum += a2a_load_acquire_dev(landed + group_stripe(stripe, grp));
      if (sum == want) {
        a2a_store_release_sys(local<u32>(x.a, x.a.off_group_ready) + grp, 1u);
        raised = true;
      }
    }
    if ((spins & 63u) == 0) {  // the copying warps report a late peer; past a second timeout, a fault of ours
      if (a2a_load_relaxed_sys(&x.status[0]) != A2A_OK) return;
      if (a2a_clock_ns() > x.deadline + x.a.timeout_ns) {
        report(x, A2A_ERR_TIMEOUT, (u32)x.h.rank, A2A_WAIT_DISPATCH, 0u);
        return;
      }
    }
    a2a_pause();
  }
}

// Expert l's rows here, n (at most capacity), into expert_num_tokens; with `totals` also as a tagged word
// (expert_totals), after a fence: whoever takes the word finds the count in (and, by source, the expert's
// expert_layout).
A2A_DEVICE void put_count(const Ctx& x, i32* num_tokens, u32 l, u32 n, bool totals) {
  n = n < x.capacity ? n : x.capacity;
  num_tokens[l] = (i32)n;
  if (!totals) return;
  a2a_fence_sys();
  a2a_store_relaxed_sys_u64(local<u64>(x.a, x.a.off_expert_totals) + l, a2a_tag(n, x.epoch));
}

// Warps from a quarter of the grid on sum each of our experts' counts over
// every chunk of every source into expert_num_tokens, while the other warps
// copy. A warp's lanes form groups of G (a power of two, the fewest lanes that
// take every count word of an expert at once, or the whole warp), one group an
// expert, lane q of a group taking words q, q + G, ...: a call of few chunks
// sums up to a warp's width of experts in one round trip where a warp an
// expert took one round trip each (a small call launches few blocks: at one
// rank and M = 1, one block's 8 warps counted 256 experts, 32 round trips in
// a row, 20 us). With `totals` each count also goes out as a tagged word
// (expert_totals), for the steps that wait for every expert's
// (publish_offsets, watch_groups).
A2A_DEVICE void publish_counts(const Ctx& x, i32* num_tokens, const WarpGrid& g, bool totals) {
  const u64* counts = chunk_counts(x, (u32)x.h.rank);
  const u32 words = x.W * route_chunks(x);
  u32 G = 1;
  while (G < words && G < A2A_WARP_SIZE) G <<= 1;
  const u32 groups = A2A_WARP_SIZE / G, q0 = g.lane % G;
  for (u32 l0 = first_item(g, g.warps / 4u) * groups; l0 < x.L; l0 += g.warps * groups) {
    A2A_PROF_START(t0);
    const u32 l = l0 + g.lane / G;
    u32 n = 0;
    bool ok = true;
    for (u32 q = q0; l < x.L && q < words && ok; q += G) {
      u32 v[1] = {0u};
      ok = take_tagged(x, counts + (u64)q * x.L + l, 1u, 1u, v, quot(x.a.div_chunks, q), A2A_WAIT_DISPATCH, l);
      n += v[0];
    }
    if (!warp_all(ok)) return;
    for (u32 d = 1; d < G; d <<= 1) n += (u32)a2a_shfl((int)n, (int)(g.lane ^ d));  // within the group
    if (q0 == 0 && l < x.L) put_count(x, num_tokens, l, n, totals);
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_COUNTS, t0, l0);
  }
}

// Contiguous rows: expert l's rows start at expert_offsets[l], the rows of
// the experts before it, each expert's rounded up to row_align, and
// expert_offsets[L] is where the last expert's rounded rows end. One warp
// (the first of publish_counts') does it once that step has counted every
// expert (its tagged totals): lane i takes experts i, i + 32, ..., a scan
// across the warp a warp's width at a time. Each first row also goes out as
// a tagged word (row_starts), which the copying warps wait for. Rows that
// would end past R are reported (A2A_ERR_CAPACITY, naming the first expert
// that does; the call's outputs are poisoned), never dropped unseen. With a
// ticket the offsets also go to the host (host_offsets), each tagged with
// it, so that the caller learns where a group's rows will lie while they
// are still on their way (pyhipa2a.groups: group_rows).
A2A_DEVICE void publish_offsets(const Ctx& x, i32* offsets, const WarpGrid& g, u32 ticket) {
  u64* host = reinterpret_cast<u64*>(x.a.host_offsets);
  const u64* totals = local<u64>(x.a, x.a.off_expert_totals);
  u64* starts = local<u64>(x.a, x.a.off_row_starts);
  const u32 align = x.a.row_align, R = x.a.recv_rows;
  u32 base = 0;
  for (u32 l0 = 0; l0 < x.L; l0 += A2A_WARP_SIZE) {
    const u32 l = l0 + g.lane;
    u32 n = 0;
    if (!warp_all(l >= x.L || take_own(x, totals + l, n))) return;
    const u32 rounded = (n + align - 1u) / align * align;  // (the host keeps these sums below 2^32)
    u32 end = rounded;  // of experts l0 .. l, after base
    for (u32 d = 1; d < A2A_WARP_SIZE; d <<= 1) {
      const u32 up = (u32)a2a_shfl((int)end, (int)(g.lane >= d ? g.lane - d : g.lane));
      if (g.lane >= d) end += up;
    }
    const u32 first = base + end - rounded;
    if (l < x.L && first <= R && base + end > R) report(x, A2A_ERR_CAPACITY, (u32)x.h.rank, l, base + end);  // (ends grow)
    if (l < x.L) offsets[l] = (i32)first;
    if (l == x.L - 1u) offsets[x.L] = (i32)(first + rounded);
    a2a_fence_sys();  // expert_offsets before the tagged words: whoever takes one finds the offsets in
    if (l < x.L) {
      a2a_store_relaxed_sys_u64(starts + l, a2a_tag(first, x.epoch));
      if (ticket) a2a_store_relaxed_sys_u64(host + l, a2a_tag(first, ticket));
    }
    if (l == x.L - 1u && ticket) a2a_store_relaxed_sys_u64(host + x.L, a2a_tag(first + rounded, ticket));
    base += (u32)a2a_shfl((int)end, A2A_WARP_SIZE - 1);
  }
}

// publish_counts for a call laid out by source: lane s of a group of G lanes
// (a power of two, at least W) sums source s's chunks of an expert
// (sum_counts: every count word of a source in one round trip, as a call has
// at most A2A_ROUTE_LOADS chunks), writes expert_layout[l][s] = (s * M,
// rows), and the group's sum goes to expert_num_tokens (and with `totals`
// to expert_totals, as publish_counts does).
A2A_DEVICE void publish_source_counts(const Ctx& x, const Outputs& out, const WarpGrid& g, bool totals) {
  const u32 chunks = route_chunks(x);
  u32 G = 1;
  while (G < x.W) G <<= 1;
  const u32 groups = A2A_WARP_SIZE / G, s = g.lane % G;
  i32 *num_tokens = out.num_tokens, *layout = out.layout;
  for (u32 l0 = first_item(g, g.warps / 4u) * groups; l0 < x.L; l0 += g.warps * groups) {
    A2A_PROF_START(t0);
    const u32 l = l0 + g.lane / G;
    const bool mine = l < x.L && s < x.W;
    u32 n = 0;
    bool ok = true;
    if (mine) ok = sum_counts(x, l, s * chunks, chunks, n);
    if (!warp_all(ok)) return;
    n = n < x.M ? n : x.M;  // (a source sends each expert at most one row a token)
    if (mine) {
      layout[((u64)l * x.W + s) * 2u] = (i32)(s * x.M);
      layout[((u64)l * x.W + s) * 2u + 1u] = (i32)n;
    }
    for (u32 d = 1; d < G; d <<= 1) n += (u32)a2a_shfl((int)n, (int)(g.lane ^ d));  // within the group
    if (s == 0 && l < x.L) put_count(x, num_tokens, l, n, totals);
    A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_COUNTS, t0, l0);
  }
}

template <u32 X, bool Placed>
A2A_DEVICE void dispatch(const A2AArgs& a, const DispatchCall& c) {
  A2A_PROF_BEGIN(a.prof);
  if (a2a_thread() < A2A_MAX_WORLD) heap_sources_read()[a2a_thread()] = 0u;  // (make_ctx's barrier follows)
  const Ctx x = make_ctx(a, true, c.check_pairing != 0u);
  const Outputs out = outputs_of(c);
  const WarpGrid g = warp_grid();
  // With groups the grid's last warp watches them (watch_groups) and the others share the rest.
  const u32 G = Placed ? c.groups : 0u, align = Placed ? a.row_align : 0u;
  const bool watcher = G && g.warp == g.warps - 1u, dedicated = G && g.warps > 1u;
  WarpGrid w = g;
  if (dedicated) w.warps -= 1u;
  A2A_PROF_START(t0);
  // A pushed call pushes its tokens too unless its flags follow a GPU-scope
  // fence (exchange.h: A2A_PUSHED_TOKENS). Pushed words are read 4 bytes at
  // a time (the host only enables pushing for rows that are whole words).
  const bool push_back = (u32)c.num_tokens <= a.push_max_tokens;
  const bool push = push_back && !a.gpu_fence_publish && (X != A2A_X_COPY || (c.x & 3u) == 0);
  // A 16-bit x that lies in our x_stage is pulled from there (exchange.h: x in the heap).
  const bool in_heap = X == A2A_X_COPY && !push && c.x == a.local_base + a.off_x_stage;
  const u32 header = (u32)c.num_tokens | (push ? A2A_PUSHED_TOKENS : 0u) | (push_back ? A2A_PUSHED_BACK : 0u) |
                     (in_heap ? A2A_X_IN_HEAP : 0u);
  // A node's part of a multi-node call whose exchange between nodes timed out (reported before
  // this kernel, by hier_localize) sends nothing: its node's ranks then time out naming this rank
  // instead of taking a call that silently lacks another node's tokens.
  // A dispatch whose predecessor was never combined (make_ctx) does nothing either.
  const bool refused = *block_unpaired() || (a.void_slots && a2a_load_relaxed_sys(&x.status[0]) == A2A_ERR_TIMEOUT);
  if (!refused) {
    if (a2a_block() == 0 && a2a_thread() < x.W)
      a2a_store_relaxed_sys_u64(sym<u64>(x.h, (int)a2a_thread(), a.off_tok_count) + x.parity * x.W + x.h.rank,
                                a2a_tag(header, x.epoch));
    if (a2a_block() == 0 && a2a_thread() == 0) ready_items(x, A2A_ITEMS_DISPATCH);
    for (u32 chunk = a2a_block(); chunk < route_chunks(x); chunk += a2a_grid_dim()) route(x, c, g, chunk);
    if (push)
      push_tokens<X>(x, c, g);
    else
      stage_tokens<X>(x, c, g, in_heap);
    __shared__ u32 pre[A2A_PREFIX_WORDS];
    const bool ok = source_prefix(x, header, pre, true, g);
    if (ok && !(watcher && dedicated)) {
      // (tagged totals for the offsets and the groups, which wait for every expert's)
      if (a.by_source)
        publish_source_counts(x, out, w, G != 0u);
      else
        publish_counts(x, out.num_tokens, w, align || G);
      if (align && w.warp == w.warps / 4u) publish_offsets(x, out.offsets, w, c.ticket);
      fan_out<X, Placed>(x, c, out, w, pre);
    }
    if (ok && watcher) watch_groups(x, G, g);
  }
  A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WARP, t0, 0);
  A2A_PROF_END(a.prof);
  check_heap_sources(x);
  const u64 rows = a.recv_rows;
  const Poison poisoned[6] = {{out.x, rows * a.x_row_bytes},
                              {(u8*)out.meta, rows * 12u},
                              {(u8*)out.num_tokens, (u64)x.L * 4u},
                              {(u8*)out.scales, rows * a.scale_cols * 4u},
                              {(u8*)out.layout, a.by_source ? (u64)x.L * x.W * 8u : 0u},
                              {(u8*)out.offsets, align ? ((u64)x.L + 1u) * 4u : 0u, a.recv_rows}};
  finish(x, 0u, poisoned, Raise{local<u32>(a, a.off_group_ready), G});
}

// One kernel per way x becomes expert_x, and per Placed (pyhipa2a/legs.py picks it).
#define A2A_DISPATCH(name, X)                                                                                   \
  extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) name(A2AArgs a, DispatchCall c) {             \
    dispatch<X, false>(a, c);                                                                                   \
  }                                                                                                             \
  extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) name##_placed(A2AArgs a, DispatchCall c) {    \
    dispatch<X, true>(a, c);                                                                                    \
  }
A2A_DISPATCH(a2a_dispatch, A2A_X_COPY)
A2A_DISPATCH(a2a_dispatch_fp8, A2A_X_FP8)
A2A_DISPATCH(a2a_dispatch_quantize_f16, A2A_X_QUANTIZE_F16)
A2A_DISPATCH(a2a_dispatch_quantize_bf16, A2A_X_QUANTIZE_BF16)
