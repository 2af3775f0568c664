// The protocol both exchange kernels share (kernels_hip/dispatch.hip and
// kernels_hip/combine.hip): their arguments, the call's epoch, errors and
// poisoning, warp-wide helpers, routing rows, row copies, and the table of
// every source's token count.
//
// Staged data is pulled, never pushed (but see posted contributions below);
// flags are pushed.
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
// Where a flag over pulled data follows a GPU-scope fence (gpu_fence_publish:
// no system-scope release on the path) pulled tokens arrive sooner than
// pushed ones at every size measured, so such a call pushes only its
// contributions back. The sender's choices travel in its token-count header
// (A2A_PUSHED_TOKENS, A2A_PUSHED_BACK), so the receivers of its tokens and the
// contributors to its tokens follow them.
//
// x in the heap. A dispatch whose 16-bit x is our x_stage (NumPy x is
// copied there; AllToAll.x_buffer() hands it to the caller to write into)
// copies nothing into the stage: its flags go out at once, and the peers
// pull its tokens from x_stage (the header's A2A_X_IN_HEAP), which saves a
// read and a write of every token in our memory. Its rows stay put until the
// peers are done with them: a peer reads them in its dispatch, and our
// combine waits for that peer's contributions, which it sends after that
// dispatch; the caller writes x_stage again after our combine. A failed
// call waits for nothing, so a reader looks at the source's status word once
// it has read (dispatch.hip: check_heap_sources) and fails its call too if
// the source failed, rather than hand out rows that may be the next call's.
//
// Posted contributions. A combine whose largest source has at least
// post_min_tokens tokens (every rank knows every source's count from the
// headers, so all agree) stores its contributions into the owners' memory
// instead, a whole token's flags after one system-scope release once all
// of its segments are stored (a single segment's after one of its own;
// scripts/link_probe.cu: a release after each 14 KB row cost a stream of
// stores 1%), and splits its warps
// (combine_send_percent): every block's first warps send while the rest
// reduce our tokens as their parts land, reading them from our own memory. So the link
// (the sends) and our memory (the reduce's reads of our own expert rows)
// work at once, where one grid doing the two in turn took the sum of their
// times (docs/PREFILL.md).
//
// Flags and tagged words carry the call's epoch (never 0), so nothing is
// reset between calls. Headers, staged and pushed tokens alternate by epoch
// parity: a fast peer's next call cannot overwrite what a slow rank is still
// reading, since that peer's next-but-one dispatch needs our next header,
// which we send only after this call's combine is done. The other buffers
// (weights, contributions, pushed or not) are read by their readers before
// the barrier that the next call's headers form. Weights sent by dispatch
// are no exception: a peer's next dispatch overwrites its weights in our
// w_in only after its combine has every contribution we owe it, and we read
// a token's weights before sending its contribution.
#pragma once
#include "profile.h"
#include "protocol.h"

