// Expert-parallel combine over the symmetric heap (protocol: exchange.h).
//
// combine (one kernel):
//   1. block 0 sends this rank's weights to every peer as tagged words,
//      unless dispatch sent them with its routing (then they are in: no
//      contribution waits for a trip of its own);
//   2. for every peer's token with experts here: one contribution for the
//      owner, segment by segment: the raw expert row when the token has one
//      expert here (times the call's expert_scale, rounded to its format; the
//      owner weights it), else the fp32 sum of w * scale * row over its
//      experts here (rounded to the output's format when the caller
//      asked for narrow partials: half the bytes, one more rounding); left
//      in our own memory with a flag released into the owner's memory,
//      stored into the owner's memory before that flag (a posting call:
//      exchange.h), or pushed into the owner's inbox;
//   3. every token of ours is reduced as soon as its contributions are in:
//      our own experts' rows straight from expert_y, each peer's
//      contribution read from that peer's memory, or from ours; fp32
//      accumulation, one rounding to the output dtype.
//
// Two builds of the same steps, chosen by the host from the call's tokens
// (pyhipa2a/legs.py: settle_geometry, Leg.kernel_for): the bulk kernel gives a warp a whole
// segment (A2A_CHUNKS 8-element chunks per lane, two experts' loads in
// flight), or a whole token while every warp has one (its routing loaded once
// for all of its segments), the small kernel a warp per chunk with eight experts' loads in
// flight: at few tokens a token's sum costs one memory latency instead of
// four (k = 8), and there are warps enough for every chunk. The small kernel
// has a register budget of its own (half the threads a block, up to 255
// registers on sm_90), which the bulk kernel's 128 could not give both paths.
#include "exchange.h"
#include "formats.h"

// Block 0 writes our weights into every peer's inbox as tagged words: A2A_WEIGHT_LOADS a thread loaded
// at once, then stored to every peer. (A load, then its store, in turn: each load waited for the store
// before it, an asm with a memory clobber, so every 256 weights cost a load's latency. In traces at
// 44144b9, block 0 sent weights for 9 us at 1001 tokens a rank and 47 us at 4006.)
#define A2A_WEIGHT_LOADS 8u
A2A_DEVICE void send_weights(const Ctx& x, const CombineCall& c, const WarpGrid& g) {
  const u32* weights = reinterpret_cast<const u32*>(c.weights);  // the float's bits travel
  const u32 me = (u32)x.h.rank, n = (u32)c.num_tokens * x.k, step = a2a_block_dim();
  A2A_PROF_START(t0);
  for (u32 i0 = a2a_thread(); i0 < n; i0 += A2A_WEIGHT_LOADS * step) {
    u32 v[A2A_WEIGHT_LOADS];
    for (u32 u = 0; u < A2A_WEIGHT_LOADS; ++u)
      if (i0 + u * step < n) v[u] = weights[i0 + u * step];
    for (u32 r = 0; r < x.W; ++r) {
      if (r == me) continue;
      u64* w = sym<u64>(x.h, (int)r, x.a.off_w_in) + (u64)me * x.M * x.k + i0;
      for (u32 u = 0; u < A2A_WEIGHT_LOADS; ++u)
        if (i0 + u * step < n) a2a_store_relaxed_sys_u64(&w[u * step], a2a_tag(v[u], x.epoch));
    }
  }
  A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_WEIGHTS, t0, 0u);
}

