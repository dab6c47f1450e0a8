"""The model's layers (Flax NNX), for the model and for models of your own
(docs/using-the-layers.md): every class is built from a `GLMConfig` (`glm_jax.load_config`).

    IndexShareGroup   one Full layer (with its lightning indexer) and the Shared layers that
                      reuse its top-k indices: `forward(x, positions, kv_len, AttentionSettings())`
    DecoderLayer      one layer: MLA attention, then an MLP or MoE; LayerKind(is_full, is_moe)
    AttentionSettings sparse or dense attention, absorbed or expanded form, indexer loss, remat
    MLAProjection, Indexer, MLP, MoE, RMSNorm, Linear, MTPLayer
"""

from glm_jax.layers.decoder import AttentionSettings, DecoderLayer, IndexShareGroup, LayerKind, plan_groups
from glm_jax.layers.indexer import Indexer
from glm_jax.layers.linear import Linear
from glm_jax.layers.mla import MLAProjection
from glm_jax.layers.moe import MLP, MoE
from glm_jax.layers.mtp import MTPLayer
from glm_jax.layers.norms import RMSNorm

__all__ = ["AttentionSettings", "DecoderLayer", "IndexShareGroup", "LayerKind", "plan_groups", "Indexer", "Linear",
           "MLAProjection", "MLP", "MoE", "MTPLayer", "RMSNorm"]