struct A2AArgs {
  HeapView heap;
  u64 local_base;          // heap.bases[heap.rank]: a kernel's first loads (epoch, status) need no table first
  // written by peers
  u64 off_tok_hdr;         // u64 [2][W][M][k]             tagged routing rows of every source, places packed in
  u64 off_tok_count;       // u64 [2][W]                   tagged T of every source
  u64 off_expert_counts;   // u64 [2][W][C][L]             tagged count of the rows of src's route chunk c for our expert l
  u64 off_w_in;            // u64 [W][M][k]                tagged weights of src's tokens: sent by combine, or by dispatch (ours too)
  u64 off_stage_flag;      // u32 [2][W][M][S]             epoch: segment s of src's staged token t is in
  u64 off_contrib_flag;    // u32 [W][M][S]                epoch: segment s of r's contribution to our t is in
  // read by peers
  u64 off_stage;           // u8  [2][M][token_bytes]      our tokens, for peers to pull
  u64 off_x_stage;         // u8  [M][x_row_bytes]         NumPy x copied here, or the caller's x_buffer(): a
                           //                              16-bit x that lies here is pulled from here (A2A_X_IN_HEAP)
  u64 off_contrib;         // u8  [W][M][hidden * 4]       our contribution to token t of owner src, or, in a
                           //                              posting combine, r's contribution to our t
  // written by peers, pushed calls (see "Pushed calls" below)
  u64 off_push_tok;        // u64 [2][W][P][push_token_words] tagged words of src's token t
  u64 off_push_contrib;    // u64 [W][P][push_row_words]   tagged words of r's contribution to our t
  // local
  u64 off_recv_x;          // u8  [recv_rows][x_row_bytes] expert_x
  u64 off_recv_meta;       // i32 [recv_rows][3]           expert_meta
  u64 off_recv_scales;     // f32 [recv_rows][scale_cols]  expert_x_scales (fp8 dispatch)
  u64 off_num_tokens;      // i32 [L]                      expert_num_tokens
  u64 off_rows;            // i32 [W][M][k]                routing rows by (src, t), decoded (-1: void), ours too
  u64 off_slot_of;         // i32 [W][M][k]                row of (src, t, j) in expert_x
  u64 off_layout;          // i32 [L][W][2]                expert_layout (by_source): (first row, rows) of each source
  u64 off_expert_totals;   // u64 [L]                      contiguous: tagged rows of each of our experts this call
  u64 off_row_starts;      // u64 [L]                      contiguous: tagged first row of each of our experts
  u64 off_offsets;         // i32 [L + 1]                  expert_offsets (contiguous): where each expert's rows start
  u64 off_group_landed;    // u32 [STRIPES][MAX_GROUPS]    dispatch(groups=): row segments written, by warp stripe and group
  u64 off_group_ready;     // u32 [MAX_GROUPS]             1: group g's rows are in (lowered by the caller's stream)
  u64 off_part_verdict;    // u64 [1]                      a combine part's look at the host's mirror (combine.hip)
  u64 off_work_items;      // u64 [2][2]                   by kernel (A2A_ITEMS_*), parity: the next item to hand out, the epoch
  u64 off_epoch;           // u32 [2]                      [0] last combined call, [1] last dispatched
  u64 off_status;          // u32 [4]                      first error of this rank
  u64 off_done;            // u32 [2][A2A_MAX_GRID + 1]     epoch: block b of the last dispatch [0] / combine [1] is done; [.][A2A_MAX_GRID]: the poisoner's claim
  u64 host_status;         // u32 [4]                      its mirror in pinned host memory
  u64 host_offsets;        // u64 [L + 1]                  contiguous: expert_offsets for the host, in pinned host
                           //                              memory, each tagged with the call's ticket
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
  u32 token_bytes;         // a staged token: its expert_x row (fp8: then its scales, padded to 16 bytes)
  u32 scale_cols;          // scales of a row (hidden / 128) in fp8 dispatch, else 0
  u32 x_format;            // A2A_X_*: how x becomes expert_x
  u32 fp8_fnuz;            // fp8 dispatch: 1 float8_e4m3fnuz (MI300X), 0 float8_e4m3fn
  u32 push_token_words;    // a pushed token's words in a peer's inbox (fp8: fp8.h's layout)
  u32 x_seg_elems;         // dispatch's segments: seg_elems, twice that in fp8 (as many bytes)
  u32 x_nseg;              // ceil(hidden / x_seg_elems)
  u32 route_chunk;         // tokens a block routes in dispatch (pyhipa2a/kernels.py: route_chunk)
  u32 void_slots;          // 1: a negative index is a slot with no expert here (not an error); a node's part
                           // of a multi-node call (pyhipa2a/hierarchy.py), and dispatch refuses to start
                           // once this rank's status holds an error (a failed exchange between nodes)
  u32 region_tokens;       // R > 0: token t of source s came from rank (t / R) * W + s, as its token t % R
                           // (a node's part of a multi-node call: regions of R tokens, one per node)
  u32 gpu_fence_publish;   // 1: a flag over data left in our own memory follows a GPU-scope fence,
                           // not a system-scope release (portability.h: a2a_publish_own_sys)
  u32 by_source;           // 1: expert l's rows from source s start at row s * M (expert_layout), not after
                           // the rows of every source before s (packed, the default)
  u32 row_align;           // > 0: contiguous, expert l's rows (packed) from row expert_offsets[l] of one [R] buffer,
                           // each expert's first row a multiple of row_align; 0: expert l's from row l * W * M
  u32 recv_rows;           // rows of expert_x: L * W * M, or R contiguous
  u32 post_min_tokens;     // > 0: a combine whose largest source has at least this many tokens posts its
                           // contributions (stores them into their owners' memory); 0: never
  u32 combine_send_percent; // > 0: a posting combine's share of every block's warps that send while the
                            // others reduce; 0: every warp sends, then reduces
  u32 pad;
  u64 timeout_ns;
  // The call's fixed divisors (pyhipa2a/kernels.py: divisor), for quot/rem below.
  Divisor div_k;           // top_k
  Divisor div_L;           // local_experts
  Divisor div_E;           // num_experts
  Divisor div_x_nseg;      // dispatch's segments of a row
  Divisor div_chunk;       // route_chunk
  Divisor div_chunks;      // route chunks of a call of max_tokens tokens (d: their number)
  Divisor div_W;           // heap.world
  Divisor div_peers;       // heap.world - 1 (1 for a world of one)
  Divisor div_nseg;        // combine's segments of a row
};

