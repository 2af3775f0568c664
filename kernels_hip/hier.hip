// The steps of a multi-node call that are not the node's own exchange
// (pyhipa2a/hierarchy.py): around an AllToAll over the ranks of one node, a
// rank and its counterparts on the other nodes (same place in their node)
// swap whole regions of tokens through the network engine (NCCL, RCCL, MPI).
//
//   dispatch: hier_stage copies our call into our region (rows, routing,
//   weights, token count and the call's sequence number); the engine swaps
//   regions; hier_localize turns every region's routing into this node's
//   expert numbers (-1: not on this node) for the node's AllToAll, whose
//   region_tokens argument gives each row its true source.
//   combine: the node's AllToAll sums each region's rows over this node's
//   experts; the engine sends each region's sums home; hier_sum adds a
//   token's sums from every node.
//
// Regions move whole (max_num_tokens rows) so that a call needs no host
// round trip and can be captured in a graph. A region whose sequence number
// is not this call's never arrived (the engine timed out and gave up): the
// step that reads it reports a timeout naming the rank it came from into the
// node AllToAll's status, which makes that AllToAll's dispatch send nothing
// and every output poisoned, so no output can read as good.
#include "exchange.h"
#include "formats.h"

// What a timeout between nodes was waiting for (WAIT_WHAT in pyhipa2a/errors.py).
#define A2A_WAIT_NODES 6u          // dispatch: a node's region of tokens
#define A2A_WAIT_NODES_COMBINE 7u  // combine: a node's sums of our tokens
#define A2A_WAIT_NODES_RECORDS 8u  // combine: a node's routing and weights again

// A region's record: routing, weights, then the token count and the sequence
// number of the call that wrote it (hier_record_bytes in hierarchy.py).
struct HierRecord {
  i32* indices;  // [M][k]
  float* weights;
  u32* tail;     // [0] tokens, [1] sequence number
};

struct HierArgs {
  u64 x, indices, weights, x_scales;  // the caller's (hier_stage)
  u64 regions_x;       // u8  [N][M][x_row_bytes]   tokens of each node's counterpart, ours at [node]
  u64 regions_scales;  // u8  [N][M][scale_bytes]   their fp8 scales (given fp8), or 0
  u64 records;         // u8  [N][record_bytes]     HierRecord of each region
  u64 local_indices;   // i32 [N*M][k]              hier_localize: this node's expert of each slot, or -1
  u64 local_weights;   // f32 [N*M][k]
  u64 sequence;        // u32 [4]                   [0] calls this rank staged, [1] combine's seal (hier_seal)
  u64 status, mirror;  // the node AllToAll's status words and their host mirror
  i32 node, nodes, ranks_per_node, place;  // place: our rank within our node
  i32 tokens, max_tokens, top_k, num_experts;
  i32 node_experts;
  u32 x_row_bytes, scale_bytes, record_bytes;
  u32 whole, pad;  // whole: 1 in dispatch (the call's tokens), 0 in combine (only the weights given there)
};

A2A_DEVICE HierRecord record_of(const HierArgs& a, u32 region) {
  u8* base = reinterpret_cast<u8*>(a.records) + (u64)region * a.record_bytes;
  const u64 slots = (u64)a.max_tokens * a.top_k;
  return {reinterpret_cast<i32*>(base), reinterpret_cast<float*>(base + 4 * slots),
          reinterpret_cast<u32*>(base + 8 * slots)};
}

A2A_DEVICE u64 global_thread() { return (u64)a2a_block() * a2a_block_dim() + a2a_thread(); }
A2A_DEVICE u64 global_threads() { return (u64)a2a_grid_dim() * a2a_block_dim(); }

// `bytes` from src to dst, 16 bytes a thread where both allow it.
A2A_DEVICE void copy_span(u8* dst, const u8* src, u64 bytes) {
  if (((u64)dst | (u64)src | bytes) % 16u == 0) {
    vec16* d = reinterpret_cast<vec16*>(dst);
    const vec16* s = reinterpret_cast<const vec16*>(src);
    for (u64 i = global_thread(); i < bytes / 16u; i += global_threads()) d[i] = s[i];
  } else {
    for (u64 i = global_thread(); i < bytes; i += global_threads()) dst[i] = src[i];
  }
}

