"""An AllToAll's configuration (pyhipa2a.config): its environment overrides and choices, checked
without a device."""
from __future__ import annotations

import pytest

from pyhipa2a.config import Config, publish_with_gpu_fence



@pytest.mark.parametrize("arch,env,expected", [("sm_90", None, True), ("sm_90", "auto", True), ("sm_90", "system", False),
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
