"""Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts.

MoE routing (noaux_tc): sigmoid scores; the correction bias only changes which experts are
picked; with n_group > 1 only the topk_group groups with the best top-2 sums compete; the
chosen scores are normalised to sum 1 (norm_topk_prob) and scaled by routed_scaling_factor.
Dispatch is dropless: token-expert pairs are sorted by expert and run through
`jax.lax.ragged_dot`, so no [tokens, experts, ffn] tensor is ever built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.config import GLMConfig
from glm_jax.layers.linear import Linear


class RouterBias(nnx.Variable):
    """The noaux_tc `e_score_correction_bias`: updated by load balancing, not by gradients."""


class MLP(nnx.Module):
    def __init__(self, hidden: int, ffn: int, *, rngs: nnx.Rngs, dtype):
        self.gate_proj = Linear(hidden, ffn, rngs=rngs, dtype=dtype)
        self.up_proj = Linear(hidden, ffn, rngs=rngs, dtype=dtype)
        self.down_proj = Linear(ffn, hidden, rngs=rngs, dtype=dtype)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def route(cfg: GLMConfig, x: jnp.ndarray, router: jnp.ndarray, bias: jnp.ndarray):
    """x [N, hidden], router [E, hidden], bias [E] -> (experts int32 [N, k], weights float32 [N, k])."""
    scores = jax.nn.sigmoid(jnp.einsum("nh,eh->ne", x.astype(jnp.float32), router.astype(jnp.float32)))
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        grouped = choice.reshape(choice.shape[0], cfg.n_group, -1)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        keep_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(x.shape[0])[:, None], keep].set(True)
        choice = jnp.where(keep_mask[..., None], grouped, -jnp.inf).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


class MoE(nnx.Module):
    """Routed experts (stacked [E, ...] weights) plus the always-on shared expert."""

    def __init__(self, cfg: GLMConfig, *, rngs: nnx.Rngs, dtype):
        e, h, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        init = jax.nn.initializers.normal
        self.router = nnx.Param(init(h ** -0.5)(rngs.params(), (e, h), jnp.float32))
        self.e_score_correction_bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.gate_proj = nnx.Param(init(h ** -0.5)(rngs.params(), (e, h, f), dtype))
        self.up_proj = nnx.Param(init(h ** -0.5)(rngs.params(), (e, h, f), dtype))
        self.down_proj = nnx.Param(init(f ** -0.5)(rngs.params(), (e, f, h), dtype))
        self.shared_experts = MLP(h, f * cfg.n_shared_experts, rngs=rngs, dtype=dtype) \
            if cfg.n_shared_experts else None
        self.cfg = cfg

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """x [B, S, hidden] -> [B, S, hidden]."""
        cfg, shape = self.cfg, x.shape
        tokens = x.reshape(-1, shape[-1])
        experts, weights = route(cfg, tokens, self.router[...], self.e_score_correction_bias[...])
        flat_expert = experts.reshape(-1)                               # [N*k]
        order = jnp.argsort(flat_expert, stable=True)
        token_of = (order // cfg.num_experts_per_tok).astype(jnp.int32)  # [N*k]
        group_sizes = jnp.bincount(flat_expert, length=cfg.n_routed_experts).astype(jnp.int32)
        xs = tokens[token_of]
        gate = jax.lax.ragged_dot(xs, self.gate_proj[...], group_sizes, preferred_element_type=jnp.float32)
        up = jax.lax.ragged_dot(xs, self.up_proj[...], group_sizes, preferred_element_type=jnp.float32)
        act = (jax.nn.silu(gate) * up).astype(xs.dtype)
        out = jax.lax.ragged_dot(act, self.down_proj[...], group_sizes, preferred_element_type=jnp.float32)
        out = out * weights.reshape(-1)[order][:, None]
        routed = jnp.zeros((tokens.shape[0], shape[-1]), jnp.float32).at[token_of].add(out)
        y = routed.astype(x.dtype).reshape(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
