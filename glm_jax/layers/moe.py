"""Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts.

MoE routing (noaux_tc): sigmoid scores; the correction bias only changes which experts are
picked; with n_group > 1 only the topk_group groups with the best top-2 sums compete; the
chosen scores are normalised to sum 1 (norm_topk_prob) and scaled by routed_scaling_factor.

The routed experts run one of three ways (`DISPATCH`, or `MoE.__call__`'s `dispatch`):

* "sorted" (dropless): each token is copied k times, the copies are permuted into expert
  order, run through the experts (`expert_ffn`), permuted back and summed with their routing
  weights. Every permutation is a gather whose backward is the gather with the inverse
  permutation (`take_rows`): no scatter-add, so no atomics, in either direction. The experts
  run as
    - few rows per expert (decode, small batches): `jax.lax.ragged_dot` over the sorted rows,
      which reads every expert's weights once;
    - many rows per expert (training on long sequences): each expert's rows padded to whole
      blocks, the blocks one batched matmul against their expert's weights. XLA lowers the
      backward pass of ragged_dot to dense matmuls masked per expert, with [experts, rows,
      hidden] intermediates: at 128K tokens and 8 experts that alone asks for tens of GB.
* "ragged": as "sorted", always with ragged_dot.
* "dense": every expert on every token, weighted by a [tokens, experts] combine matrix that is
  zero for unpicked experts: no gathers at all, E / k times the expert flops (for few, small
  experts).

The blocked and dense matmuls accumulate in float32 both ways; their backward passes round the
float32 cotangent to the weights' dtype first, so that on a GPU they run as bf16 tensor-core
matmuls rather than as float32 ones on converted copies. The backward passes are deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.config import GLMConfig
from glm_jax.layers.checks import check_config
from glm_jax.layers.linear import Linear
from glm_jax.layers.matmul import einsum
from glm_jax.logical_axes import check_dtype, explicit_axes, leading_spec, on_auto_axes, param


class RouterBias(nnx.Variable):
    """The noaux_tc `e_score_correction_bias`: updated by load balancing, not by gradients."""


class MLP(nnx.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); dtype / param_dtype as `Linear`'s,
    axes the logical names of (hidden, ffn)."""

    def __init__(self, hidden: int, ffn: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32,
                 axes: tuple[str | None, str | None] = ("embed", "mlp")):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(hidden, ffn, axes=axes, **kw)
        self.up_proj = Linear(hidden, ffn, axes=axes, **kw)
        self.down_proj = Linear(ffn, hidden, axes=axes[::-1], **kw)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        if explicit_axes():
            return on_auto_axes(self, lambda layer, x: layer(x), (x,), leading_spec(x, x.ndim, x.ndim - 1))
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def route(cfg: GLMConfig, x: jnp.ndarray, router: jnp.ndarray, bias: jnp.ndarray):
    """x [N, hidden], router [E, hidden], bias [E] -> (experts int32 [N, k], weights float32 [N, k])."""
    scores = jax.nn.sigmoid(jnp.einsum("nh,eh->ne", x.astype(jnp.float32), router.astype(jnp.float32)))
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1:
        grouped = choice.reshape(choice.shape[0], cfg.n_group, -1)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        keep_mask = jnp.any(keep[..., None] == jnp.arange(cfg.n_group), axis=-2)           # [N, groups]
        choice = jnp.where(keep_mask[..., None], grouped, -jnp.inf).reshape(choice.shape)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    # The picked scores, selected by comparison: the backward is then a select, not a scatter-add.
    picked = experts[..., None] == jnp.arange(scores.shape[-1])                            # [N, k, E]
    weights = jnp.sum(jnp.where(picked, scores[:, None, :], 0.0), axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


#: How the routed experts run: "sorted", "ragged" or "dense" (see the module docstring).
DISPATCH = "sorted"
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


# ------------------------------------------------------------------ row permutations
def take_rows(x: jnp.ndarray, index: jnp.ndarray, inverse: jnp.ndarray) -> jnp.ndarray:
    """x [R, ...] at rows index int32 [Q] (values in [0, R]; R gives a zero row) -> [Q, ...].

    inverse int32 [R] (values in [0, Q]) inverts index: every row r of x is taken at most once,
    at inverse[r] (index[inverse[r]] == r), and inverse[r] == Q for a row never taken. The
    backward pass is then take_rows(cotangent, inverse, index): a gather again, no scatter-add."""
    return _take_rows(x, index, inverse)


@jax.custom_vjp
def _take_rows(x, index, inverse):
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse):
    return _take_rows(x, index, inverse), (index, inverse)


