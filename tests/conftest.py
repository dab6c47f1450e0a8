"""Shared fixtures: a micro GLM config (float32, a few IndexShare groups, MoE, MTP)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ahead-of-time TPU compilation (libtpu, no TPU) from several test workers at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from glm_jax.config import GLMConfig, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def micro_config(**changes) -> GLMConfig:
    base = load_config(ROOT / "configs" / "tiny.yaml").replace(
        name="micro", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
        index_topk=4, index_topk_pattern="FSSFS", max_position_embeddings=64, dtype="float32")
    return base.replace(**changes)


@pytest.fixture
def micro_cfg() -> GLMConfig:
    return micro_config()


def tpu_compile_mesh(topology: str):
    """A one-device mesh of an ahead-of-time TPU topology (libtpu, no TPU); skips without it."""
    pytest.importorskip("libtpu")
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu present but unable to describe TPUs here
        pytest.skip(f"no TPU topology: {e}")
    return Mesh(np.array(topo.devices)[:1], ("x",))