// acc[u] += sum over the experts j in `bits` of w[j] * scale * (8 elements
// of expert_y row slots[j] at e0 + u * STEP, u < U, while before e_end; STEP
// is a warp's width of 8-element chunks). 8 / U experts at a time, all their
// loads issued before the first sum: one memory latency per group. (Loading
// the next expert while summing this one, as before, cost one latency per
// expert: at one rank and k = 8 a token's reduction took eight round trips,
// 6.6 us.) The sums keep the experts' order, so the result is the same to
// the bit whatever U is.
template <typename Fmt, u32 U>
A2A_DEVICE void sum_rows(float (&acc)[U][8], const u16* expert_y, const i32* slots, u32 bits, const float* w,
                         float scale, u32 H, u32 e0, u32 e_end) {
  constexpr u32 P = 8u / U, STEP = A2A_WARP_SIZE * 8u;
  if constexpr (P == 2u) {  // the bulk kernel: written out, its register budget is tight (128 on sm_90)
    while (bits) {
      const u32 j0 = lowest_bit(bits);
      bits &= bits - 1u;
      const bool two = bits != 0u;
      const u32 j1 = two ? lowest_bit(bits) : j0;
      bits &= bits - 1u;  // (0 stays 0)
      vec16 a[U], b[U];
      for (u32 u = 0; u < U; ++u) {
        if (e0 + u * STEP >= e_end) continue;
        a[u] = *reinterpret_cast<const vec16*>(expert_y + (u64)slots[j0] * H + e0 + u * STEP);
        if (two) b[u] = *reinterpret_cast<const vec16*>(expert_y + (u64)slots[j1] * H + e0 + u * STEP);
      }
      for (u32 u = 0; u < U; ++u) {
        if (e0 + u * STEP >= e_end) continue;
        fma8v<Fmt>(acc[u], w[j0] * scale, a[u]);
        if (two) fma8v<Fmt>(acc[u], w[j1] * scale, b[u]);
      }
    }
  } else {
    while (bits) {
      u32 j[P], n = 0;
      for (u32 p = 0; p < P; ++p) {
        j[p] = bits ? lowest_bit(bits) : 0u;
        n += bits != 0u;
        bits &= bits - 1u;  // (0 stays 0)
      }
      vec16 v[P][U];
      for (u32 p = 0; p < P; ++p)
        for (u32 u = 0; u < U; ++u)
          if (p < n && e0 + u * STEP < e_end)
            v[p][u] = *reinterpret_cast<const vec16*>(expert_y + (u64)slots[j[p]] * H + e0 + u * STEP);
      for (u32 p = 0; p < P; ++p)
        for (u32 u = 0; u < U; ++u)
          if (p < n && e0 + u * STEP < e_end) fma8v<Fmt>(acc[u], w[j[p]] * scale, v[p][u]);
    }
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

// Lane j (< k) holds entry j of `slot_of` (the token's expert rows here),
// loaded with the routing row so that the two loads share one latency:
// load_slot_of. keep_slots puts them into slots[j] (the warp's shared copy,
// which the sums read); true in every lane when every expert in `bits` got a
// row (a slot lost to a reported capacity error has none).
A2A_DEVICE i32 load_slot_of(const i32* slot_of, u32 lane, u32 k) { return lane < k ? slot_of[lane] : 0; }

A2A_DEVICE bool keep_slots(i32* slots, i32 slot, u32 bits, u32 k, u32 lane) {
  if (lane < k) slots[lane] = slot;
  const bool ok = warp_all(lane >= k || !(bits >> lane & 1u) || slot >= 0);
  a2a_wave_sync();
  return ok;
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
    sum_rows<Fmt, U>(acc, expert_y, slots, here, w, scale, H, e0, e_end);
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

// contribute() for an owner that pushed its call: the same values, as tagged
// words stored straight into the owner's inbox `dst` (hidden % 8 == 0 when
// pushing, so a lane's 8 elements are all in the row); 16-bit values two a
// word (raw rows, narrow partials), fp32 sums one a word. U chunks a lane at
// a time (the words land where they do whatever U is: the owner may reduce
// with the other kernel).
template <typename Fmt, u32 U>
A2A_DEVICE void push_contribution(const Ctx& x, const u16* expert_y, const i32* slots, u32 here, const float* w,
                                  float scale, u64* dst, u32 e_begin, u32 e_end, u32 lane) {
  const u32 H = (u32)x.a.hidden;
  const bool vec = ((u64)expert_y & 15u) == 0;
  constexpr u32 STEP = A2A_WARP_SIZE * 8u;
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
      sum_rows<Fmt, U>(acc, expert_y, slots, here, w, scale, H, e0, e_end);
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

// Where rank `from`'s contribution to token t of rank `owner` lies when it is not pushed: in the
// owner's memory when the call posts them (exchange.h), else in the contributor's.
A2A_DEVICE u8* contribution_slot(const Ctx& x, u32 from, u32 owner, u32 t, bool posted) {
  const u32 holder = posted ? owner : from, index = posted ? from : owner;
  return sym<u8>(x.h, (int)holder, x.a.off_contrib) + ((u64)index * x.M + t) * x.a.hidden * 4u;
}

// A warp's scratch in shared memory: a token's expert rows and weights.
struct WarpScratch {
  i32* slots;
  float* w;
};

// Elements [begin, end) of part `part` of segment `seg`, parts `width` elements wide (a whole
// segment: width seg_elems, part 0); empty when the row ends before the part.
struct Elems {
  u32 begin, end;
};
A2A_DEVICE Elems part_elems(const Ctx& x, u32 seg, u32 part, u32 width) {
  const u32 H = (u32)x.a.hidden, seg_begin = seg * x.a.seg_elems;
  const u32 seg_end = seg_begin + x.a.seg_elems < H ? seg_begin + x.a.seg_elems : H;
  const u32 begin = seg_begin + part * width;
  return {begin, begin + width < seg_end ? begin + width : seg_end};
}

// After dispatch(groups=G), a token's contribution leaves with the part of
// combine that follows its last group here: the largest group, over its
// slots here (`here`), of the slot's expert l (l * G / L), in every lane.
A2A_DEVICE u32 last_group(const Ctx& x, const RowSlot& s, u32 here, u32 G, u32 lane) {
  u32 grp = lane < x.k && (here >> lane & 1u) ? rem(x.a.div_L, (u32)s.e) * G / x.L : 0u;
  for (u32 d = 1; d < A2A_WARP_SIZE; d <<= 1) {
    const u32 other = (u32)a2a_shfl((int)grp, (int)(lane ^ d));
    grp = other > grp ? other : grp;
  }
  return grp;
}

// Our contributions to the peers' tokens. Items are (part, token, peer,
// segment): Q = A2A_CHUNKS / U parts a segment, U chunks a lane each, when
// the owner pushed (its words are tagged, one each: any warp may write any of
// them); when it pulls, one warp writes the whole segment and releases its
// flag (part 0; the other parts have nothing to do). The part varies
// slowest, so that part 0's items, the only ones a pulled segment has, go to
// every warp of the grid (varying fastest, they fell to one warp a block).
// The bulk kernel (Q = 1) takes whole (token, peer) items first while every
// warp has one, as reduce_tokens does: the token's routing is loaded, and its
// weights waited for, once for all of its segments, each segment's flag
// still released as soon as it is written, in the order the owner reads them
// (`posted`: once the whole item is stored, all of its flags after one release).
// In a whole combine, the items past the grid's first are handed out as the
// warps ask (take_item), so that the senders end together.
// `phase`, `G`: c's, or the whole combine's (0, 0) in a kernel that takes no parts.
template <typename Fmt, u32 U>
A2A_DEVICE void send_contributions(const Ctx& x, const CombineCall& c, const WarpGrid& g, WarpScratch sc, const u32* pre,
                                   u32 phase, u32 G, bool posted) {
  constexpr u32 Q = A2A_CHUNKS / U, STEP = A2A_WARP_SIZE * 8u;
  const u32 me = (u32)x.h.rank, H = (u32)x.a.hidden, S = x.a.nseg;
  const u16* expert_y = reinterpret_cast<const u16*>(c.expert_y);
  const i32* rows = sym<i32>(x.h, (int)me, x.a.off_rows);
  const i32* slot_of = sym<i32>(x.h, (int)me, x.a.off_slot_of);
  const u64* w_in = sym<u64>(x.h, (int)me, x.a.off_w_in);
  const u32 pushed = pre[x.W + 3], peers = x.W - 1u;  // our own tokens are reduced straight from expert_y
  const u32 tokens = pre[x.W + 2] * peers;  // (peer, t), every peer counted as the one with the most tokens
  const u32 whole = Q == 1u ? tokens - tokens % g.warps : 0u, per_part = (tokens - whole) * S;
  const u32 items = whole + per_part * Q;
  // (a combine in parts strides: its kernels would share one call's counter)
  ItemHand hand{A2A_ITEMS_COMBINE, phase == A2A_WHOLE_COMBINE && items > g.warps, 0};
  for (u32 item = first_item(g, g.warps_per_block); item < items; item = hand.next(x, g, item)) {
    hand.ask(x, g.lane);
    a2a_wave_sync();  // the scratch is rewritten for this item
    const u32 part = Q == 1u || item < whole ? 0u : (item - whole) / per_part;
    u32 seg = 0;
    const u32 q = item < whole ? item : whole + quot_rem(x.a.div_nseg, item - whole - part * per_part, seg);
    const u32 segs = item < whole ? S : 1u;
    u32 src, t;
    if (!token_major(pre, x.W, me + 1u, x.a.div_peers, q, src, t)) continue;
    const bool push = (pushed >> src & 1u) != 0;
    if (!push && part) continue;
    // The item's elements [e_begin, e_end): a whole token's row, or its part (a pulled segment's flag covers all of it).
    const Elems el = push ? part_elems(x, seg, part, U * STEP) : part_elems(x, seg, 0u, x.a.seg_elems);
    const u32 e_begin = el.begin, e_end = segs == 1u ? el.end : H;
    if (e_begin >= e_end) continue;  // the row ends before this part
    // The small kernel loads the token's rows here with its routing row (one latency, not two); the
    // bulk kernel, whose registers are tight, only once it knows the token has experts here.
    const i32* token_slots = slot_of + ((u64)src * x.M + t) * x.k;
    const i32 early_slot = U < A2A_CHUNKS ? load_slot_of(token_slots, g.lane, x.k) : 0;
    const RowSlot lane_slot = load_row_slot(rows + ((u64)src * x.M + t) * x.k, g.lane, x.k, x.a.num_experts);
    const u32 here = slots_on(lane_slot, x.a.div_L, me);
    if (!here) continue;
    if (phase != A2A_WHOLE_COMBINE && last_group(x, lane_slot, here, G, g.lane) != phase - 1u) continue;
    const i32 lane_slot_of = U < A2A_CHUNKS ? early_slot : load_slot_of(token_slots, g.lane, x.k);
    if (!keep_slots(sc.slots, lane_slot_of, here, x.k, g.lane)) continue;  // the owner's wait ends on the reported error
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
    if (push) {  // straight into the owner's inbox, no flag (a segment starts on a whole STEP: one call takes them all)
      u64* inbox = sym<u64>(x.h, (int)src, x.a.off_push_contrib) +
                   ((u64)me * x.a.push_max_tokens + t) * x.a.push_row_words;
      push_contribution<Fmt, U>(x, expert_y, sc.slots, here, w, c.expert_scale, inbox, e_begin, e_end, g.lane);
      A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_CONTRIBUTE, t1, src | t << 8);
      continue;
    }
    u8* slot = contribution_slot(x, me, src, t, posted);
    u32* flags = sym<u32>(x.h, (int)src, x.a.off_contrib_flag) + ((u64)me * x.M + t) * S;
    const u32 first_seg = seg;
    for (u32 end = seg + segs; seg < end; ++seg) {
      const Elems in_seg = part_elems(x, seg, 0u, x.a.seg_elems);
      contribute<Fmt>(x, expert_y, sc.slots, here, w, c.expert_scale, slot, in_seg.begin, in_seg.end, g.lane);
      a2a_wave_sync();
      if (!posted && g.lane == 0)  // the data stays here, the flag goes to the owner
        a2a_publish_own_sys(flags + seg, x.epoch, x.a.gpu_fence_publish);
    }
    // Posted: the data went to the owner too; each lane's release (of the whole warp's stores, after
    // the sync above) carries one of the item's flags, so a token pays one wait for the link, not S.
    for (u32 s = first_seg + g.lane; posted && s < seg; s += A2A_WARP_SIZE) a2a_store_release_sys(flags + s, x.epoch);
    A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_CONTRIBUTE, t1, src | t << 8);
  }
}

// acc[u] += peer r's part of token t in chunk u (the lane's 8 elements from
// e0 + u * STEP): a raw row times its weight when r hosts one of t's experts
// (`bits`), else a partial sum (fp32, or a 16-bit row when narrow); read from
// r's memory when pulled, from our inbox when pushed (false: its words never
// came, reported). A 16-bit part is `raw` below; a narrow sum's weight is 1.
template <typename Fmt, u32 U>
A2A_DEVICE bool add_peer_part(const Ctx& x, float (&acc)[U][8], u32 r, u32 t, u32 bits, const float* w,
                              u32 e0, u32 e_end, bool pushed, bool posted) {
  constexpr u32 STEP = A2A_WARP_SIZE * 8u;
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
  const u8* part = contribution_slot(x, r, me, t, posted);
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
                                 bool pushed, bool posted) {
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
  const u8* part = contribution_slot(x, r, me, t, posted);
  acc += raw ? wr * Fmt::load(reinterpret_cast<const u16*>(part)[e]) : reinterpret_cast<const float*>(part)[e];
  return true;
}

// Weight j of our token t: from the caller's array, or from our own w_in
// where dispatch left it (c.weights == 0).
A2A_DEVICE float own_weight(const Ctx& x, const float* weights, u32 t, u32 j) {
  if (weights) return weights[(u64)t * x.k + j];
  const u64* w_in = sym<u64>(x.h, x.h.rank, x.a.off_w_in) + ((u64)x.h.rank * x.M + t) * x.k;
  return __builtin_bit_cast(float, (u32)w_in[j]);  // written by our dispatch, an earlier kernel
}

// y[t] = our own experts' rows of t times their weights (and expert_scale), read straight from
// expert_y, plus each peer's part (add_peer_part); one warp per part of a
// segment of a token (U chunks a lane; Q = A2A_CHUNKS / U parts a segment).
// The bulk kernel (Q = 1) takes whole tokens while every warp has one, as
// dispatch's fan_out does: a token's routing is then loaded once for all of
// its segments. Lane r works out which of t's slots live on rank r.
// Pulled and posted parts wait for their segment's flag first; pushed ones (`pushed`:
// our dispatch asked the peers to push their parts back) are taken word by word.
template <typename Fmt, u32 U>
A2A_DEVICE void reduce_tokens(const Ctx& x, const CombineCall& c, const WarpGrid& g, WarpScratch sc, bool pushed,
                              bool posted) {
  constexpr u32 Q = A2A_CHUNKS / U, STEP = A2A_WARP_SIZE * 8u;
  __shared__ u32 here_buf[A2A_MAX_WARPS_PER_BLOCK][A2A_MAX_WORLD];
  u32* here = here_buf[g.warp_in_block];
  const u32 me = (u32)x.h.rank, H = (u32)x.a.hidden, S = x.a.nseg;
  const float* weights = reinterpret_cast<const float*>(c.weights);
  const u16* expert_y = reinterpret_cast<const u16*>(c.expert_y);
  const float scale = c.expert_scale;  // of our own rows; a peer's part comes scaled by the peer
  u16* out = reinterpret_cast<u16*>(c.out);
  const bool vec = H % 8u == 0 && (((u64)out | (u64)expert_y) & 15u) == 0;
  const u32 T = (u32)c.num_tokens, whole = Q == 1 ? T - T % g.warps : 0u, items = whole + (T - whole) * S * Q;
  for (u32 item = first_item(g, g.warps / 2u); item < items; item += g.warps) {
    u32 seg = 0;
    const u32 t = item < whole ? item : whole + quot_rem(x.a.div_nseg, (item - whole) / Q, seg);
    const u32 segs = item < whole ? S : 1u;
    // The item's elements [e_begin, e_end): the small kernel skips a part past the row's end before
    // loading anything; the bulk kernel (a whole segment, never empty) works them out after its
    // loads, as it did before the small kernel existed (earlier, it spilled more registers).
    Elems el{0u, 0u};
    if constexpr (Q > 1) {
      el = part_elems(x, seg, (item - whole) % Q, U * STEP);
      if (el.begin >= el.end) continue;  // the row ends before this part
    }
    A2A_PROF_START(t1);
    // The token's routing row, its rows here and its weights: the small kernel loads all three
    // at once (one latency); the bulk kernel, whose registers are tight, one after another.
    constexpr bool early = U < A2A_CHUNKS;
    const i32* token_slots = sym<i32>(x.h, (int)me, x.a.off_slot_of) + ((u64)me * x.M + t) * x.k;
    const i32 early_slot = early ? load_slot_of(token_slots, g.lane, x.k) : 0;
    const float early_w = early && g.lane < x.k ? own_weight(x, weights, t, g.lane) : 0.f;
    const RowSlot lane_slot = load_row_slot(sym<i32>(x.h, (int)me, x.a.off_rows) + ((u64)me * x.M + t) * x.k, g.lane,
                                            x.k, x.a.num_experts);
    const u32 on_lane_rank = lane_rank_slots(lane_slot, x.k, x.a.div_L, g.lane);
    if (g.lane < x.W) here[g.lane] = on_lane_rank;
    if (g.lane < x.k) sc.w[g.lane] = early ? early_w : own_weight(x, weights, t, g.lane);
    const u32 here_me = a2a_shfl((int)on_lane_rank, (int)me);
    const bool own_rows = keep_slots(sc.slots, early ? early_slot : load_slot_of(token_slots, g.lane, x.k), here_me,
                                     x.k, g.lane);
    const u32 mine = own_rows ? here_me : 0u;  // a lost slot: reported already
    const float* w = sc.w;
    const i32* own = sc.slots;
    bool ok = true;
    for (u32 end = seg + segs; ok && seg < end; ++seg) {
      if constexpr (Q == 1) el = part_elems(x, seg, 0u, U * STEP);
      const u32 e_begin = el.begin, e_end = el.end;
      // Our own part of the lane's first chunks is summed before waiting, while
      // the peers' parts are on the way (on GPUs a segment is one pass a lane).
      const u32 e_first = e_begin + g.lane * 8u;
      float acc[U][8] = {};
      if (vec && mine && e_first < e_end) sum_rows<Fmt, U>(acc, expert_y, own, mine, w, scale, H, e_first, e_end);
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
          if (mine) sum_rows<Fmt, U>(acc, expert_y, own, mine, w, scale, H, e0, e_end);
        }
        for (u32 r = 0; r < x.W && ok; ++r)
          if (here[r] && r != me) ok = add_peer_part<Fmt, U>(x, acc, r, t, here[r], w, e0, e_end, pushed, posted);
        for (u32 u = 0; u < U; ++u)
          if (ok && e0 + u * STEP < e_end) store8<Fmt>(out + (u64)t * H + e0 + u * STEP, acc[u]);
      }
      for (u32 e = e_begin + g.lane; !vec && e < e_end; e += A2A_WARP_SIZE) {
        float acc = mine ? sum_rows_at<Fmt>(expert_y, own, mine, w, scale, H, e) : 0.f;
        for (u32 r = 0; r < x.W && ok; ++r)
          if (here[r] && r != me) ok = add_peer_part_at<Fmt>(x, acc, r, t, here[r], w, e, pushed, posted);
        if (ok) out[(u64)t * H + e] = Fmt::store(acc);
      }
      ok = warp_all(ok);  // (the warp moves on to its next segment together)
    }
    if (!ok) break;  // a part never came: reported
    a2a_wave_sync();  // here[] is rewritten for the warp's next item
    A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_REDUCE, t1, me | t << 8);
  }
}

