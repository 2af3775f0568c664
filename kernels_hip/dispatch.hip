// Expert-parallel dispatch over the symmetric heap (protocol: exchange.h).
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
//
// The steps are templates on X, how x becomes expert_x (A2A_X_* in
// exchange.h): 16-bit rows are copied as bytes; fp8 rows (given, or
// quantized from 16-bit ones on the way) move as fp8.h's pieces with their
// block scales. One kernel per X, so the 16-bit kernel is what it was.
#include "fp8.h"

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

// Each segment of each token some peer needs is copied into our stage; lane r
// then releases the segment's flag in the memory of peer r when r needs the
// token. The data stays here (the release waits only for our own memory) and
// the flag goes there (the peer polls its own memory, not the link).
template <u32 X>
A2A_DEVICE void stage_tokens(const Ctx& x, const DispatchCall& c, const WarpGrid& g) {
  const i32* indices = reinterpret_cast<const i32*>(c.indices);
  const u8* tokens = reinterpret_cast<const u8*>(c.x);
  const u32 me = (u32)x.h.rank, rb = x.a.x_row_bytes, S = x.a.x_nseg, itemsize = rb / (u32)x.a.hidden;
  const u32 tb = x.a.token_bytes;
  u8* stage = sym<u8>(x.h, (int)me, x.a.off_stage) + (u64)x.parity * x.M * tb;
  for (u32 item = first_item(g, g.warps_per_block); item < (u32)c.num_tokens * S; item += g.warps) {
    const u32 t = item / S, seg = item % S;
    const RowSlot lane_slot = load_row_slot(indices + (u64)t * x.k, g.lane, x.k, x.a.num_experts);
    const u32 peers = ranks_hosting(lane_slot, x.k, x.L) & ~(1u << me);
    if (!peers) continue;
    A2A_PROF_START(t0);
    if constexpr (X == A2A_X_COPY) {
      const Segment sg = segment(x, seg, rb, itemsize);
      copy_row(stage + (u64)t * tb + sg.first, tokens + (u64)t * rb + sg.first, sg.bytes, g.lane);
    } else {
      u8* row = stage + (u64)t * tb;
      store_piece(row, stage_scales(row, (u32)x.a.hidden), seg * x.a.x_seg_elems, g.lane,
                  piece_of_input<X>(x, c, t, seg, g.lane));
    }
    a2a_wave_sync();
    if (g.lane < x.W && (peers >> g.lane & 1u)) {  // (a 64-lane wave must not shift by 32 or more)
      u32* flag = sym<u32>(x.h, (int)g.lane, x.a.off_stage_flag) + (((u64)x.parity * x.W + me) * x.M + t) * S + seg;
      a2a_store_release_sys(flag, x.epoch);
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
  for (u32 item = first_item(g, g.warps_per_block); item < (u32)c.num_tokens * S; item += g.warps) {
    const u32 t = item / S, seg = item % S;
    const RowSlot lane_slot = load_row_slot(indices + (u64)t * x.k, g.lane, x.k, x.a.num_experts);
    const u32 peers = ranks_hosting(lane_slot, x.k, x.L) & ~(1u << me);
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
// peer's from its stage, over the link.
A2A_DEVICE const u8* token_vector(const Ctx& x, const DispatchCall& c, u32 src, u32 t) {
  if (src == (u32)x.h.rank) return reinterpret_cast<const u8*>(c.x) + (u64)t * x.a.x_row_bytes;
  return sym<u8>(x.h, (int)src, x.a.off_stage) + ((u64)x.parity * x.M + t) * x.a.token_bytes;
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
template <u32 X>
A2A_DEVICE void fan_out(const Ctx& x, const DispatchCall& c, const WarpGrid& g, const u32* pre) {
  __shared__ i32 slot_buf[A2A_MAX_WARPS_PER_BLOCK][32];
  i32* slots = slot_buf[g.warp_in_block];
  const u32 me = (u32)x.h.rank, rb = x.a.x_row_bytes, S = x.a.x_nseg, itemsize = rb / (u32)x.a.hidden;
  const u32 pushed = pre[x.W + 1], words = rb / 4u, H = (u32)x.a.hidden;
  const u64* slot_tag = sym<u64>(x.h, (int)me, x.a.off_slot_tag);
  u8* expert_x = sym<u8>(x.h, (int)me, x.a.off_recv_x);
  float* expert_scales = sym<float>(x.h, (int)me, x.a.off_recv_scales);
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
    if constexpr (X != A2A_X_COPY) {
      Fp8Piece p;
      if (src == me) {
        p = piece_of_input<X>(x, c, t, seg, g.lane);
      } else if (pushed >> src & 1u) {
        const u64* token = sym<u64>(x.h, (int)me, x.a.off_push_tok) +
                           (((u64)x.parity * x.W + src) * x.a.push_max_tokens + t) * x.a.push_token_words;
        if (!warp_all(take_piece(x, token, seg, g.lane, p, src, t), g.lane)) break;
      } else {
        const u32* staged = sym<u32>(x.h, (int)me, x.a.off_stage_flag) + (((u64)x.parity * x.W + src) * x.M + t) * S + seg;
        if (!warp_wait(x, staged, src, A2A_WAIT_DISPATCH, t, g.lane)) break;
        const u8* row = token_vector(x, c, src, t);
        p = load_piece(row, stage_scales(row, H), seg * x.a.x_seg_elems, H, g.lane);
      }
      if (src != me) A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WAIT_TOKEN, t3, src | t << 8);
      A2A_PROF_START(t2);
      a2a_wave_sync();
      for (u32 d = 0; d < n; ++d)
        store_piece(expert_x + (u64)slots[d] * rb, expert_scales + (u64)slots[d] * x.a.scale_cols,
                    seg * x.a.x_seg_elems, g.lane, p);
      a2a_wave_sync();  // slots[] is reused by this warp's next item
      A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_FANOUT, t2, src | t << 8);
      continue;
    }
    if (src != me && (pushed >> src & 1u)) {
      const u32 first = seg * A2A_LANE_WORDS * A2A_WARP_SIZE + g.lane, count = lane_words(first, words);
      const u64* inbox = sym<u64>(x.h, (int)me, x.a.off_push_tok) +
                         (((u64)x.parity * x.W + src) * x.a.push_max_tokens + t) * x.a.push_token_words + first;
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
  // Every counter is loaded before any store: a loop that loads, then stores, paid one memory round
  // trip per 32 experts (2.4 us at 256 experts in a trace), since the compiler cannot tell the arrays apart.
  constexpr u32 LANE_MAX = A2A_MAX_LOCAL_EXPERTS / A2A_WARP_SIZE;
  u32 n[LANE_MAX];
  for (u32 i = 0; i < LANE_MAX; ++i) {
    const u32 l = g.lane + i * A2A_WARP_SIZE;
    n[i] = l < x.L ? counters[l] : 0u;
  }
  for (u32 i = 0; i < LANE_MAX; ++i) {
    const u32 l = g.lane + i * A2A_WARP_SIZE;
    if (l >= x.L) break;
    num_tokens[l] = (i32)(n[i] < x.capacity ? n[i] : x.capacity);
    counters[l] = 0u;
  }
  if (g.lane == 0) *arrived = 0u;  // nobody else touches it until the next launch
  A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_COUNTS, t0, 0);
}

template <u32 X>
A2A_DEVICE void dispatch(const A2AArgs& a, const DispatchCall& c) {
  A2A_PROF_BEGIN(a.prof);
  const Ctx x = make_ctx(a, take_epoch(a, true));
  const WarpGrid g = warp_grid();
  A2A_PROF_START(t0);
  // Pushed words are read 4 bytes at a time (the host only enables pushing
  // for rows that are whole words).
  const bool push = (u32)c.num_tokens <= a.push_max_tokens && (X != A2A_X_COPY || (c.x & 3u) == 0);
  if (a2a_block() == 0) send_headers(x, c, g, push);
  if (push)
    push_tokens<X>(x, c, g);
  else
    stage_tokens<X>(x, c, g);
  __shared__ u32 pre[A2A_PREFIX_WORDS];
  const bool ok = source_prefix(x, (u32)c.num_tokens | (push ? A2A_PUSHED : 0u), pre, true, g);
  const bool reserved = ok && reserve_rows(x, c, g, pre);
  if (ok) publish_counts_if_last(x, g, pre, reserved);
  if (ok) fan_out<X>(x, c, g, pre);
  A2A_PROF(x.prof, g.lane, A2A_TAG_DISPATCH_WARP, t0, 0);
  A2A_PROF_END(a.prof);
  const u64 rows = (u64)x.L * x.capacity;
  const Poison outputs[4] = {{sym<u8>(x.h, x.h.rank, a.off_recv_x), rows * a.x_row_bytes},
                             {sym<u8>(x.h, x.h.rank, a.off_recv_meta), rows * 12u},
                             {sym<u8>(x.h, x.h.rank, a.off_num_tokens), (u64)x.L * 4u},
                             {sym<u8>(x.h, x.h.rank, a.off_recv_scales), rows * a.scale_cols * 4u}};
  poison_if_failed(x, 0u, outputs);
}

// One kernel per way x becomes expert_x (pyhipa2a/a2a.py picks it).
extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) a2a_dispatch(A2AArgs a, DispatchCall c) {
  dispatch<A2A_X_COPY>(a, c);
}
extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) a2a_dispatch_fp8(A2AArgs a, DispatchCall c) {
  dispatch<A2A_X_FP8>(a, c);
}
extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) a2a_dispatch_quantize_f16(A2AArgs a, DispatchCall c) {
  dispatch<A2A_X_QUANTIZE_F16>(a, c);
}
extern "C" __global__ void A2A_MAX_THREADS(A2A_MAX_BLOCK_THREADS) a2a_dispatch_quantize_bf16(A2AArgs a, DispatchCall c) {
  dispatch<A2A_X_QUANTIZE_BF16>(a, c);
}
