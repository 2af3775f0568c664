"""An AllToAll's configuration (pyhipa2a.config): its environment overrides and choices, checked
without a device."""
from __future__ import annotations

import pytest

from pyhipa2a.config import (DEFAULT_POST_BYTES, Config, combine_part_blocks, combine_send_percent,
                             publish_with_gpu_fence)



@pytest.mark.parametrize("arch,env,expected",
                         [("sm_90", None, True), ("sm_90", "auto", True), ("sm_90", "system", False),
                          ("sm_100", None, False), ("gfx942", None, False), ("host", None, False),
                          ("host", "gpu-fence", True), ("gfx942", "gpu-fence", True)])
def test_publish_choice(arch, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("PYHIPA2A_PUBLISH", raising=False)
    else:
        monkeypatch.setenv("PYHIPA2A_PUBLISH", env)
    assert publish_with_gpu_fence(arch) is expected


def test_publish_choice_refuses_unknown(monkeypatch):
    monkeypatch.setenv("PYHIPA2A_PUBLISH", "gpu")
    with pytest.raises(ValueError, match="PYHIPA2A_PUBLISH must be one of auto, system, gpu-fence"):
        publish_with_gpu_fence("sm_90")



@pytest.mark.parametrize("env,hidden,max_tokens,expected", [
    (None, 7168, 4096, -(-DEFAULT_POST_BYTES // (7168 * 2))),  # 586 tokens: 8 MiB of 16-bit rows
    (None, 7168, 256, 0),   # no call of this object is that large: never
    ("1", 7168, 256, 1), ("0", 7168, 4096, 0), ("300", 7168, 256, 0)])
def test_posting_threshold(env, hidden, max_tokens, expected, monkeypatch):
    """Combines whose largest source has at least post_min_tokens tokens post their contributions
    (kernels_hip/exchange.h); 0 never does, whether asked or because no call can reach the threshold."""
    if env is None:
        monkeypatch.delenv("PYHIPA2A_POST_MIN_TOKENS", raising=False)
    else:
        monkeypatch.setenv("PYHIPA2A_POST_MIN_TOKENS", env)
    config = Config.of(2, num_experts=8, experts_per_token=4, hidden_dim=hidden, max_num_tokens=max_tokens)
    assert config.post_min_tokens == config.on_device("sm_90", 32).post_min_tokens == expected


def test_a_node_part_posts_by_its_own_sources(monkeypatch):
    """A node's sources carry every node's region (nodes * M tokens): its combine may post where no single
    rank's call reaches the threshold."""
    monkeypatch.delenv("PYHIPA2A_POST_MIN_TOKENS", raising=False)
    config = Config.of(4, num_experts=16, experts_per_token=4, hidden_dim=7168, max_num_tokens=400)
    part = config.node_part(nodes=2, ranks_per_node=2, ranks_on_device=0)
    assert (config.post_min_tokens, part.post_min_tokens) == (0, -(-DEFAULT_POST_BYTES // (7168 * 2)))


def test_posting_threshold_refuses_negative(monkeypatch):
    monkeypatch.setenv("PYHIPA2A_POST_MIN_TOKENS", "-1")
    with pytest.raises(ValueError, match="PYHIPA2A_POST_MIN_TOKENS=-1 must be >= 0"):
        Config.of(2, num_experts=8, experts_per_token=4, hidden_dim=64, max_num_tokens=16)


def _grid_share(variable, env, monkeypatch, share_of):
    if env is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, env)
    return share_of()


def _part_blocks(blocks):
    config = Config.of(2, num_experts=8, experts_per_token=4, hidden_dim=64, max_num_tokens=16)
    return lambda: combine_part_blocks(config.with_geometry(256, blocks, -1))


@pytest.mark.parametrize("env,expected", [(None, 25), ("50", 50), ("1", 1), ("99", 99), ("100", 0)])
def test_combine_send_percent(env, expected, monkeypatch):
    """A posting combine's senders: a share of every block's warps (the kernel keeps at least one and one
    fewer than the block's), or 0 for 100: every warp sends, then reduces."""
    assert _grid_share("PYHIPA2A_COMBINE_SEND_SHARE", env, monkeypatch, combine_send_percent) == expected


@pytest.mark.parametrize("env,blocks,expected", [(None, 264, 66), ("10", 264, 26), ("100", 264, 264), ("1", 50, 1),
                                                 ("25", 1, 1)])
def test_combine_part_blocks(env, blocks, expected, monkeypatch):
    """A combine's sending parts but the last, after dispatch(groups=): a share of the grid, at least one block."""
    assert _grid_share("PYHIPA2A_COMBINE_PART_SHARE", env, monkeypatch, _part_blocks(blocks)) == expected


@pytest.mark.parametrize("variable,share_of", [("PYHIPA2A_COMBINE_SEND_SHARE", combine_send_percent),
                                               ("PYHIPA2A_COMBINE_PART_SHARE", _part_blocks(8))], ids=["send", "part"])
@pytest.mark.parametrize("env", ["0", "101"])
def test_grid_shares_refuse_other_percentages(variable, share_of, env, monkeypatch):
    with pytest.raises(ValueError, match=rf"{variable}={env} must be a percentage in \(0, 100\]"):
        _grid_share(variable, env, monkeypatch, share_of)


def test_a_node_part_keeps_its_slot_indices_below_2_31():
    """A slot's index t * k + j is divided by k exactly only below 2^31; a node's part of a call across nodes
    holds every node's region (nodes * M tokens) and may have more experts a token than it hosts."""
    config = Config.of(4, num_experts=4, experts_per_token=4, hidden_dim=8, max_num_tokens=2**27)
    part = config.node_part(nodes=2, ranks_per_node=2, ranks_on_device=0)
    assert (part.num_experts, part.max_tokens, part.region_tokens, part.local_experts) == (2, 2**28, 2**27, 1)
    assert part.capacity == config.capacity and part.void_slots  # (experts_per_token 4 > its 2 experts)
    with pytest.raises(ValueError, match=r"experts_per_token \* max_num_tokens must be below 2\*\*31"):
        config.node_part(nodes=4, ranks_per_node=1, ranks_on_device=0)
    with pytest.raises(ValueError, match="row_layout='by_source' is for calls within one node"):
        Config.of(4, num_experts=4, experts_per_token=1, hidden_dim=8, max_num_tokens=4,
                  row_layout="by_source").node_part(2, 2, 0)


def test_contiguous_rows_default_to_the_bound():
    """row_layout="contiguous": R rows in all, by default every row that can arrive (each token of every rank to
    min(k, L) of our experts) plus each expert's rounding to row_align, itself a multiple of row_align; the
    packed layout holds W * M rows an expert."""
    deepseek = dict(num_experts=256, experts_per_token=8, hidden_dim=7168, max_num_tokens=4096)
    packed = Config.of(8, **deepseek)
    contiguous = Config.of(8, **deepseek, row_layout="contiguous")
    assert packed.rows_shape == (32, 8 * 4096) and packed.recv_rows == 32 * 8 * 4096
    assert contiguous.rows_shape == (contiguous.recv_rows,)
    assert contiguous.recv_rows == 266240  # 8 * 4096 * 8 + 32 * 127 = 266208 rows, rounded up to 128
    few = Config.of(2, num_experts=4, experts_per_token=4, hidden_dim=8, max_num_tokens=5, row_layout="contiguous",
                    row_align=4)
    assert few.recv_rows == 28  # k = 4 but L = 2, so 2 rows a token at most: 2 * 5 * 2 + 2 * 3 = 26, rounded up to 4
    given = Config.of(2, num_experts=4, experts_per_token=2, hidden_dim=8, max_num_tokens=5, row_layout="contiguous",
                      row_align=8, max_recv_rows=24)
    assert given.recv_rows == 24 and given.node_part(2, 1, 0).recv_rows == 24  # (a node's part keeps R)
    part = Config.of(4, **deepseek, row_layout="contiguous").node_part(2, 2, 0)
    assert part.recv_rows == Config.of(4, **deepseek, row_layout="contiguous").recv_rows


@pytest.mark.parametrize("params,error,match", [
    (dict(row_align=8), ValueError, "row_align and max_recv_rows are for row_layout='contiguous'"),
    (dict(row_layout="by_source", max_recv_rows=8), ValueError, "are for row_layout='contiguous'"),
    (dict(row_layout="contiguous", row_align=0), ValueError, r"row_align must be in \[1, 65536\]; got 0"),
    (dict(row_layout="contiguous", row_align=2**17), ValueError, "row_align must be in"),
    (dict(row_layout="contiguous", row_align=True), TypeError, "row_align must be an int, not bool"),
    (dict(row_layout="contiguous", max_recv_rows=0), ValueError, "max_recv_rows must be >= 1; got 0"),
    (dict(row_layout="contiguous", max_recv_rows=2.0), TypeError, "max_recv_rows must be an int, not float"),
    (dict(row_layout="contiguous", max_recv_rows=2**31), ValueError, "expert_x would have 2147483648 rows"),
    (dict(row_layout="contiguous", max_recv_rows=200), ValueError,
     "max_recv_rows=200 must be a multiple of row_align=128"),
    (dict(row_layout="rows"), ValueError, r"row_layout must be one of \('packed', 'by_source', 'contiguous'\)"),
])
def test_contiguous_rows_parameters_are_checked(params, error, match):
    with pytest.raises(error, match=match):
        Config.of(2, num_experts=4, experts_per_token=2, hidden_dim=8, max_num_tokens=4, **params)

