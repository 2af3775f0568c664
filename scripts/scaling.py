"""What expert parallelism over several nodes costs on the network: the model behind docs/SCALING.md.

    python3 scripts/scaling.py              # the tables of docs/SCALING.md
    python3 scripts/scaling.py --check-doc  # exit 1 when docs/SCALING.md's tables are not these

For each shape and EP size (nodes of GPUS_PER_NODE GPUs, one rank per GPU, experts spread evenly
over ranks, each token's k experts distinct and uniformly random, as gpu-mode draws them and
pyhipa2a.testing.draw_routing does), the expected bytes one node sends another in one call:
- flat: one copy per (token, destination rank), what a single-node exchange does if its ranks
  simply spanned nodes: a token crosses to every remote rank that hosts one of its experts;
- hierarchical (issue 21): one copy per (token, destination node), forwarded inside that node
  over its own links; combine mirrors it, one partial sum per (token, node) coming back.
Combine sends a raw 16-bit row when the sending rank (flat) or node (hierarchical) hosts one of
the token's experts, and a partial sum over its experts when it hosts several (fp32 by default,
16-bit with narrow partials). Routing rows and weights (at most 8 bytes per expert slot per
copy, under 1% of a row here) are left out. Times are the bytes at line rate, NICS_PER_NODE x
NIC_GBIT per node, all nodes sending at once and the traffic spread evenly over the NICs: what the
wire allows, not a prediction of latency.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from math import comb

GPUS_PER_NODE = 8
NICS_PER_NODE, NIC_GBIT = 8, 400
NODE_BYTES_PER_S = NICS_PER_NODE * NIC_GBIT * 1e9 / 8
EP_SIZES = (16, 32, 64)
FP8_BLOCK = 128
SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpumode_all2all.json")
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "SCALING.md")


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    k: int
    hidden: int
    tokens: int            # per rank and call
    dispatch_bytes: float  # per element of a dispatched row (fp8: its scale's share too)
    partial_bytes: int     # per element of a partial sum in combine
    out_bytes: int = 2     # per element of a raw expert row (16-bit)


def gpu_mode_shapes() -> list[Shape]:
    with open(SHAPES_FILE) as f:
        benchmarks = json.load(f)["benchmarks"]
    return [Shape(f"E={b['num_experts']} k={b['experts_per_token']} H={b['hidden_dim']} M={b['max_num_tokens']}",
                  b["num_experts"], b["experts_per_token"], b["hidden_dim"], b["max_num_tokens"], 2, 4)
            for b in benchmarks]


def deepseek_v3_shapes() -> list[Shape]:
    """DeepSeek-V3's MoE layer (256 routed experts, top-8, hidden 7168): fp8 dispatch with one scale per
    128 elements, bf16 combine with bf16 partial sums; 128 tokens per rank (decode, as DeepEP's
    low-latency figures) and 4096 (prefill, as its normal kernels' figures)."""
    fp8 = 1 + 4 / FP8_BLOCK
    return [Shape(f"DeepSeek-V3 {phase}, T={t}", 256, 8, 7168, t, fp8, 2) for phase, t in (("decode", 128),
                                                                                          ("prefill", 4096))]


def p_any(experts: int, k: int, group: int) -> float:
    """Probability that a token's k distinct experts include at least one of a given `group` of experts."""
    return 1.0 - comb(experts - group, k) / comb(experts, k)


def p_one(experts: int, k: int, group: int) -> float:
    """Probability that exactly one of a token's k distinct experts is in a given `group`."""
    return group * comb(experts - group, k - 1) / comb(experts, k)


@dataclass(frozen=True)
class Cost:
    """Expected bytes one node sends one other node in one call, and what follows from them."""
    flat_dispatch: float
    hier_dispatch: float
    flat_combine: float
    hier_combine: float
    ranks_per_node_hit: float   # ranks of a node that a token reaching that node needs (forwarding fan-out)
    nodes: int

    def seconds(self, pair_bytes: float) -> float:
        """Every node sends every other node `pair_bytes` at once, spread over its NICs."""
        return (self.nodes - 1) * pair_bytes / NODE_BYTES_PER_S


def node_pair_cost(s: Shape, ranks: int, gpus_per_node: int = GPUS_PER_NODE) -> Cost:
    """The model of the module docstring for `ranks` ranks (a multiple of gpus_per_node)."""
    if s.experts % ranks:
        raise ValueError(f"{s.experts} experts do not spread evenly over {ranks} ranks")
    per_rank, per_node = s.experts // ranks, s.experts // ranks * gpus_per_node
    senders = gpus_per_node * s.tokens  # tokens that leave one node per call
    row = s.hidden * s.dispatch_bytes

    def back(group: int) -> float:  # bytes of what one (token, group of experts) pair returns
        one, any_ = p_one(s.experts, s.k, group), p_any(s.experts, s.k, group)
        return (one * s.out_bytes + (any_ - one) * s.partial_bytes) * s.hidden

    rank_hit, node_hit = p_any(s.experts, s.k, per_rank), p_any(s.experts, s.k, per_node)
    return Cost(flat_dispatch=senders * gpus_per_node * rank_hit * row,
                hier_dispatch=senders * node_hit * row,
                flat_combine=senders * gpus_per_node * back(per_rank),
                hier_combine=senders * back(per_node),
                ranks_per_node_hit=gpus_per_node * rank_hit / node_hit,
                nodes=ranks // gpus_per_node)


def tables() -> str:
    """docs/SCALING.md's tables, as markdown."""
    head = ("| shape | EP (nodes) | dispatch MB flat / hier | saved | combine MB flat / hier | saved "
            "| line-rate us, dispatch / combine (hier) |\n"
            "|---|---|---|---|---|---|---|\n")
    out = []
    for title, shapes in (("gpu-mode benchmark shapes (fp16 dispatch, fp32 partial sums; M tokens per rank, "
                           "the most a call may send: gpu-mode draws between 1 and M, about half on average)",
                           gpu_mode_shapes()),
                          ("DeepSeek-V3 (fp8 dispatch with its scales; bf16 combine, partial sums in bf16 too, "
                           "as narrow_partials=True sends them)", deepseek_v3_shapes())):
        rows = []
        for s in shapes:
            for ep in EP_SIZES:
                if s.experts % ep:
                    rows.append(f"| {s.name} | {ep} ({ep // GPUS_PER_NODE}) | fewer experts than ranks | | | | |")
                    continue
                c = node_pair_cost(s, ep)
                mb = 1e-6
                rows.append(
                    f"| {s.name} | {ep} ({c.nodes}) | {c.flat_dispatch * mb:.2f} / {c.hier_dispatch * mb:.2f} "
                    f"| {c.flat_dispatch / c.hier_dispatch:.2f}x "
                    f"| {c.flat_combine * mb:.2f} / {c.hier_combine * mb:.2f} "
                    f"| {c.flat_combine / c.hier_combine:.2f}x "
                    f"| {c.seconds(c.hier_dispatch) * 1e6:.1f} / {c.seconds(c.hier_combine) * 1e6:.1f} |")
        out.append(f"**{title}**\n\n" + head + "\n".join(rows) + "\n")
    return "\n".join(out)


def doc_tables(path: str = DOC) -> str:
    """The tables between the markers of docs/SCALING.md."""
    text = open(path).read()
    begin, end = "<!-- scaling.py begin -->\n", "<!-- scaling.py end -->"
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no '{begin.strip()}' ... '{end}' block")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check-doc", action="store_true", help="compare with docs/SCALING.md instead of printing")
    args = p.parse_args()
    if args.check_doc:
        same = doc_tables() == tables().strip("\n") + "\n"
        print("docs/SCALING.md: " + ("matches" if same else "differs from scripts/scaling.py: regenerate it"))
        return 0 if same else 1
    print(tables())
    return 0


if __name__ == "__main__":
    sys.exit(main())
