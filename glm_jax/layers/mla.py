"""Multi-head latent attention (MLA): the absorbed, the expanded and the dense causal forms.

Per token, the layer caches one latent row [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)],
576 values for GLM-5.2. Attention for query t runs over the positions `indices[t]` selected by
the lightning indexer (-1 = unused slot).

* expanded form (training / prefill): per-head K = [k_nope from kv_b(c_kv), shared k_rope],
  V = v from kv_b(c_kv); dense scores masked to the selected set.
* absorbed form (decode): q' = [q_nope W_UK ; q_rope] (kv_lora + rope dims) attends the latent
  rows directly through `ops.sparse_mla` (gathering only selected rows); o' W_UV gives the
  head outputs.
* dense causal form (long-sequence dense stage): per-head K and V as in the expanded form,
  causal attention over every earlier token through `ops.causal_attention` (no [S, T] matrix).
All use the softmax scale qk_head_dim^-0.5 (times YaRN's factor, if any).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from glm_jax import ops
from glm_jax.config import GLMConfig
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.checks import check_config
from glm_jax.layers.linear import Linear
from glm_jax.layers.matmul import einsum
from glm_jax.layers.norms import RMSNorm
from glm_jax.layers.rope import apply_rope, rope_inv_freq, softmax_scale_factor
from glm_jax.layers.segments import SegmentTable


class MLAProjection(nnx.Module):
    """The attention weights of one layer (checkpoint names) and the projections around attention."""

    def __init__(self, cfg: GLMConfig, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        check_config("MLAProjection", cfg)
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype or jnp.dtype(cfg.dtype))
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=kw["param_dtype"])
        self.q_a_proj = Linear(h, cfg.q_lora_rank, axes=("hidden", "q_lora"), **kw)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, axes=("q_lora",), **norm)
        self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, axes=("q_lora", "heads"), **kw)
        self.kv_a_proj_with_mqa = Linear(h, cfg.latent_dim, axes=("hidden", "latent"), **kw)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, axes=("kv_lora",), **norm)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                axes=("kv_lora", "heads"), **kw)
        self.o_proj = Linear(nh * cfg.v_head_dim, h, axes=("heads", "embed"), **kw)
        self.cfg = cfg
        self.inv_freq = tuple(rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling_dict))
        self.sm_scale = cfg.softmax_scale * softmax_scale_factor(cfg.rope_scaling_dict)

    def query_residual(self, x: jnp.ndarray) -> jnp.ndarray:
        """x [B, S, hidden] -> q_a_layernorm(q_a_proj(x)) [B, S, q_lora]; the indexer reuses it."""
        return self.q_a_layernorm(self.q_a_proj(x))

    def queries(self, q_resid: jnp.ndarray, positions: jnp.ndarray):
        """-> q_nope [B, S, nh, nope], q_rope [B, S, nh, rope] (rotated)."""
        c = self.cfg
        q = self.q_b_proj(q_resid).reshape(q_resid.shape[:2] + (c.num_attention_heads, c.qk_head_dim))
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        return q_nope, apply_rope(q_rope, positions, self.inv_freq, interleave=c.rope_interleave)

    def latent(self, x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
        """x [B, T, hidden] -> cached latent rows [B, T, kv_lora + rope]: [norm(c_kv) | rope(k_rope)]."""
        c = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[..., : c.kv_lora_rank])
        k_rope = apply_rope(kv[..., None, c.kv_lora_rank:], positions, self.inv_freq,
                            interleave=c.rope_interleave)[..., 0, :]
        return jnp.concatenate([c_kv, k_rope], axis=-1)

    def _kv_b(self) -> tuple[jnp.ndarray, jnp.ndarray]:
        """-> W_UK [kv_lora, nh, nope], W_UV [kv_lora, nh, v] (views of kv_b_proj)."""
        c = self.cfg
        w = self.kv_b_proj.kernel[...].reshape(c.kv_lora_rank, c.num_attention_heads,
                                               c.qk_nope_head_dim + c.v_head_dim)
        return w[..., : c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    # ------------------------------------------------------------------ absorbed form
    def attend_absorbed(self, q_nope, q_rope, latent, indices, options: ForwardOptions = ForwardOptions(), *,
                        return_target: bool = False, tindex=None):
        """q_* [B, S, nh, *], latent [B, T, kv_lora + rope], indices int32 [B, S, K]
        -> attention output [B, S, hidden]; with return_target also the indexer KL's target
        float32 [B, S, K] (the head-mean probabilities at each slot, no gradient; `ops.sparse_mla`).
        tindex: the backward's index of these indices (`backward_index`), shared by a group.
        options: the call's `ForwardOptions`; its kernels pick the implementation."""
        q_abs = self.absorbed_queries(q_nope, q_rope)
        o_lat, _, *target = ops.sparse_mla(q_abs, latent.astype(q_abs.dtype), indices, sm_scale=self.sm_scale,
                                           v_dim=self.cfg.kv_lora_rank, return_target=return_target,
                                           tindex=tindex, kernels=options.kernels)
        # Named as the kernel's residuals are, for a remat policy that keeps them (`ops.SPARSE_MLA_SAVED`).
        o_lat, *target = (checkpoint_name(a, ops.SPARSE_MLA_SAVED) for a in (o_lat, *target))
        out = self.absorbed_output(o_lat, q_nope.dtype)
        return (out, target[0]) if return_target else out

    def backward_index(self, indices, num_keys: int, dtype, options: ForwardOptions = ForwardOptions()):
        """indices int32 [B, S, K] over num_keys latent rows -> the sparse attention backward's
        index (`ops.sparse_mla_backward_index`, of options.kernels) for latent rows in dtype, or None."""
        c = self.cfg
        return ops.sparse_mla_backward_index(indices, num_keys, dk=c.kv_lora_rank + c.qk_rope_head_dim,
                                             dtype=dtype, kernels=options.kernels, heads=c.num_attention_heads,
                                             v_dim=c.kv_lora_rank)

    def absorbed_queries(self, q_nope, q_rope):
        """q_nope [B, S, nh, nope], q_rope [B, S, nh, rope] -> the queries in the latent space
        [B, S, nh, kv_lora + rope]: [q_nope W_UK ; q_rope]."""
        w_uk, _ = self._kv_b()
        q_lat = einsum("bshn,chn->bshc", q_nope, w_uk.astype(q_nope.dtype)).astype(q_nope.dtype)
        return jnp.concatenate([q_lat, q_rope], axis=-1)

    def absorbed_output(self, o_lat, dtype):
        """Attention output in the latent space [B, S, nh, kv_lora] -> [B, S, hidden] in dtype
        (through W_UV and o_proj)."""
        _, w_uv = self._kv_b()
        o = einsum("bshc,chv->bshv", o_lat, w_uv.astype(o_lat.dtype)).astype(dtype)
        return self.o_proj(o.reshape(o.shape[:2] + (-1,)))

    # ------------------------------------------------------------------ dense, long sequences
    def attend_causal(self, q_nope, q_rope, latent, kv_len, mask=None, segments: SegmentTable | None = None,
                      options: ForwardOptions = ForwardOptions()):
        """Dense causal attention of a full sequence from position 0 without [S, T] matrices
        in memory where the backend allows (`ops.causal_attention`: cuDNN's flash kernel on a
        GPU).

        q_* [B, S, nh, *], latent [B, S, kv_lora + rope], kv_len int32 [B] -> [B, S, hidden].
        Packed documents: mask bool [B, S, T] further restricts the keys (an [S, T] matrix);
        `segments` (the same documents as a SegmentTable), where given, lets cuDNN run its
        packed kernel instead, with no mask built. options: its kernels' `causal_attention` entry
        picks the implementation."""
        c = self.cfg
        c_kv, k_rope = latent[..., : c.kv_lora_rank], latent[..., c.kv_lora_rank:]
        kv = self.kv_b_proj(c_kv).reshape(c_kv.shape[:2] + (c.num_attention_heads, -1))
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :].astype(k_nope.dtype), k_nope.shape[:3] + k_rope.shape[-1:])
        q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        width = max(q.shape[-1], v.shape[-1])                   # one head width for q, k and v
        pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
        o = ops.causal_attention(pad(q), pad(k), pad(v), scale=self.sm_scale, kv_len=kv_len, mask=mask,
                                 segments=segments, kernels=options.kernels)
        o = o[..., : c.v_head_dim]
        return self.o_proj(o.astype(q_nope.dtype).reshape(o.shape[:2] + (-1,)))

    # ------------------------------------------------------------------ expanded form
    def attend_expanded(self, q_nope, q_rope, latent, mask, *, return_probs: bool = False):
        """Dense per-head attention restricted by mask bool [B, S, T] (the selected set).

        -> output [B, S, hidden] (and, with return_probs, probabilities float32 [B, nh, S, T])."""
        c = self.cfg
        c_kv, k_rope = latent[..., : c.kv_lora_rank], latent[..., c.kv_lora_rank:]
        kv = self.kv_b_proj(c_kv).reshape(c_kv.shape[:2] + (c.num_attention_heads, -1))
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        logits = (jnp.einsum("bshd,bthd->bhst", q_nope, k_nope, preferred_element_type=jnp.float32)
                  + jnp.einsum("bshd,btd->bhst", q_rope, k_rope, preferred_element_type=jnp.float32))
        logits = jnp.where(mask[:, None], logits * self.sm_scale, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        e = jnp.exp(logits - jax.lax.stop_gradient(row_max))
        probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
        o = jnp.einsum("bhst,bthv->bshv", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        out = self.o_proj(o.astype(q_nope.dtype).reshape(o.shape[:2] + (-1,)))
        return (out, probs) if return_probs else out


def indices_to_mask(indices: jnp.ndarray, num_keys: int) -> jnp.ndarray:
    """indices int32 [B, S, K] (-1 = unused) -> bool [B, S, num_keys], True at selected keys."""
    b, s, _ = indices.shape
    slots = jnp.where(indices < 0, num_keys, indices)  # unused slots land in a dropped column
    mask = jnp.zeros((b, s, num_keys + 1), bool)
    mask = mask.at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], slots].set(True)
    return mask[..., :num_keys]