// Whether the host's mirror of the status words holds an error as a part of a combine starts (the host
// gave up on a group_done: pyhipa2a/groups.py). The mirror lies in pinned host memory, whose reads by
// every block went over the bus one after another (a whole grid's took ~290 us at commit 1607218, against
// 22 us for a whole combine): block 0 reads it once and hands the answer on to the other blocks, all
// resident with it, in a word of ours tagged with the call's epoch and the part.
A2A_DEVICE bool host_gave_up(const Ctx& x, u32 phase) {
  u64* verdict = local<u64>(x.a, x.a.off_part_verdict);
  const u32 part = (phase & 0x7fffffffu) << 1;  // (1 .. G, or A2A_REDUCE_ONLY's low bits) and the answer's bit
  if (a2a_block() == 0) {
    const u32 failed = a2a_load_relaxed_sys(x.mirror) != A2A_OK;
    a2a_store_relaxed_sys_u64(verdict, a2a_tag(part | failed, x.epoch));
    return failed;
  }
  for (u32 spins = 1;; ++spins) {
    const u64 w = a2a_load_relaxed_sys_u64(verdict);
    if ((u32)(w >> 32) == x.epoch && ((u32)w & ~1u) == part) return ((u32)w & 1u) != 0u;
    if ((spins & 63u) == 0 && a2a_clock_ns() > x.deadline) {  // (a fault: block 0 runs beside us, if late)
      report(x, A2A_ERR_TIMEOUT, (u32)x.h.rank, A2A_WAIT_PART_VERDICT, phase);
      return true;
    }
    a2a_pause();
  }
}