// Our call into our region, with a new sequence number; in combine (whole 0) only the weights
// given there, which cross to the experts' nodes before the node part sums.
extern "C" __global__ void hier_stage(HierArgs a) {
  const u32 me = (u32)a.node, T = (u32)a.tokens, k = (u32)a.top_k;
  HierRecord r = record_of(a, me);
  if (a.whole) {
    copy_span(reinterpret_cast<u8*>(a.regions_x) + (u64)me * a.max_tokens * a.x_row_bytes,
              reinterpret_cast<const u8*>(a.x), (u64)T * a.x_row_bytes);
    if (a.regions_scales)
      copy_span(reinterpret_cast<u8*>(a.regions_scales) + (u64)me * a.max_tokens * a.scale_bytes,
                reinterpret_cast<const u8*>(a.x_scales), (u64)T * a.scale_bytes);
    copy_span(reinterpret_cast<u8*>(r.indices), reinterpret_cast<const u8*>(a.indices), 4ull * T * k);
  }
  if (a.weights) copy_span(reinterpret_cast<u8*>(r.weights), reinterpret_cast<const u8*>(a.weights), 4ull * T * k);
  if (global_thread() == 0) {
    u32* seq = reinterpret_cast<u32*>(a.sequence);
    seq[0] += 1u;  // this kernel's one thread writes it; the next kernels and the engine read it
    r.tail[0] = T;
    r.tail[1] = seq[0];
  }
}

// Every region's routing as this node's expert numbers: -1 where the expert
// is on another node, where the slot is past the region's tokens, or where it
// breaks the contract (out of range, or repeating an earlier slot of its row:
// our own region's is reported, as a flat dispatch reports it; the others'
// are their senders' to report). Weights are copied beside them.
extern "C" __global__ void hier_localize(HierArgs a) {
  const u32 M = (u32)a.max_tokens, k = (u32)a.top_k, N = (u32)a.nodes, me = (u32)a.node;
  const u32 seq = reinterpret_cast<const u32*>(a.sequence)[0];
  u32* status = reinterpret_cast<u32*>(a.status);
  u32* mirror = reinterpret_cast<u32*>(a.mirror);
  i32* out = reinterpret_cast<i32*>(a.local_indices);
  float* out_w = reinterpret_cast<float*>(a.local_weights);
  for (u64 i = global_thread(); i < (u64)N * M * k; i += global_threads()) {
    const u32 region = (u32)(i / ((u64)M * k)), slot = (u32)(i % ((u64)M * k)), t = slot / k, j = slot % k;
    const HierRecord r = record_of(a, region);
    const bool arrived = region == me || r.tail[1] == seq;
    if (!arrived && slot == 0)  // the rank of that node in our place never sent this call's region
      a2a_report(status, mirror, A2A_ERR_TIMEOUT, region * (u32)a.ranks_per_node + (u32)a.place,
                 a.whole ? A2A_WAIT_NODES : A2A_WAIT_NODES_RECORDS, seq);
    i32 local = -1;
    float w = 0.0f;
    if (arrived && t < r.tail[0]) {
      const i32 e = r.indices[slot];
      bool valid = e >= 0 && e < a.num_experts;
      for (u32 q = 1; q <= j; ++q) valid = valid && r.indices[slot - q] != e;
      if (!valid && region == me) a2a_report(status, mirror, A2A_ERR_BAD_INDEX, me, slot, (u32)e);
      if (valid && e / a.node_experts == (i32)me) local = e % a.node_experts;
      w = r.weights[slot];
    }
    out[i] = local;
    out_w[i] = w;
  }
}

