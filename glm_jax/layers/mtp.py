"""The multi-token-prediction (MTP) layer: one decoder layer with its own indexer.

    h' = eh_proj([enorm(emb(t_{i+1})) ; hnorm(h_i)])  -> decoder layer -> h_out
    logits = lm_head(shared_head.norm(h_out))         (embedding and lm_head are the model's)
The normed hidden state is what the next draft step receives (GLM convention).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from glm_jax.config import GLMConfig
from glm_jax.layers.checks import check_config
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.decoder import IndexShareGroup, LayerKind
from glm_jax.layers.linear import Linear
from glm_jax.layers.norms import RMSNorm


class SharedHead(nnx.Module):
    def __init__(self, cfg: GLMConfig, *, dtype=None, param_dtype=None):
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype or jnp.dtype(cfg.dtype))


class MTPLayer(nnx.Module):
    """dtype: the computation's dtype (default None: the parameters'); param_dtype: the
    parameters' (default cfg.dtype)."""

    def __init__(self, cfg: GLMConfig, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        check_config("MTPLayer", cfg)
        h, pd = cfg.hidden_size, param_dtype or jnp.dtype(cfg.dtype)
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=pd)
        self.enorm = RMSNorm(h, **norm)
        self.hnorm = RMSNorm(h, **norm)
        self.eh_proj = Linear(2 * h, h, rngs=rngs, dtype=dtype, param_dtype=pd, axes=("mtp_concat", "hidden"))
        # The MTP decoder layer is a Full MoE layer: its own indexer serves only itself.
        self.block = IndexShareGroup(cfg, (LayerKind(True, cfg.n_routed_experts > 0),), rngs=rngs, dtype=dtype,
                                     param_dtype=pd)
        self.shared_head = SharedHead(cfg, dtype=dtype, param_dtype=pd)

    def inputs(self, next_token_embeddings: jnp.ndarray, hidden: jnp.ndarray) -> jnp.ndarray:
        """emb(t_{i+1}) [B, S, hidden], h_i [B, S, hidden] -> decoder-layer input [B, S, hidden]."""
        joined = jnp.concatenate([self.enorm(next_token_embeddings), self.hnorm(hidden)], axis=-1)
        return self.eh_proj(joined)

    def forward(self, next_token_embeddings, hidden, positions, kv_len, options: ForwardOptions,
                *, shared_kv=None, kv_start=None):
        """Full-sequence MTP step -> (normed output hidden [B, S, hidden], indexer KL, latent rows,
        indices); see IndexShareGroup.forward for shared_kv and kv_start."""
        x, kl, latent, indices = self.block(self.inputs(next_token_embeddings, hidden), positions, kv_len, options,
                                            shared_kv=shared_kv, kv_start=kv_start)
        return self.shared_head.norm(x), kl, latent, indices