template <typename Fmt, u32 U, bool Phased>
A2A_DEVICE void combine(const A2AArgs& a, const CombineCall& c) {
  A2A_PROF_BEGIN(a.prof);
  const Ctx x = make_ctx(a, false);
  const WarpGrid g = warp_grid();
  A2A_PROF_START(t0);
  __shared__ i32 slot_buf[A2A_MAX_WARPS_PER_BLOCK][32];
  __shared__ float w_buf[A2A_MAX_WARPS_PER_BLOCK][32];
  const WarpScratch sc{slot_buf[g.warp_in_block], w_buf[g.warp_in_block]};
  // After dispatch(groups=) combine comes in parts (CombineCall.phase), in the Phased kernel: one
  // that sends each group's tokens, queued behind the caller's groups, then the reduce, which also
  // clears the dispatch's counters of landed rows for the next one (every group's rows are in by now).
  const u32 phase = Phased ? c.phase : A2A_WHOLE_COMBINE, G = Phased ? c.groups : 0u;
  const bool sends = phase != A2A_REDUCE_ONLY, reduces = phase == A2A_WHOLE_COMBINE || !sends;
  // A rank that had failed as a part started takes no part in the rest of a combine in parts: its
  // dispatch reported, or the host gave up on a group_done that never came (pyhipa2a/groups.py), which
  // the host says in its mirror of the status words alone (no stream may carry a write past the stuck
  // wait). It sends nothing, as the caller's expert_y rows may never have been written, so its peers
  // time out naming this rank instead of summing them; its reduce waits for nothing, and finish poisons y.
  bool failed_before = false;
  if constexpr (Phased) {
    if (a2a_thread() == 0 && x.mirror && host_gave_up(x, phase)) *block_failed() = 1u;
    a2a_block_sync();
    failed_before = *block_failed() != 0u;
    if (failed_before && !reduces) return;
  }
  // (send_contributions is never called with A2A_REDUCE_ONLY, so a phase there is the whole or 1 .. G)
  if (reduces && G && a2a_block() == 0)
    for (u32 i = a2a_thread(); i < A2A_GROUP_STRIPES * A2A_MAX_GROUPS; i += a2a_block_dim())
      local<u32>(a, a.off_group_landed)[i] = 0u;
  if (a2a_block() == 0 && c.weights && sends) send_weights(x, c, g);
  if (a2a_block() == 0 && a2a_thread() == 0) ready_items(x, A2A_ITEMS_COMBINE);
  // Every header came with dispatch, ours too, so one table serves both steps: the
  // peers' token counts for sending, and our dispatch's choice (pushed back) for
  // reducing. (Alone, there are no peers' tokens and nothing comes back: skip the headers.)
  __shared__ u32 pre[A2A_PREFIX_WORDS];
  bool pushed_back = false, posted = false;
  if (x.W > 1 && !failed_before) {
    source_prefix(x, 0u, pre, false, g);
    pushed_back = (pre[x.W + 3] >> x.h.rank & 1u) != 0u;
    posted = x.a.post_min_tokens && pre[x.W + 2] >= x.a.post_min_tokens;  // the same on every rank
  }
  // A whole combine that posts splits its grid (exchange.h): a share of every block's warps send, the
  // others reduce.
  const GridParts parts = split_grid(g, posted && phase == A2A_WHOLE_COMBINE ? x.a.combine_send_percent : 0u);
  if (sends && parts.sends && x.W > 1 && !failed_before)
    send_contributions<Fmt, U>(x, c, parts.part, sc, pre, phase, G, posted);
  // A lane may still read the warp's scratch (sc.slots, sc.w) for the last
  // contribution it pushed (that path skips the loop's closing sync) when
  // another lane starts rewriting it for its first token.
  a2a_wave_sync();
  if (reduces && parts.receives && !failed_before) reduce_tokens<Fmt, U>(x, c, parts.part, sc, pushed_back, posted);
  A2A_PROF(x.prof, g.lane, A2A_TAG_COMBINE_WARP, t0, 0);
  A2A_PROF_END(a.prof);
  // A part that only sends writes none of the call's outputs, and must not mark the blocks of the
  // leg done before the reduce (finish): its failures reach the reduce through the status words.
  if (!reduces) return;
  const Poison outputs[1] = {{reinterpret_cast<u8*>(c.out), (u64)c.num_tokens * a.y_row_bytes}};
  finish(x, 1u, outputs);
}