// How dispatch turns x into expert_x.
#define A2A_X_COPY 0u            // 16-bit rows as they are
#define A2A_X_FP8 1u             // fp8 rows with their block scales (x_scales), as they are
#define A2A_X_QUANTIZE_F16 2u    // fp16 rows quantized to fp8 on the way (fp8.h)
#define A2A_X_QUANTIZE_BF16 3u   // bf16 rows likewise

struct DispatchCall {
  u64 x;          // [T][hidden] of in_dtype
  u64 indices;    // i32 [T][k]
  u64 x_scales;   // f32 [T][scale_cols] (A2A_X_FP8 only)
  u64 weights;    // f32 [T][k] sent with the routing (combine then needs none), or 0: combine sends them
  i32 num_tokens;
  u32 groups;     // G > 0: raise a readiness word per group of our experts as its rows land (0: none)
  u32 ticket;     // > 0 (contiguous): expert_offsets go to the host too, tagged with this (the host's call number)
  u32 check_pairing;  // 1: refused where the dispatch before was never combined (make_ctx); only a JAX
                      // program may drop a combine, so only its calls ask (the host pairs its own)
  // Where the outputs land: our own buffers (off_recv_x, ...: pyhipa2a/kernels.py, name_own_outputs), or the
  // caller's (pyhipa2a.jax: XLA's result buffers). Only this rank's dispatch writes them and combine reads none.
  u64 expert_x;           // [recv_rows][x_row_bytes]
  u64 expert_meta;        // i32 [recv_rows][3]
  u64 expert_scales;      // f32 [recv_rows][scale_cols]
  u64 expert_num_tokens;  // i32 [L]
  u64 expert_layout;      // i32 [L][W][2]
  u64 expert_offsets;     // i32 [L + 1]
};

struct CombineCall {
  u64 expert_y;   // [recv_rows][y_row_bytes], local
  u64 weights;    // f32 [T][k], or 0: dispatch sent them (our own are in our w_in)
  u64 out;        // [T][hidden]
  i32 num_tokens;
  float expert_scale;  // our expert rows count as expert_y * this (a fused elementwise epilogue; 1: none)
  u32 phase;      // A2A_WHOLE_COMBINE (0); or after dispatch(groups=G): g + 1 for g < G, send the contributions
                  // of the tokens whose last group here is g; A2A_REDUCE_ONLY, the reduce alone
  u32 groups;     // the dispatch's G (0: none)
};
#define A2A_WHOLE_COMBINE 0u
#define A2A_REDUCE_ONLY 0xffffffffu

// dispatch(groups=): a group's landed-rows counter is striped over warps, each stripe in a line of its
// own (a group's adds would otherwise all meet at one address).
#define A2A_MAX_GROUPS 32u
#define A2A_GROUP_STRIPES 32u
A2A_DEVICE u32 group_stripe(u32 warp, u32 group) { return (warp % A2A_GROUP_STRIPES) * A2A_MAX_GROUPS + group; }

// The call's epoch lives on the device, not in the arguments, so a captured
// graph replays with a fresh epoch each time. Dispatch takes the successor of
// epoch[0] and leaves it in epoch[1]; its combine takes epoch[1] and leaves it
// in epoch[0]. No kernel writes the word it reads, so every block of a launch
// sees the same value (the previous launch wrote it). Never 0 (flags start
// zeroed), and odd and even alternate even across the wrap (inbox parity).
A2A_DEVICE u32 next_epoch(u32 e) { return e % 0xFFFFFFFEu + 1u; }

// Our own copy of a symmetric object, from the arguments alone.
template <typename T>
A2A_DEVICE T* local(const A2AArgs& a, u64 offset) {
  return reinterpret_cast<T*>(a.local_base + offset);
}

// The call's epoch as the launch finds it; make_ctx hands it on.
A2A_DEVICE u32 read_epoch(const A2AArgs& a, bool dispatch) {
  const u32* words = local<u32>(a, a.off_epoch);
  return dispatch ? next_epoch(a2a_load_relaxed_sys(&words[0])) : a2a_load_relaxed_sys(&words[1]);
}

#define A2A_MAX_LOCAL_EXPERTS 1024  // the fake expert's prefix of the counts, in shared memory
#define A2A_MAX_WARPS_PER_BLOCK 32
#define A2A_MAX_BLOCK_THREADS 512  // MAX_BLOCK_THREADS in pyhipa2a/config.py
#define A2A_MAX_WORLD 32
#define A2A_PREFIX_WORDS (A2A_MAX_WORLD + 5)  // source_prefix's table
#define A2A_MAX_GRID 4096u  // blocks of an exchange kernel's launch (MAX_GRID_BLOCKS in pyhipa2a/config.py)
#define A2A_CHUNKS 4  // 8-element chunks per lane whose loads are issued together

