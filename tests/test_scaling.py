"""scripts/scaling.py, the inter-node cost model of docs/SCALING.md: its expectations against copies
counted on routing drawn as the tests draw it, its counting against the library's own traffic model,
and the document against the script."""
import numpy as np
import pytest

from pyhipa2a.testing import draw_routing
from pyhipa2a.traffic import link_bytes
from tests.script_modules import load_script

scaling = load_script("scaling")


def counted_pair_bytes(routing, s, gpus_per_node: int, src_node: int, dst_node: int) -> dict:
    """Bytes node src_node sends node dst_node for the routing drawn (one [T, k] array per rank),
    counted token by token: flat, one copy per (token, rank) and one contribution back per
    (token, rank); hierarchical, one per (token, node)."""
    ranks = len(routing)
    per_rank = s.experts // ranks
    out = dict(flat_dispatch=0.0, hier_dispatch=0.0, flat_combine=0.0, hier_combine=0.0)
    row, raw, partial = s.hidden * s.dispatch_bytes, s.hidden * s.out_bytes, s.hidden * s.partial_bytes
    for src in range(src_node * gpus_per_node, (src_node + 1) * gpus_per_node):
        expert_rank = routing[src] // per_rank
        expert_node = expert_rank // gpus_per_node
        on_node = (expert_node == dst_node).sum(axis=1)
        out["hier_dispatch"] += np.count_nonzero(on_node) * row
        out["hier_combine"] += np.count_nonzero(on_node == 1) * raw + np.count_nonzero(on_node > 1) * partial
        for dst in range(dst_node * gpus_per_node, (dst_node + 1) * gpus_per_node):
            on_rank = (expert_rank == dst).sum(axis=1)
            out["flat_dispatch"] += np.count_nonzero(on_rank) * row
            out["flat_combine"] += np.count_nonzero(on_rank == 1) * raw + np.count_nonzero(on_rank > 1) * partial
    return out


@pytest.mark.parametrize("experts,k,ranks,gpus_per_node", [(64, 6, 16, 8), (128, 8, 32, 8), (256, 8, 16, 4)])
def test_the_model_expects_what_drawn_routing_sends(experts, k, ranks, gpus_per_node):
    tokens = 3000
    s = scaling.Shape("t", experts, k, 512, tokens, 1 + 4 / 128, 4)  # fp32 partials: unlike a raw row
    rng = np.random.default_rng(experts * 1000 + ranks)
    routing = [draw_routing(rng, tokens, k, experts) for _ in range(ranks)]
    counted = counted_pair_bytes(routing, s, gpus_per_node, 0, 1)
    model = scaling.node_pair_cost(s, ranks, gpus_per_node)
    for name, value in counted.items():
        # Tens of thousands of draws behind each count: 2% is several standard deviations.
        assert value == pytest.approx(getattr(model, name), rel=0.02), name
    assert model.flat_dispatch / model.hier_dispatch == pytest.approx(model.ranks_per_node_hit)
    assert model.nodes == ranks // gpus_per_node


def test_the_counting_agrees_with_the_library_traffic_model():
    # With one rank per node, flat and hierarchical are the same and a node pair is a rank pair: summed
    # over destinations, the counted dispatch payload is traffic.link_bytes' less its headers.
    E, k, H, ranks, T = 32, 4, 256, 4, 200
    s = scaling.Shape("t", E, k, H, T, 2, 4)
    rng = np.random.default_rng(7)
    routing = [draw_routing(rng, T, k, E) for _ in range(ranks)]
    dispatch, combine = link_bytes(routing, E, H, in_itemsize=2, out_itemsize=2)
    headers = (ranks - 1) * (T * k + 1 + E // ranks) * 8
    weights = (ranks - 1) * T * k * 8
    for src in range(ranks):
        sent = [counted_pair_bytes(routing, s, 1, src, dst) for dst in range(ranks) if dst != src]
        assert sum(c["flat_dispatch"] for c in sent) == dispatch[src] - headers
        assert all(c["flat_dispatch"] == c["hier_dispatch"] for c in sent)
    returned = [sum(counted_pair_bytes(routing, s, 1, dst, src)["flat_combine"] for src in range(ranks) if src != dst)
                for dst in range(ranks)]  # what rank dst's tokens get back from everyone else
    assert sum(returned) == sum(combine) - ranks * weights


def test_line_rate_time_is_the_busiest_node_egress_over_its_nics():
    s = scaling.Shape("t", 256, 8, 7168, 128, 2, 4)
    c = scaling.node_pair_cost(s, 32)
    assert c.seconds(c.hier_dispatch) == pytest.approx(3 * c.hier_dispatch / (8 * 400e9 / 8))


def test_bad_ep_sizes_are_refused():
    with pytest.raises(ValueError, match="do not spread evenly"):
        scaling.node_pair_cost(scaling.Shape("t", 8, 2, 128, 4, 2, 4), 16)


def test_the_document_holds_the_scripts_tables():
    assert scaling.doc_tables() == scaling.tables().strip("\n") + "\n", \
        "docs/SCALING.md's tables differ from scripts/scaling.py: regenerate them"