// This rank's status: its status words, or where they hold no error their host mirror, where the host
// alone writes when it gives up on a grouped combine (pyhipa2a/groups.py: no stream may carry it).
A2A_DEVICE u32 own_status(u64 status, u64 mirror) {
  const u32 s = a2a_load_relaxed_sys(reinterpret_cast<const u32*>(status));
  return s != A2A_OK || !mirror ? s : a2a_load_relaxed_sys(reinterpret_cast<const u32*>(mirror));
}

// Combine's seal, once the node's combine is done (its parts too): our status goes home with the sums and
// the sequence number, so a counterpart whose sums would be this rank's poison reports that instead of
// returning NaN as a result.
extern "C" __global__ void hier_seal(HierArgs a) {
  if (global_thread() == 0) reinterpret_cast<u32*>(a.sequence)[1] = own_status(a.status, a.mirror);
}

struct HierSumArgs {
  u64 own;            // [M][hidden] out dtype: our region's sums over this node's experts
  u64 partials;       // [N][M][hidden]: each node's sums of our tokens, sent back ([node] unused)
  u64 seals;          // u32 [N][4]: [r][0] the sequence number that came with node r's sums
  u64 out;            // [T][hidden]
  u64 sequence;       // u32 [4] (HierArgs.sequence)
  u64 status, mirror;
  i32 node, nodes, ranks_per_node, place;
  i32 tokens, max_tokens, hidden, pad;
};

// y[t] = the sum over nodes of their sums of token t, in fp32, rounded once.
// A node whose sums never came is reported (a timeout naming its rank in our
// place), as is one whose rank had failed its part (its sums are poison),
// and y is poisoned (NaN), as is y of a call that failed before.
template <typename Fmt>
A2A_DEVICE void hier_sum(const HierSumArgs& a) {
  const u32 N = (u32)a.nodes, me = (u32)a.node, T = (u32)a.tokens, H = (u32)a.hidden;
  const u32 seq = reinterpret_cast<const u32*>(a.sequence)[0];
  const u32* seals = reinterpret_cast<const u32*>(a.seals);
  u32* status = reinterpret_cast<u32*>(a.status);
  bool ok = true;
  for (u32 r = 0; r < N; ++r) {
    if (r == me || (seals[r * 4u] == seq && seals[r * 4u + 1u] == A2A_OK)) continue;
    ok = false;
    const u32 peer = r * (u32)a.ranks_per_node + (u32)a.place;
    if (global_thread() == 0 && seals[r * 4u] != seq)  // its sums never came
      a2a_report(status, reinterpret_cast<u32*>(a.mirror), A2A_ERR_TIMEOUT, peer, A2A_WAIT_NODES_COMBINE, seq);
    else if (global_thread() == 0)  // they came from a rank whose call had failed: poison, not sums
      a2a_report(status, reinterpret_cast<u32*>(a.mirror), A2A_ERR_PEER, peer, A2A_WAIT_NODES_COMBINE,
                 seals[r * 4u + 1u]);
  }
  // Our status as the seal took it (sequence[1]), not read again here: the mirror is pinned host memory,
  // and reading it took 2.2 ms from every thread of the grid and 0.3 ms from one a block (the reads cross
  // PCIe one after another), where the sum takes 3 us. Nothing changes it in between: the host gives up
  // only on a combine's waits, all passed before the seal, and the reports above set `ok` themselves.
  ok = ok && reinterpret_cast<const u32*>(a.sequence)[1] == A2A_OK;
  const u16* own = reinterpret_cast<const u16*>(a.own);
  const u16* partials = reinterpret_cast<const u16*>(a.partials);
  u16* out = reinterpret_cast<u16*>(a.out);
  for (u64 i = global_thread(); i < (u64)T * H; i += global_threads()) {
    float acc = Fmt::load(own[i]);
    for (u32 r = 0; r < N; ++r)
      if (r != me) acc += Fmt::load(partials[(u64)r * a.max_tokens * H + i]);
    out[i] = ok ? Fmt::store(acc) : (u16)0xffffu;
  }
}

extern "C" __global__ void hier_sum_f16(HierSumArgs a) { hier_sum<F16>(a); }
extern "C" __global__ void hier_sum_bf16(HierSumArgs a) { hier_sum<BF16>(a); }