// The bulk kernels (a segment a warp) and the small ones (a chunk a warp),
// launched with at most half the threads a block so that a block of either
// takes no more of a multiprocessor's registers than the other
// (pyhipa2a/legs.py: settle_geometry checks that on the device); each also
// as name_phased, the kernel of a combine in parts (after dispatch(groups=)).
#define A2A_COMBINE(name, Fmt, U, threads)                                                                        \
  extern "C" __global__ void A2A_MAX_THREADS(threads) name(A2AArgs a, CombineCall c) { combine<Fmt, U, false>(a, c); } \
  extern "C" __global__ void A2A_MAX_THREADS(threads) name##_phased(A2AArgs a, CombineCall c) {                   \
    combine<Fmt, U, true>(a, c);                                                                                  \
  }
A2A_COMBINE(a2a_combine_f16, F16, A2A_CHUNKS, A2A_MAX_BLOCK_THREADS)
A2A_COMBINE(a2a_combine_bf16, BF16, A2A_CHUNKS, A2A_MAX_BLOCK_THREADS)
A2A_COMBINE(a2a_combine_small_f16, F16, 1u, A2A_MAX_BLOCK_THREADS / 2)
A2A_COMBINE(a2a_combine_small_bf16, BF16, 1u, A2A_MAX_BLOCK_THREADS / 2)
