"""Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts.

MoE routing (noaux_tc): sigmoid scores; the correction bias only changes which experts are
picked; with n_group > 1 only the topk_group groups with the best top-2 sums compete; the
chosen scores are normalised to sum 1 (norm_topk_prob) and scaled by routed_scaling_factor.
Dispatch is dropless: token-expert pairs are sorted by expert, so no [tokens, experts, ffn]
tensor is ever built, and then run through the experts in one of two ways (`expert_ffn`):

* few rows per expert (decode, small batches): `jax.lax.ragged_dot` over the sorted rows,
  which reads every expert's weights once;
* many rows per expert (training on long sequences): each expert's rows are padded to whole
  blocks and the blocks run as one batched matmul against their expert's weights. XLA lowers
  the backward pass of ragged_dot to dense matmuls masked per expert, with [experts, rows, hidden]
  intermediates: at 128K tokens and 8 experts that alone asks for tens of GB.
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


#: Largest block of rows of the blocked expert matmuls; below MIN_BLOCK rows ragged_dot is used.
MAX_BLOCK, MIN_BLOCK = 4096, 128


def block_rows(num_rows: int, num_experts: int) -> int | None:
    """Rows per block for `num_rows` sorted token-expert rows over `num_experts` experts, or None
    for ragged_dot. Blocks are about 1/8 of an expert's average share, so padding (under one
    block per expert) adds at most ~1/8 to the work."""
    per_expert = num_rows // (8 * num_experts)
    if per_expert < MIN_BLOCK:
        return None
    return min(MAX_BLOCK, 1 << (per_expert.bit_length() - 1))


def _blocked_matmul(x_blocks, weights, block_expert):
    """x_blocks [nb, C, in], weights [E, in, out], block_expert int32 [nb] -> float32 [nb, C, out]."""
    return jnp.einsum("bci,bio->bco", x_blocks, weights[block_expert], preferred_element_type=jnp.float32)


def expert_ffn(xs, group_sizes, gate_proj, up_proj, down_proj):
    """SwiGLU experts over rows sorted by expert.

    xs [M, hidden] (expert 0's rows first, then expert 1's, ...), group_sizes int32 [E] (sum M),
    gate_proj/up_proj [E, hidden, ffn], down_proj [E, ffn, hidden] -> float32 [M, hidden]."""
    num_rows, num_experts = xs.shape[0], group_sizes.shape[0]
    block = block_rows(num_rows, num_experts)
    if block is None:
        ragged = lambda a, w: jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=jnp.float32)
        act = (jax.nn.silu(ragged(xs, gate_proj)) * ragged(xs, up_proj)).astype(xs.dtype)
        return ragged(act, down_proj)
    num_blocks = -(-(num_rows + num_experts * (block - 1)) // block)       # static bound
    padded = -(-group_sizes // block) * block
    padded_end, end = jnp.cumsum(padded), jnp.cumsum(group_sizes)
    expert_of_row = jnp.repeat(jnp.arange(num_experts), group_sizes, total_repeat_length=num_rows)
    slot = (padded_end - padded)[expert_of_row] + jnp.arange(num_rows) - (end - group_sizes)[expert_of_row]
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right"),
                               num_experts - 1)                       # unused trailing blocks: zero rows
    x_blocks = jnp.zeros((num_blocks * block, xs.shape[1]), xs.dtype).at[slot].set(xs)
    x_blocks = x_blocks.reshape(num_blocks, block, -1)
    act = jax.nn.silu(_blocked_matmul(x_blocks, gate_proj, block_expert)) * _blocked_matmul(
        x_blocks, up_proj, block_expert)
    out = _blocked_matmul(act.astype(xs.dtype), down_proj, block_expert)
    return out.reshape(num_blocks * block, -1)[slot]


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
        out = expert_ffn(tokens[token_of], group_sizes, self.gate_proj[...], self.up_proj[...],
                         self.down_proj[...])
        out = out * weights.reshape(-1)[order][:, None]
        routed = jnp.zeros((tokens.shape[0], shape[-1]), jnp.float32).at[token_of].add(out)
        y = routed.astype(x.dtype).reshape(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