def _take_rows_bwd(residuals, g):
    index, inverse = residuals
    return _take_rows(g, inverse, index), None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def inverse_permutation(perm: jnp.ndarray) -> jnp.ndarray:
    """perm int32 [M] (a permutation of [0, M)) -> int32 [M] inv with inv[perm[i]] == i."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype), unique_indices=True)


# ------------------------------------------------------------------ expert matmuls
def _block_layout(group_sizes: jnp.ndarray, num_rows: int, block: int):
    """Rows sorted by expert, each expert's padded to whole blocks.

    group_sizes int32 [E] (sum num_rows) -> (source int32 [P]: the sorted row at each padded
    position, num_rows for padding; slot int32 [num_rows]: each sorted row's padded position;
    block_expert int32 [P / block]: each block's expert), P = a static bound on the padded rows.
    Unused trailing blocks are padding of the last expert."""
    num_experts = group_sizes.shape[0]
    num_blocks = -(-(num_rows + num_experts * (block - 1)) // block)
    padded = -(-group_sizes // block) * block
    padded_end, end = jnp.cumsum(padded), jnp.cumsum(group_sizes)
    padded_start, start = padded_end - padded, end - group_sizes
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right",
                                                method="compare_all"), num_experts - 1).astype(jnp.int32)
    expert = jnp.repeat(block_expert, block)                                  # [P]
    offset = jnp.arange(num_blocks * block) - padded_start[expert]
    source = jnp.where(offset < group_sizes[expert], start[expert] + offset, num_rows)
    row = jnp.arange(num_rows)
    expert_of_row = jnp.sum(row[:, None] >= end, axis=1)                      # [M]
    slot = padded_start[expert_of_row] + row - start[expert_of_row]
    return source.astype(jnp.int32), slot.astype(jnp.int32), block_expert


@jax.custom_vjp
def _blocked_matmul(x_blocks, weights, block_expert):
    """x_blocks [nb, C, in], weights [E, in, out], block_expert int32 [nb] -> float32 [nb, C, out]:
    each block times its expert's weights.

    The backward pass rounds the cotangent to the inputs' dtype, so its matmuls run in that
    dtype (bf16 on tensor cores) with float32 accumulation, and sums the blocks' weight
    gradients per expert in float32 with a one-hot matmul (a gather's backward would
    scatter-add them)."""
    return jnp.einsum("bci,bio->bco", x_blocks, weights[block_expert], preferred_element_type=jnp.float32)


def _blocked_matmul_fwd(x_blocks, weights, block_expert):
    return _blocked_matmul(x_blocks, weights, block_expert), (x_blocks, weights, block_expert)


def _blocked_matmul_bwd(residuals, g):
    x_blocks, weights, block_expert = residuals
    g = g.astype(x_blocks.dtype)
    dx = jnp.einsum("bco,bio->bci", g, weights[block_expert], preferred_element_type=jnp.float32)
    dw_blocks = jnp.einsum("bci,bco->bio", x_blocks, g, preferred_element_type=jnp.float32)
    onehot = (block_expert[:, None] == jnp.arange(weights.shape[0])).astype(jnp.float32)
    dw = jnp.einsum("be,bio->eio", onehot, dw_blocks, precision=jax.lax.Precision.HIGHEST)
    return dx.astype(x_blocks.dtype), dw.astype(weights.dtype), None


_blocked_matmul.defvjp(_blocked_matmul_fwd, _blocked_matmul_bwd)


def _ragged_ffn(xs, group_sizes, gate_proj, up_proj, down_proj):
    """SwiGLU experts by ragged_dot over rows sorted by expert: xs [M, hidden] -> float32 [M, hidden]."""
    ragged = lambda a, w: jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(ragged(xs, gate_proj)) * ragged(xs, up_proj)).astype(xs.dtype)
    return ragged(act, down_proj)


def expert_ffn(xs, group_sizes, gate_proj, up_proj, down_proj, order=None, *, ragged: bool = False):
    """SwiGLU experts over rows grouped by expert.

    xs [M, hidden]; order int32 [M]: xs's rows in expert order (expert 0's rows first, then
    expert 1's, ...; None: xs is in expert order); group_sizes int32 [E] (sum M);
    gate_proj/up_proj [E, hidden, ffn], down_proj [E, ffn, hidden] -> float32 [M, hidden], row i
    the output of xs[i]. ragged: always ragged_dot; otherwise only for few rows (`block_rows`)."""
    num_rows, num_experts = xs.shape[0], group_sizes.shape[0]
    if order is not None:
        order = order.astype(jnp.int32)
        position = inverse_permutation(order)    # xs[i] is row position[i] in expert order
    block = None if ragged else block_rows(num_rows, num_experts)
    if block is None:
        rows = xs if order is None else take_rows(xs, order, position)
        out = _ragged_ffn(rows, group_sizes, gate_proj, up_proj, down_proj)
        return out if order is None else take_rows(out, position, order)
    source, slot, block_expert = _block_layout(group_sizes, num_rows, block)
    if order is not None:                        # one gather each way, xs's rows <-> padded blocks
        source = jnp.take(order, source, mode="fill", fill_value=num_rows)
        slot = jnp.take(slot, position)
    x_blocks = take_rows(xs, source, slot).reshape(-1, block, xs.shape[1])
    gate, up = jnp.split(_blocked_matmul(x_blocks, jnp.concatenate([gate_proj, up_proj], -1), block_expert),
                         2, axis=-1)
    out = _blocked_matmul((jax.nn.silu(gate) * up).astype(xs.dtype), down_proj, block_expert)
    return take_rows(out.reshape(source.shape[0], -1), slot, source)


def dense_experts(tokens, experts, weights, gate_proj, up_proj, down_proj):
    """Every expert on every token: tokens [N, hidden], experts int32 [N, k], weights float32
    [N, k], expert weights as in expert_ffn -> float32 [N, hidden], the weighted sum over the
    picked experts (the activations of the others are multiplied by 0)."""
    (num_experts, hidden, ffn), n = gate_proj.shape, tokens.shape[0]
    combine = jnp.sum(jnp.where(experts[..., None] == jnp.arange(num_experts), weights[..., None], 0.0),
                      axis=1)                                                     # [N, E]
    gate_up = jnp.concatenate([gate_proj, up_proj], -1).transpose(1, 0, 2).reshape(hidden, -1)
    gate, up = jnp.split(einsum("nh,hf->nf", tokens, gate_up).reshape(n, num_experts, 2 * ffn), 2, axis=-1)
    act = (jax.nn.silu(gate) * up * combine[..., None]).astype(tokens.dtype)      # [N, E, ffn]
    return einsum("nf,fh->nh", act.reshape(n, -1), down_proj.reshape(-1, hidden))


def routed_experts(cfg: GLMConfig, tokens, router, bias, gate_proj, up_proj, down_proj,
                   dispatch: str | None = None) -> jnp.ndarray:
    """tokens [N, hidden] -> float32 [N, hidden]: the routed experts' weighted sum;
    router [E, hidden], bias [E], expert weights as in expert_ffn; dispatch as `DISPATCH`."""
    dispatch = dispatch or DISPATCH
    experts, weights = route(cfg, tokens, router, bias)
    if dispatch == "dense":
        return dense_experts(tokens, experts, weights, gate_proj, up_proj, down_proj)
    if dispatch not in ("sorted", "ragged"):
        raise ValueError(f"unknown MoE dispatch {dispatch!r}: 'sorted', 'ragged' or 'dense'")
    (n, k), num_experts = experts.shape, gate_proj.shape[0]
    flat_expert = experts.reshape(-1)                                             # [N*k]
    order = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)
    group_sizes = jnp.sum(flat_expert[:, None] == jnp.arange(num_experts), axis=0, dtype=jnp.int32)
    copies = jnp.broadcast_to(tokens[:, None], (n, k, tokens.shape[1])).reshape(n * k, -1)
    out = expert_ffn(copies, group_sizes, gate_proj, up_proj, down_proj, order, ragged=dispatch == "ragged")
    return jnp.sum(out.reshape(n, k, -1) * weights[..., None], axis=1)


class MoE(nnx.Module):
    """Routed experts (stacked [E, ...] weights) plus the always-on shared expert."""

    def __init__(self, cfg: GLMConfig, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        check_config("MoE", cfg)
        check_dtype("MoE", "dtype", dtype)
        e, h, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        pd = param_dtype or jnp.dtype(cfg.dtype)
        init = jax.nn.initializers.normal
        self.router = param(init(h ** -0.5)(rngs.params(), (e, h), jnp.float32), ("router_experts", "hidden"))
        self.e_score_correction_bias = param(jnp.zeros((e,), jnp.float32), ("router_experts",), RouterBias)
        self.gate_proj = param(init(h ** -0.5)(rngs.params(), (e, h, f), pd), ("experts", "embed", "expert_mlp"))
        self.up_proj = param(init(h ** -0.5)(rngs.params(), (e, h, f), pd), ("experts", "embed", "expert_mlp"))
        self.down_proj = param(init(f ** -0.5)(rngs.params(), (e, f, h), pd), ("experts", "expert_mlp", "embed"))
        self.shared_experts = MLP(h, f * cfg.n_shared_experts, rngs=rngs, dtype=dtype, param_dtype=pd) \
            if cfg.n_shared_experts else None
        self.cfg = cfg
        self.dtype = dtype

    def __call__(self, x: jnp.ndarray, dispatch: str | None = None) -> jnp.ndarray:
        """x [..., hidden] -> [..., hidden]; dispatch as `DISPATCH` (its default)."""
        if x.shape[-1:] != (self.cfg.hidden_size,):
            raise ValueError(f"MoE: x has shape {x.shape}, but cfg.hidden_size is {self.cfg.hidden_size}")
        if explicit_axes():
            return on_auto_axes(self, lambda layer, x: layer(x, dispatch), (x,), leading_spec(x, x.ndim, x.ndim - 1))
        if self.dtype is not None:
            x = x.astype(self.dtype)
        shape = x.shape
        experts = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        if self.dtype is not None:
            experts = tuple(w.astype(self.dtype) for w in experts)
        routed = routed_experts(self.cfg, x.reshape(-1, shape[-1]), self.router[...],
                                self.e_score_correction_bias[...], *experts, dispatch)
        y = routed.astype(x.dtype).reshape(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
