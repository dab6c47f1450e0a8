"""The model's layers (Flax NNX), for the model and for models of your own
(docs/using-the-layers.md): every class but Linear, RMSNorm, MLP and Embed is built from a
`GLMConfig` (`glm_jax.load_config`). Every parameter carries its dimensions' logical names
(`nnx.get_partition_spec`; `glm_jax.logical_axes`), placed on a mesh by `glm_jax.sharding.shard_params`.
dtype is the computation's dtype, param_dtype the parameters' (Flax's meaning).

    IndexShareGroup   one Full layer (with its lightning indexer) and the Shared layers that
                      reuse its top-k indices: `group(x, positions, kv_len, ForwardOptions())`
                      -> GroupOutput(x, indexer_kl, latent, indices)
    DecoderLayer      one layer: MLA attention, then an MLP or MoE; LayerKind(is_full, is_moe)
    ForwardOptions    a call's static choices (glm_jax.forward_options): sparse or dense
                      attention, absorbed or expanded form, kernels, remat, indexer loss
    MLAProjection, Indexer, MLP, MoE, RMSNorm, Linear, Embed, MTPLayer
"""

from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.decoder import DecoderLayer, GroupOutput, IndexShareGroup, LayerKind, plan_groups
from glm_jax.layers.embedding import Embed
from glm_jax.layers.indexer import Indexer
from glm_jax.layers.linear import Linear
from glm_jax.layers.mla import MLAProjection
from glm_jax.layers.moe import MLP, MoE
from glm_jax.layers.mtp import MTPLayer
from glm_jax.layers.norms import RMSNorm

__all__ = ["ForwardOptions", "DecoderLayer", "Embed", "GroupOutput", "IndexShareGroup", "LayerKind", "plan_groups",
           "Indexer", "Linear", "MLAProjection", "MLP", "MoE", "MTPLayer", "RMSNorm"]
