"""The lightning indexer of DeepSeek Sparse Attention (REFERENCE section 3).

    q = wq_b(q_resid) -> [S, nh, D];  k = k_norm(wk(x)) -> [T, D]   (one key head)
    RoPE on the first qk_rope_head_dim dims of q and k (layout [rope | nope])
    w = weights_proj(x) in float32 * nh^-0.5 * D^-0.5                -> [S, nh]
    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])   for s <= t
The indexer keys are what a Full layer caches (D values per token); Shared layers own none.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from glm_jax import ops
from glm_jax.config import GLMConfig
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.checks import check_config
from glm_jax.layers.linear import Linear
from glm_jax.layers.norms import LayerNorm
from glm_jax.layers.rope import apply_rope, rope_inv_freq
from glm_jax.layers.segments import query_rows


class Indexer(nnx.Module):
    def __init__(self, cfg: GLMConfig, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        check_config("Indexer", cfg)
        param_dtype = param_dtype or jnp.dtype(cfg.dtype)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, dtype=dtype,
                           param_dtype=param_dtype, axes=("q_lora", "index_heads"))
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                         axes=("hidden", "latent"))
        self.k_norm = LayerNorm(cfg.index_head_dim, eps=1e-6, dtype=dtype, param_dtype=param_dtype, axes=("latent",))
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, rngs=rngs, dtype=jnp.float32,
                                   param_dtype=jnp.float32, axes=("hidden", "index_weights"))
        self.cfg = cfg
        self.inv_freq = tuple(rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling_dict))

    def _rope(self, x, positions):
        r = self.cfg.qk_rope_head_dim
        rotated = apply_rope(x[..., :r], positions, self.inv_freq, interleave=self.cfg.indexer_rope_interleave)
        return jnp.concatenate([rotated, x[..., r:]], axis=-1)

    def keys(self, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
        """x [B, T, hidden], positions [B, T] -> indexer keys [B, T, D] (what the cache holds)."""
        k = self.k_norm(self.wk(x))
        return self._rope(k[:, :, None, :], positions)[:, :, 0, :]

    def queries(self, q_resid: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
        """q_resid [B, S, q_lora] -> indexer queries [B, S, nh, D]."""
        c = self.cfg
        q = self.wq_b(q_resid).reshape(q_resid.shape[:2] + (c.index_n_heads, c.index_head_dim))
        return self._rope(q, positions)

    def head_weights(self, x: jnp.ndarray) -> jnp.ndarray:
        """x [B, S, hidden] -> float32 [B, S, nh], every positive scale folded in."""
        c = self.cfg
        w = self.weights_proj(x.astype(jnp.float32)).astype(jnp.float32)
        return w * (c.index_n_heads ** -0.5) * (c.index_head_dim ** -0.5)

    def select(self, x, q_resid, positions, keys, kv_len, options: ForwardOptions = ForwardOptions(), kv_start=None):
        """Top-k positions for each query of a full sequence (with a cache, the cache's view
        selects over its keys from `queries` and `head_weights`: `GroupCacheView.select`).

        x [B, S, hidden], q_resid [B, S, q_lora], positions int32 [B, S] (absolute, or within
        the document when kv_start is given), keys [B, T, D] of the sequence,
        kv_len int32 [B], kv_start int32 [B, S] or None: the row where each query's document
        starts (packed rows, `segments`); keys before it are never chosen
        options: the call's `ForwardOptions` (its kernels pick the implementation)
        -> int32 [B, S, index_topk] row indices, -1 in unused slots."""
        q = self.queries(q_resid, positions)
        return ops.indexer_topk(q, keys.astype(q.dtype), self.head_weights(x), topk=self.cfg.index_topk,
                                q_pos=query_rows(positions, kv_start), kv_len=kv_len, kv_start=kv_start,
                                kernels=options.kernels)

    def scores(self, x, q_resid, positions, keys, kv_len, options: ForwardOptions = ForwardOptions(), kv_start=None):
        """Indexer logits float32 [B, S, T], -inf where masked (for the indexer losses);
        arguments as in `select`."""
        q = self.queries(q_resid, positions)
        return ops.indexer_scores(q, keys.astype(q.dtype), self.head_weights(x),
                                  q_pos=query_rows(positions, kv_start),
                                  kv_len=kv_len, kv_start=kv_start, kernels=options.kernels)
