"""MoE dispatch by permutation gathers (and the dense path): the same outputs and gradients as
the scatter-add dispatch it replaced (kept below as the reference), and no scatter-add in the
backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks._train_parts import old_expert_ffn
from glm_jax.layers import moe as moe_lib

HIDDEN, FFN = 16, 8


# ------------------------------------------------------------------ the reference: scatter-add dispatch
def _reference_route(cfg, x, router, bias):
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


def _reference_expert_ffn(xs, group_sizes, gate_proj, up_proj, down_proj):
    num_rows, num_experts = xs.shape[0], group_sizes.shape[0]
    block = moe_lib.block_rows(num_rows, num_experts)
    if block is None:
        ragged = lambda a, w: jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=jnp.float32)
        act = (jax.nn.silu(ragged(xs, gate_proj)) * ragged(xs, up_proj)).astype(xs.dtype)
        return ragged(act, down_proj)
    return old_expert_ffn(xs, group_sizes, gate_proj, up_proj, down_proj, block)   # blocks padded per expert


def reference_routed(cfg, tokens, router, bias, gate_proj, up_proj, down_proj):
    """The scatter-add dispatch: tokens [N, hidden] -> float32 [N, hidden]."""
    experts, weights = _reference_route(cfg, tokens, router, bias)
    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = (order // cfg.num_experts_per_tok).astype(jnp.int32)
    group_sizes = jnp.bincount(flat_expert, length=cfg.n_routed_experts).astype(jnp.int32)
    out = _reference_expert_ffn(tokens[token_of], group_sizes, gate_proj, up_proj, down_proj)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens.shape[0], tokens.shape[1]), jnp.float32).at[token_of].add(out)


# ------------------------------------------------------------------ cases
def _cfg(micro_cfg, experts=4, k=2, n_group=1, topk_group=1):
    return micro_cfg.replace(hidden_size=HIDDEN, moe_intermediate_size=FFN, n_routed_experts=experts,
                             num_experts_per_tok=k, n_group=n_group, topk_group=topk_group)


def _params(cfg, seed=0, unused_expert=None):
    e = cfg.n_routed_experts
    keys = jax.random.split(jax.random.key(seed), 5)
    bias = jax.random.normal(keys[4], (e,)) * 0.1
    if unused_expert is not None:      # scores are in (0, 1): a bias of -10 never wins
        bias = bias.at[unused_expert].set(-10.0)
    return dict(router=jax.random.normal(keys[0], (e, HIDDEN)) * HIDDEN ** -0.5, bias=bias,
                gate=jax.random.normal(keys[1], (e, HIDDEN, FFN)) * HIDDEN ** -0.5,
                up=jax.random.normal(keys[2], (e, HIDDEN, FFN)) * HIDDEN ** -0.5,
                down=jax.random.normal(keys[3], (e, FFN, HIDDEN)) * FFN ** -0.5)


def _run(fn, cfg, p, x):
    return fn(cfg, x, p["router"], p["bias"], p["gate"], p["up"], p["down"])


def _value_and_grads(fn, cfg, p, x):
    """-> (output, grads of a nonlinear loss w.r.t. (router, gate, up, down, x))."""
    def loss(router, gate, up, down, x):
        return jnp.sum(jnp.sin(_run(fn, cfg, dict(p, router=router, gate=gate, up=up, down=down), x)))

    args = (p["router"], p["gate"], p["up"], p["down"], x)
    return _run(fn, cfg, p, x), jax.grad(loss, argnums=tuple(range(5)))(*args)


def _new(dispatch):
    return lambda *a: moe_lib.routed_experts(*a, dispatch=dispatch)


SMALL = {"64 tokens": ({}, {}), "an expert with no tokens": ({}, dict(unused_expert=2)),
         "grouped routing": (dict(experts=8, n_group=4, topk_group=2), {})}


@pytest.mark.parametrize("dispatch", ["sorted", "ragged"])
@pytest.mark.parametrize("case", list(SMALL))
def test_sorted_dispatch_is_bitwise_the_scatter_add_dispatch(micro_cfg, case, dispatch):
    cfg_changes, param_changes = SMALL[case]
    cfg = _cfg(micro_cfg, **cfg_changes)
    p = _params(cfg, **param_changes)
    x = jax.random.normal(jax.random.key(7), (64, HIDDEN))
    if "unused_expert" in param_changes:
        experts, _ = moe_lib.route(cfg, x, p["router"], p["bias"])
        assert not (np.asarray(experts) == 2).any()
    got, got_grads = _value_and_grads(_new(dispatch), cfg, p, x)
    want, want_grads = _value_and_grads(reference_routed, cfg, p, x)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_array_equal(a, b)


def test_three_experts_per_token(micro_cfg):
    """k = 3: the k contributions are added in another order, so equal to rounding."""
    cfg = _cfg(micro_cfg, experts=8, k=3, n_group=4, topk_group=2)
    p, x = _params(cfg), jax.random.normal(jax.random.key(7), (64, HIDDEN))
    got, got_grads = _value_and_grads(_new("sorted"), cfg, p, x)
    want, want_grads = _value_and_grads(reference_routed, cfg, p, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unused_expert", [None, 1])
def test_blocked_dispatch_equals_the_scatter_add_dispatch(micro_cfg, unused_expert):
    """2048 tokens x 2 take the blocked matmuls: equal to rounding (gate and up run as one
    matmul, and the expert weights' gradients add their blocks in another order)."""
    cfg = _cfg(micro_cfg)
    p, x = _params(cfg, unused_expert=unused_expert), jax.random.normal(jax.random.key(7), (2048, HIDDEN))
    assert moe_lib.block_rows(2 * 2048, cfg.n_routed_experts) is not None
    got, got_grads = _value_and_grads(_new("sorted"), cfg, p, x)
    want, want_grads = _value_and_grads(reference_routed, cfg, p, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", list(SMALL))
def test_dense_dispatch_equals_the_scatter_add_dispatch(micro_cfg, case):
    """Every expert on every token, unpicked ones weighted 0: the same to rounding (the routing
    weight multiplies the activations before the down projection)."""
    cfg_changes, param_changes = SMALL[case]
    cfg = _cfg(micro_cfg, **cfg_changes)
    p, x = _params(cfg, **param_changes), jax.random.normal(jax.random.key(7), (64, HIDDEN))
    got, got_grads = _value_and_grads(_new("dense"), cfg, p, x)
    want, want_grads = _value_and_grads(reference_routed, cfg, p, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens", [64, 2048])
@pytest.mark.parametrize("dispatch", ["sorted", "dense"])
def test_bfloat16_gradients_are_close_to_float32(micro_cfg, dispatch, tokens):
    """bf16 experts and tokens: gradients in the inputs' dtypes, and as close to the float32
    reference on the same values as bf16 allows (2%), or as the old dispatch in bf16 came.
    The router stays float32, so the routing is the same."""
    cfg = _cfg(micro_cfg)
    p, x = _params(cfg), jax.random.normal(jax.random.key(7), (tokens, HIDDEN)).astype(jnp.bfloat16)
    low = dict(p, **{k: p[k].astype(jnp.bfloat16) for k in ("gate", "up", "down")})
    got = _value_and_grads(_new(dispatch), cfg, low, x)
    assert [g.dtype for g in got[1]] == [jnp.float32] + [jnp.bfloat16] * 4
    old = _value_and_grads(reference_routed, cfg, low, x)
    up = lambda a: a.astype(jnp.float32)
    want = _value_and_grads(reference_routed, cfg, jax.tree.map(up, low), up(x))
    error = lambda a, b: np.abs(np.asarray(a, np.float32) - np.asarray(b)).max() / np.abs(np.asarray(b)).max()
    for a, o, b in zip(jax.tree.leaves(got), jax.tree.leaves(old), jax.tree.leaves(want)):
        assert error(a, b) <= max(2e-2, 1.1 * error(o, b))


def _grad_jaxpr(fn, cfg, p, x):
    return str(jax.make_jaxpr(lambda p, x: _value_and_grads(fn, cfg, p, x))(p, x))


@pytest.mark.parametrize("tokens", [64, 2048])            # ragged_dot, blocked matmuls
def test_backward_has_no_scatter_add(micro_cfg, tokens):
    cfg = _cfg(micro_cfg)
    p, x = _params(cfg), jnp.zeros((tokens, HIDDEN))
    assert "scatter-add" in _grad_jaxpr(reference_routed, cfg, p, x)   # the check sees the old dispatch's
    for dispatch in ("sorted", "ragged", "dense"):
        assert "scatter-add" not in _grad_jaxpr(_new(dispatch), cfg, p, x), dispatch


def test_take_rows_gradient_is_the_gather_gradient():
    """A partial permutation with padding rows, both ways: gradients equal jnp.take's autodiff."""
    rng = np.random.default_rng(0)
    rows, taken = 7, 10
    index = np.full(taken, rows)                      # 3 zero (padding) rows
    inverse = np.full(rows, taken)
    dst = rng.permutation(taken)[:rows]
    index[dst], inverse[:] = np.arange(rows), dst
    index, inverse = jnp.asarray(index, jnp.int32), jnp.asarray(inverse, jnp.int32)
    x = jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(taken, 3)), jnp.float32)
    plain = lambda x: jnp.take(x, index, axis=0, mode="fill", fill_value=0)
    np.testing.assert_array_equal(moe_lib.take_rows(x, index, inverse), plain(x))
    grad = lambda f: jax.grad(lambda x: jnp.sum(f(x) * cot))(x)
    np.testing.assert_array_equal(grad(lambda x: moe_lib.take_rows(x, index, inverse)), grad(plain))
    back = moe_lib.take_rows(moe_lib.take_rows(x, index, inverse), inverse, index)
    np.testing.assert_array_equal(back, x)


def test_moe_module_takes_the_dispatch(micro_cfg):
    from flax import nnx

    cfg = _cfg(micro_cfg)
    moe = moe_lib.MoE(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 8, HIDDEN))
    sorted_out, dense_out = moe(x, dispatch="sorted"), moe(x, dispatch="dense")
    np.testing.assert_allclose(sorted_out, dense_out, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown MoE dispatch"):
        moe(x, dispatch="scatter")