struct WarpGrid {
  u32 lane, warp, warps, warp_in_block, warps_per_block;
};

A2A_DEVICE WarpGrid warp_grid() {
  const u32 per_block = a2a_block_dim() / A2A_WARP_SIZE, in_block = a2a_thread() / A2A_WARP_SIZE;
  return {a2a_lane(), a2a_block() * per_block + in_block, a2a_grid_dim() * per_block, in_block, per_block};
}

// A posting combine's grid in two (posted contributions, above): `percent` of every block's warps (at
// least one, and one fewer than the block's) send, the others receive. Taken from every block, so that
// every multiprocessor sends: where the first blocks sent, about half of them did (docs/PREFILL.md). Each
// part is a grid of its own: its warps number from 0 and its items stride over its warps; warp_in_block
// stays the warp's place in its block (its scratch). The grid stays whole where percent is 0 or a block
// has one warp.
struct GridParts {
  WarpGrid part;
  bool sends, receives;
};
A2A_DEVICE GridParts split_grid(const WarpGrid& g, u32 percent) {
  if (percent == 0u || g.warps_per_block < 2u) return {g, true, true};
  u32 send = g.warps_per_block * percent / 100u;
  send = send < 1u ? 1u : send >= g.warps_per_block ? g.warps_per_block - 1u : send;
  const bool sends = g.warp_in_block < send;
  WarpGrid p = g;
  p.warps_per_block = sends ? send : g.warps_per_block - send;
  p.warps = a2a_grid_dim() * p.warps_per_block;
  p.warp = a2a_block() * p.warps_per_block + (sends ? g.warp_in_block : g.warp_in_block - send);
  return {p, sends, !sends};
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

// Set by report() in the block of the thread that reports, whoever wins the
// race for the status words: that block poisons the call's outputs (finish).
A2A_DEVICE u32* block_failed() {
  __shared__ u32 failed;
  return &failed;
}

// Set by make_ctx in each block of a dispatch whose predecessor was never combined: the block does no
// work, and poisons its share of the outputs (finish).
A2A_DEVICE u32* block_unpaired() {
  __shared__ u32 unpaired;
  return &unpaired;
}

// The first thing every exchange kernel does: the block's shared state, set up in one round trip and one
// barrier. The block's last thread loads the call's epoch and this rank's status (the block's failure flag:
// set when the status already holds an error, an earlier call's, so that this call's outputs are poisoned
// too), threads below W the heap's table of bases, all in flight together; shared memory hands them to the
// block. (Not thread 0: a thread issues its loads in order, and thread 0's copy of base 0 into shared
// memory waited for its load before the words' loads went out, two round trips in a row at every launch on
// sm_90. The last thread copies a base too only in a block of no more threads than ranks.) The table is
// kept there because a loop that stores through a peer's pointer must load that peer's base again after
// each store (the store might have changed it): tens of cycles from shared memory, a round trip in series
// with the next store from global memory. The epoch is loaded once a block, not by every thread: 2112
// warps' system-scope loads of the one word cost 0.5 us of every launch of the full grid on two H200s
// (measured at commit 3cbf100).
// Block 0 hands the epoch on once it is in.
//
// A dispatch whose predecessor was never combined would take that one's epoch again, and read its flags as
// this call's: it is refused (A2A_ERR_UNPAIRED), and writes nothing but poison. The host pairs its own
// calls; a JAX program can drop a combine whose result it never uses (pyhipa2a.jax), and only its calls ask
// (DispatchCall.check_pairing). Every block asks for itself, of its own flag done[0][block], which the
// uncombined dispatch left at the epoch this one takes (the grid is the same at every launch; any other
// dispatch left an older epoch): the words epoch[0] and epoch[1] cannot tell a block that the call is
// refused once block 0 has handed the epoch on.
A2A_DEVICE_CALLED void report_failure(u32* status, u32* mirror, u32 trap_on_timeout, u32 code, u32 peer, u32 what,
                                      u32 detail);  // (below)
A2A_DEVICE Ctx make_ctx(const A2AArgs& a, bool dispatch, bool check_pairing = false) {
  __shared__ u64 bases[A2A_MAX_WORLD];
  __shared__ u32 block_epoch;
  u32* status = local<u32>(a, a.off_status);
  if (a2a_thread() < (u32)a.heap.world) bases[a2a_thread()] = a.heap.bases[a2a_thread()];
  if (a2a_thread() == a2a_block_dim() - 1u) {
    // (its loads in flight together: the report, when there is one, comes after them)
    const u32 epoch = read_epoch(a, dispatch);
    const u32 unpaired = check_pairing && a2a_load_relaxed_sys(local<u32>(a, a.off_done) + a2a_block()) == epoch;
    const u32 failed = a2a_load_relaxed_sys(status) != A2A_OK;
    block_epoch = epoch;
    *block_unpaired() = unpaired;
    *block_failed() = failed;
    if (unpaired)  // (sets the block's failure flag too)
      report_failure(status, reinterpret_cast<u32*>(a.host_status), 0u, A2A_ERR_UNPAIRED, (u32)a.heap.rank, 0u,
                     epoch);
  }
  a2a_block_sync();
  const u32 epoch = block_epoch;
  const HeapView h{bases, a.heap.rank, a.heap.world};
  if (a2a_block() == 0 && a2a_thread() == 0) local<u32>(a, a.off_epoch)[dispatch ? 1 : 0] = epoch;
  return {a, h, status, reinterpret_cast<u32*>(a.host_status),
          a.prof, a2a_clock_ns() + a.timeout_ns, (u32)a.heap.world, (u32)a.max_tokens, (u32)a.top_k,
          (u32)a.local_experts, (u32)(a.heap.world * a.max_tokens), epoch & 1u, epoch};
}

// Every error a kernel of this file sees goes through here: the first one is
// kept (protocol.h), and with on_timeout="trap" a timeout then aborts the
// kernel, which leaves the process's device context unusable: every later
// device operation fails loudly, for callers that never synchronize.
// Out of line (one copy, called only on failure), so that the dozens of places that may fail do
// not each put its code on the paths of healthy calls, whose instructions are what a small call
// waits for (measured at commit a646949).
A2A_DEVICE_CALLED void report_failure(u32* status, u32* mirror, u32 trap_on_timeout, u32 code, u32 peer, u32 what,
                                      u32 detail) {
  *block_failed() = 1u;
  // Only the first reporter traps, once its report is in the host's mirror: a thread that traps
  // while another is still writing the mirror would leave the host an error it cannot name.
  if (a2a_report(status, mirror, code, peer, what, detail) && code == A2A_ERR_TIMEOUT && trap_on_timeout) a2a_trap();
}
A2A_DEVICE void report(const Ctx& x, u32 code, u32 peer, u32 what, u32 detail) {
  report_failure(x.status, x.mirror, x.a.trap_on_timeout, code, peer, what, detail);
}

// Every block calls this last, with its call's outputs (all-ones bytes are
// NaN in every float format we write and -1 in the counts and the meta). A
// failed call's outputs must read as poison, and a healthy call must not
// pay for that with a round trip at its end: every block releases its flag
// done[leg][block] = epoch (thread 0, after the barrier, so the block's
// writes are ordered before it) and leaves. A block that saw a failure (a
// report from one of its threads, or this rank's status already failed as
// the launch began: make_ctx) then waits for every block's flag, so
// that every write of the call to its outputs is visible, and the first
// such block to claim the launch (done[leg][A2A_MAX_GRID]) overwrites the
// outputs: no good row can land after the poison, and the outputs are
// written once however many blocks failed (all of them, when the rank had
// failed before). Flags carry the epoch (each leg's launches have distinct
// epochs: the host alternates dispatch and combine, graph launches
// included), so nothing is reset between calls.
struct Poison {
  u8* p;
  u64 bytes;
  // each 4-byte word of the region becomes this: all ones make NaN rows and -1 counts; contiguous
  // rows' offsets all become R instead, offsets a grouped GEMM still reads without a fault (group 0
  // then spans every row, NaN, and expert_offsets[0] != 0 says so), so the call's own error is the
  // one its caller sees, not the GEMM's
  u32 word = 0xffffffffu;
};
// Words to raise (1) once a failed call's outputs are poisoned: dispatch's
// group readiness words, which streams may wait for on the device.
struct Raise {
  u32* words;
  u32 n;
};
// All threads of a block poison bytes first .. first + n - 1 of `o` (n: a multiple of 4 where o takes a word).
A2A_DEVICE void poison_range(const Poison& o, u64 first, u64 n) {
  if (o.word == 0xffffffffu)
    a2a_fill_bytes(o.p + first, n, 0xffu);
  else
    a2a_fill_words(reinterpret_cast<u32*>(o.p + first), n / 4u, o.word);
}
//
// A dispatch refused as it started (block_unpaired) wrote nothing, and its flags' barrier would not
// hold (they carry its epoch already, from the dispatch never combined): each block poisons its own
// share of each output instead, and no block claims the launch.
template <u32 N>
A2A_DEVICE void poison_share(const Poison (&outputs)[N]) {
  for (u32 i = 0; i < N; ++i) {
    const u64 bytes = outputs[i].bytes, share = ((bytes + a2a_grid_dim() - 1u) / a2a_grid_dim() + 15u) & ~15ull;
    const u64 first = share * a2a_block(), n = first < bytes ? (bytes - first < share ? bytes - first : share) : 0u;
    poison_range(outputs[i], first, n);
  }
}

template <u32 N>
A2A_DEVICE void finish(const Ctx& x, u32 leg, const Poison (&outputs)[N], Raise raise = {nullptr, 0u}) {
  u32* done = local<u32>(x.a, x.a.off_done) + leg * (A2A_MAX_GRID + 1u);
  a2a_release_before_barrier_dev();
  a2a_block_sync();
  const bool poison = *block_failed() != 0u;
  if (a2a_thread() == 0) a2a_store_release_dev(&done[a2a_block()], x.epoch);
  if (!poison) return;
  if (leg == 0u && *block_unpaired()) {
    poison_share(outputs);  // (and raises no group's word: only JAX drops a combine, and it takes no groups)
    return;
  }
  // Every other block is bounded by the call's deadline; past twice that, poison regardless.
  // (The host keeps timeout_ns below 2^62, so neither sum wraps.)
  const u64 give_up = x.deadline + x.a.timeout_ns;
  for (u32 b = a2a_thread(); b < a2a_grid_dim(); b += a2a_block_dim())
    while (a2a_load_acquire_dev(&done[b]) != x.epoch && a2a_clock_ns() < give_up) a2a_pause();
  __shared__ u32 claimed;
  if (a2a_thread() == 0) claimed = a2a_exchange_dev(&done[A2A_MAX_GRID], x.epoch) != x.epoch;
  a2a_block_sync();
  if (!claimed) return;
  for (u32 i = 0; i < N; ++i) poison_range(outputs[i], 0u, outputs[i].bytes);
  if (!raise.n) return;
  a2a_release_before_barrier_dev();
  a2a_block_sync();  // the poison is written
  if (a2a_thread() < raise.n) a2a_store_release_sys(raise.words + a2a_thread(), 1u);
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

// True in every lane when any lane below k has `flag` set. (These take one vote each: the
// shuffle loops they replace were k and log2(warp) shuffles on every item's path.)
A2A_DEVICE bool warp_any(bool flag, u32 lane, u32 k) { return a2a_ballot(flag && lane < k) != 0u; }

// True in every lane when `ok` holds in every lane of the warp.
A2A_DEVICE bool warp_all(bool ok) { return a2a_ballot(!ok) == 0u; }

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
A2A_DEVICE u32 slots_on(const RowSlot& s, const Divisor& L, u32 r) {
  return (u32)a2a_ballot(s.valid && quot(L, (u32)s.e) == r);  // (valid only in lanes below k)
}

// Bit r set, in every lane: a valid slot lives on rank r.
A2A_DEVICE u32 ranks_hosting(const RowSlot& s, u32 k, const Divisor& L) {
  u32 bits = 0;
  const int mine = s.valid ? (int)(1u << quot(L, (u32)s.e)) : 0;
  for (u32 i = 0; i < k; ++i) bits |= (u32)a2a_shfl(mine, (int)i);
  return bits;
}

// Lane r gets slots_on(s, L, r): every rank's slots at once.
A2A_DEVICE u32 lane_rank_slots(const RowSlot& s, u32 k, const Divisor& L, u32 lane) {
  u32 bits = 0;
  const int rank = s.valid ? (int)quot(L, (u32)s.e) : -1;
  for (u32 i = 0; i < k; ++i) {
    if (a2a_shfl(rank, (int)i) == (int)lane) bits |= 1u << i;
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


// Count header bits: the source pushes this call's tokens (without it they
// are staged and pulled), and it takes its contributions pushed back
// (without it they are left for it to pull). A pushed call has the second;
// it has the first too unless its flags over pulled data follow a GPU-scope
// fence (gpu_fence_publish), with which its pulled tokens arrive sooner. A
// third says its pulled tokens lie in its x_stage (x in the heap, above).
#define A2A_PUSHED_TOKENS 0x80000000u
#define A2A_PUSHED_BACK 0x40000000u
#define A2A_X_IN_HEAP 0x20000000u
#define A2A_HEADER_COUNT(h) ((h) & ~(A2A_PUSHED_TOKENS | A2A_PUSHED_BACK | A2A_X_IN_HEAP))

// A step's items start at warp `first` and wrap around the grid. Steps start
// at different warps, so on small calls they run side by side instead of
// queueing in the same warps, and the warps that store to peers (the routing
// blocks', the senders') are not the ones whose releases must wait for those
// stores to land.
// (No divide on this path: `first` is below the grid's warps but for grids smaller than a step's
// offset (one block; dispatch's senders on a grid of no more blocks than route chunks), and the sum
// below is under twice them.)
A2A_DEVICE u32 first_item(const WarpGrid& g, u32 first) {
  const u32 f = first < g.warps ? first : first % g.warps, q = g.warp + g.warps - f;
  return q >= g.warps ? q - g.warps : q;
}

// Items handed out as warps ask for them, where a fixed share (first_item's stride) would not
// balance: dispatch's fan-out and combine's contributions at prefill sizes. Their items differ in
// cost (a peer's token is pulled over the link, our own read here; each token has its own count of
// experts here), and the fan-out's sources alternate item by item, so that a stride of a grid that
// W divides would give each warp one source's tokens only (at two ranks, half the grid would read
// its own tokens and idle while the other half pulled). Each warp's first item is first_item's; a
// counter hands out the rest. The counters live in our own memory, one a kernel and parity, with
// the call's epoch in the high half, and each kernel readies the other parity's for the next call
// (ready_items: a plain store, as no kernel of the call before can still run: every call of an
// object queues behind the one before it), so that a call's asks find theirs ready. A counter that
// another call left (an object's first call, or one after a failure) is put right by the first warp
// that finds it so, with a compare-and-swap that also takes item 0 (claim_counter), so that no
// count left by another call can skip an item. Lane 0 asks; the answer is taken once the item in
// hand is done (ask_item, take_item), so that the atomic's round trip overlaps that item.
#define A2A_ITEMS_DISPATCH 0u
#define A2A_ITEMS_COMBINE 1u
A2A_DEVICE u64* item_counter(const Ctx& x, u32 kernel, u32 parity) {
  return local<u64>(x.a, x.a.off_work_items) + kernel * 2u + parity;
}
A2A_DEVICE void ready_items(const Ctx& x, u32 kernel) {
  *item_counter(x, kernel, x.parity ^ 1u) = (u64)next_epoch(x.epoch) << 32;
}
A2A_DEVICE u64 ask_item(const Ctx& x, u32 kernel, u32 lane) {
  return lane == 0 ? a2a_fetch_add_relaxed_dev_u64(item_counter(x, kernel, x.parity), 1ull) : 0ull;
}
// (out of line: rare, and its registers stay off the items' path)
A2A_DEVICE_CALLED u64 claim_counter(u64* counter, u32 epoch, u64 asked) {
  const u64 ours = (u64)epoch << 32;
  u64 expect = asked + 1ull;  // the counter as our ask left it
  while ((u32)(asked >> 32) != epoch) {
    const u64 seen = a2a_cas_relaxed_dev_u64(counter, expect, ours | 1ull);
    if (seen == expect)
      asked = ours;  // this call's now, and its item 0 is ours
    else if ((u32)(seen >> 32) == epoch)
      asked = a2a_fetch_add_relaxed_dev_u64(counter, 1ull);
    else
      expect = seen;  // still another call's, moved on by other warps' asks
  }
  return asked;
}
A2A_DEVICE u32 take_item(const Ctx& x, u32 kernel, u64 asked, u32 lane) {
  if (lane == 0 && (u32)(asked >> 32) != x.epoch)
    asked = claim_counter(item_counter(x, kernel, x.parity), x.epoch, asked);
  return (u32)a2a_shfl((int)(u32)asked, 0);
}
// A warp's items after its first: handed out by the counter of `kernel`, or (not `handed`) a stride of
// the grid on. The loop asks (ask) as it starts an item and takes the answer (next) once it is done:
//   for (u32 item = first_item(g, f); item < items; item = hand.next(x, g, item)) { hand.ask(x, g.lane); ... }
struct ItemHand {
  u32 kernel;
  bool handed;
  u64 asked;
  A2A_DEVICE void ask(const Ctx& x, u32 lane) {
    if (handed) asked = ask_item(x, kernel, lane);
  }
  A2A_DEVICE u32 next(const Ctx& x, const WarpGrid& g, u32 item) const {
    return handed ? g.warps + take_item(x, kernel, asked, g.lane) : item + g.warps;
  }
};

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

// Between two tries of a poll: false once the deadline passed (reported, naming
// `peer`) or this rank already failed, else a pause.
A2A_DEVICE bool poll_on(const Ctx& x, u32 spins, u32 peer, u32 what, u32 detail) {
  if ((spins & 63u) == 0) {
    if (a2a_clock_ns() > x.deadline) {
      report(x, A2A_ERR_TIMEOUT, peer, what, detail);
      return false;
    }
    if (a2a_load_relaxed_sys(&x.status[0]) != A2A_OK) return false;
  }
  a2a_pause();
  return true;
}

// True once the lane's `count` tagged words p[i * stride] carry the call's
// epoch (their values in v); false on timeout (reported, naming `peer`) or
// when this rank already failed. A word is read whole, so seeing the epoch
// is seeing the value: no fence, no flag.
//
// (It looks at each word as it loads it and leaves at `count`: where `count`
// is not known to the compiler, each load waits for the one before it. For
// many words a lane, take_batch below.)
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
    if (!poll_on(x, spins, peer, what, detail)) return false;
  }
}

// take_tagged for many words a lane: every load of a try is issued before
// any word is looked at, so a try is one round trip, not `count` of them in
// series (a pushed 16-bit token segment, 16 words a lane, took 4 us an event
// on two H200s that way; fp8.h's take_piece does the same for fp8 pieces).
template <u32 N>
A2A_DEVICE bool take_batch(const Ctx& x, const u64* p, u32 stride, u32 count, u32 (&v)[N], u32 peer, u32 what,
                           u32 detail) {
  for (u32 spins = 1;; ++spins) {
    u64 w[N];
    for (u32 i = 0; i < N; ++i)
      if (i < count) w[i] = a2a_load_relaxed_sys_u64(p + (u64)i * stride);
    bool all = true;
    for (u32 i = 0; i < N; ++i) {
      if (i < count) {
        v[i] = (u32)w[i];
        all = all && (u32)(w[i] >> 32) == x.epoch;
      }
    }
    if (all) return true;
    if (!poll_on(x, spins, peer, what, detail)) return false;
  }
}

// Token counts of every source as a prefix: pre[src] = tokens of sources
// before src, pre[W] = all of them, pre[W + 1] the mask of sources that
// push their tokens, pre[W + 2] the most tokens of any source, pre[W + 3]
// the mask of sources that take their contributions pushed back and pre[W + 4]
// that of sources whose tokens lie in their x_stage; `pre` is the block's
// (shared memory, A2A_PREFIX_WORDS), every warp of the block calls.
// Warp 0's lane r waits for r's header (when `wait`: dispatch, where our own
// is `my_header`; combine reads every header, ours too, as dispatch left
// them): one poller per block, not per warp, on the words peers write. Item
// spaces below are over tokens that exist, not over W * M slots (sources
// times the most tokens of any source for the token-major bulk steps): a
// call with one token per rank costs one item (or segment) per rank.
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
      u32 pushed = 0, pushed_back = 0, in_heap = 0, most = 0;
      pre[0] = 0;
      for (u32 r = 1; r <= x.W; ++r) {
        const u32 n = A2A_HEADER_COUNT(pre[r]) < x.M ? A2A_HEADER_COUNT(pre[r]) : x.M;
        if (pre[r] & A2A_PUSHED_TOKENS) pushed |= 1u << (r - 1u);
        if (pre[r] & A2A_PUSHED_BACK) pushed_back |= 1u << (r - 1u);
        if (pre[r] & A2A_X_IN_HEAP) in_heap |= 1u << (r - 1u);
        pre[r] = pre[r - 1] + n;
        most = n > most ? n : most;
      }
      pre[x.W + 1] = pushed;
      pre[x.W + 2] = most;
      pre[x.W + 3] = pushed_back;
      pre[x.W + 4] = in_heap;
    }
  }
  a2a_block_sync();
  // This block's view of failure, no round trip: a header that never came (reported above), or
  // this rank failed before the call. Another block's failure stops this one at its next wait.
  return *block_failed() == 0u;
}

// Item q of a token-major space over n sources from `first` on (mod W): token
// q / n of source first + q % n; false when that source has fewer tokens (a
// gap: the space is n * the most tokens of any source). Bulk steps walk
// their tokens this way: all sources at once, each rank starting with its
// successor. Source-major order had every rank pulling from rank 0's memory
// first, then rank 1's, so one rank's links carried the whole wave while the
// others idled (it did not matter with two ranks).
// (`n` <= W comes as its divisor, and `first` <= W, so the source wraps at most once.)
A2A_DEVICE bool token_major(const u32* pre, u32 W, u32 first, const Divisor& n, u32 q, u32& src, u32& t) {
  t = quot_rem(n, q, src);
  src += first;
  src = src >= W ? src - W : src;
  return t < pre[src + 1] - pre[src];
}
