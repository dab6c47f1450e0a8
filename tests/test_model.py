"""Model semantics: sparse == dense when top-k covers the context, absorbed == expanded MLA,
cached decode == full forward, IndexShare threading, MoE dispatch == per-expert loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax import ops
from glm_jax.cache import create_cache
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers import moe as moe_lib
from glm_jax.layers.decoder import plan_groups
from glm_jax.model import GLMModel
from jitted_calls import forward_cached, forward_logits

ATOL = 2e-4


def _model(cfg, seed=0):
    return GLMModel(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def micro_model():
    """The micro config's model (seed 0), shared by the tests that only read it."""
    from conftest import micro_config

    return _model(micro_config())


def _tokens(cfg, b, s, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, s), 0, cfg.vocab_size, jnp.int32)


def test_group_plan_stacks_identical_groups(micro_cfg):
    plans = plan_groups(micro_cfg)  # FSSFS, first layer dense
    assert [(p.first_layer, len(p.kinds), p.count) for p in plans] == [(0, 3, 1), (3, 2, 1)]
    cfg = micro_cfg.replace(num_hidden_layers=9, index_topk_pattern="FSFSFSFSS", first_k_dense_replace=0)
    assert [(p.first_layer, len(p.kinds), p.count) for p in plan_groups(cfg)] == [(0, 2, 3), (6, 3, 1)]


def test_sparse_equals_dense_when_topk_covers_context(micro_cfg):
    cfg = micro_cfg.replace(index_topk=16)
    model, tokens = _model(cfg), _tokens(cfg, 2, 12)
    for form in ("absorbed", "expanded"):
        sparse = forward_logits(model, tokens, ForwardOptions(mode="sparse", form=form))
        dense = forward_logits(model, tokens, ForwardOptions(mode="dense", form=form))
        np.testing.assert_allclose(sparse, dense, atol=ATOL, rtol=1e-4)


def test_sparse_differs_from_dense_when_topk_is_small(micro_cfg, micro_model):
    model, tokens = micro_model, _tokens(micro_cfg, 2, 12)
    sparse = forward_logits(model, tokens, ForwardOptions(mode="sparse"))
    dense = forward_logits(model, tokens, ForwardOptions(mode="dense"))
    assert np.abs(np.asarray(sparse - dense))[:, micro_cfg.index_topk:].max() > 1e-3
    np.testing.assert_allclose(sparse[:, :micro_cfg.index_topk], dense[:, :micro_cfg.index_topk], atol=ATOL)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_absorbed_equals_expanded(micro_cfg, micro_model, mode):
    model, tokens = micro_model, _tokens(micro_cfg, 2, 12)
    a = forward_logits(model, tokens, ForwardOptions(mode=mode, form="absorbed"))
    e = forward_logits(model, tokens, ForwardOptions(mode=mode, form="expanded"))
    np.testing.assert_allclose(a, e, atol=ATOL, rtol=1e-4)


def test_cached_decode_equals_full_forward(micro_cfg, micro_model):
    model, tokens = micro_model, _tokens(micro_cfg, 2, 11)
    full = forward_logits(model, tokens)
    cache = create_cache(micro_cfg, 2, 16)
    # prefill 5 tokens as one chunk, then one token at a time
    logits, _, cache = forward_cached(model, tokens[:, :5], cache)
    steps = [logits]
    for t in range(5, 11):
        logits, _, cache = forward_cached(model, tokens[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=ATOL, rtol=1e-4)
    assert cache.lengths.tolist() == [11, 11]


def test_padded_prefill_chunk_equals_unpadded(micro_cfg, micro_model):
    model, tokens = micro_model, _tokens(micro_cfg, 1, 7)
    full = forward_logits(model, tokens)
    padded = jnp.concatenate([tokens, jnp.zeros((1, 5), jnp.int32)], axis=1)
    logits, _, cache = forward_cached(model, padded, create_cache(micro_cfg, 1, 16), jnp.array([7]))
    np.testing.assert_allclose(logits[:, :7], full, atol=ATOL, rtol=1e-4)
    nxt, _, _ = forward_cached(model, tokens[:, :1], cache)
    ref = forward_logits(model, jnp.concatenate([tokens, tokens[:, :1]], axis=1))[:, -1:]
    np.testing.assert_allclose(nxt, ref, atol=ATOL, rtol=1e-4)


def test_shared_layers_own_no_indexer_and_reuse_full_indices(micro_cfg, micro_model, monkeypatch):
    model, tokens = micro_model, _tokens(micro_cfg, 1, 12)
    for plan, stack in zip(model.plan, model.stacks):
        for kind, layer in zip(plan.kinds, stack.layers):
            assert (layer.indexer is not None) == kind.is_full
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert "indexer" not in params["stacks"][0]["layers"][1]
    assert "indexer" in params["stacks"][0]["layers"][0]

    selected, attended = [], []
    real_topk, real_mla = ops.indexer_topk, ops.sparse_mla

    def spy_topk(*a, **k):
        out = real_topk(*a, **k)
        selected.append(np.asarray(out))
        return out

    def spy_mla(q, kv, indices, **k):
        attended.append(np.asarray(indices))
        return real_mla(q, kv, indices, **k)

    monkeypatch.setattr(ops, "indexer_topk", spy_topk)
    monkeypatch.setattr(ops, "sparse_mla", spy_mla)
    with jax.disable_jit():
        model(tokens, options=ForwardOptions(mode="sparse", form="absorbed"))
    # pattern FSSFS: 2 indexer calls, 5 attention calls (+1 MTP-free path)
    assert len(selected) == 2 and len(attended) == 5
    for i in (0, 1, 2):
        np.testing.assert_array_equal(attended[i], selected[0])
    for i in (3, 4):
        np.testing.assert_array_equal(attended[i], selected[1])
    assert not np.array_equal(selected[0], selected[1])


def test_moe_dispatch_equals_per_expert_loop(micro_cfg):
    cfg = micro_cfg.replace(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2)
    moe = moe_lib.MoE(cfg, rngs=nnx.Rngs(3), param_dtype=jnp.float32)
    moe.e_score_correction_bias[...] = jax.random.normal(jax.random.key(5), (8,)) * 0.1
    x = jax.random.normal(jax.random.key(4), (2, 7, cfg.hidden_size))
    got = moe(x)

    tokens = np.asarray(x.reshape(-1, cfg.hidden_size))
    router = np.asarray(moe.router[...])
    bias = np.asarray(moe.e_score_correction_bias[...])
    want = np.zeros_like(tokens)
    for n, t in enumerate(tokens):
        scores = 1 / (1 + np.exp(-(router @ t)))
        choice = scores + bias
        groups = choice.reshape(4, 2)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-group_score, kind="stable")[:2]
        masked = np.full_like(choice, -np.inf)
        for g in keep:
            masked[g * 2:(g + 1) * 2] = choice[g * 2:(g + 1) * 2]
        experts = np.argsort(-masked, kind="stable")[:3]
        w = scores[experts] / scores[experts].sum() * cfg.routed_scaling_factor
        for e, we in zip(experts, w):
            g = t @ np.asarray(moe.gate_proj[...][e])
            u = t @ np.asarray(moe.up_proj[...][e])
            want[n] += we * ((g / (1 + np.exp(-g))) * u) @ np.asarray(moe.down_proj[...][e])
    want = want + np.asarray(moe.shared_experts(jnp.asarray(tokens)))
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sizes", [(0, 3000, 5, 0, 4000, 1290, 0, 1614), (1280,) * 8])
def test_blocked_expert_matmuls_equal_ragged_dot(sizes):
    """Many rows per expert take the blocked path: values and gradients equal ragged_dot's,
    also with empty experts and group sizes that are no multiple of the block."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(sizes, jnp.int32)
    num_rows, (e, h, f) = int(sizes.sum()), (8, 8, 16)
    assert moe_lib.block_rows(num_rows, e) is not None
    xs = jnp.asarray(rng.normal(size=(num_rows, h)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=shape), jnp.float32) * 0.3 for shape in ((e, h, f), (e, h, f), (e, f, h))]

    def ragged(xs, g, u, d):
        dot = lambda a, w: jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32)
        return dot(jax.nn.silu(dot(xs, g)) * dot(xs, u), d)

    np.testing.assert_allclose(moe_lib.expert_ffn(xs, sizes, *ws), ragged(xs, *ws), rtol=1e-5, atol=1e-5)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))
    got = jax.grad(loss(lambda x, *w: moe_lib.expert_ffn(x, sizes, *w)), argnums=(0, 1, 2, 3))(xs, *ws)
    want = jax.grad(loss(ragged), argnums=(0, 1, 2, 3))(xs, *ws)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@nnx.jit
def _forward_then_mtp(model, tokens):
    """model.mtp_forward over model(tokens)'s hidden states, as one program -> (MTP logits
    [B, S, V], (latent [B, S, latent], indices [B, S, topk]))."""
    mtp, selection = model.mtp_forward(model(tokens).hidden, tokens)
    return mtp.logits, selection


def test_mtp_forward_shapes(micro_cfg, micro_model):
    tokens = _tokens(micro_cfg, 2, 9)
    logits, (latent, indices) = _forward_then_mtp(micro_model, tokens)
    assert latent.shape == (2, 9, micro_cfg.latent_dim) and indices.shape == (2, 9, micro_cfg.index_topk)
    assert logits.shape == (2, 9, micro_cfg.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()


def test_kernel_configs_reach_the_ops(micro_cfg, micro_model):
    """KernelChoice's indexer_topk and sparse_mla configs are passed to the ops, in the full
    forward and through the cache view: the same logits with another query chunk, and a config
    of another implementation refused."""
    import pallas_kernels as pk

    model, tokens = micro_model, _tokens(micro_cfg, 1, 8)
    kernels = ops.KernelChoice(indexer_topk=("xla", pk.XlaConfig(q_chunk=2)),
                               sparse_mla=("xla", pk.XlaConfig(q_chunk=3)))
    base = forward_logits(model, tokens)
    np.testing.assert_allclose(forward_logits(model, tokens, ForwardOptions(kernels=kernels)), base,
                               atol=ATOL, rtol=1e-4)
    cache = create_cache(micro_cfg, 1, 16)
    logits, _, _ = forward_cached(model, tokens, cache, options=ForwardOptions(kernels=kernels))
    np.testing.assert_allclose(logits, base, atol=ATOL, rtol=1e-4)
    wrong = ops.KernelChoice(indexer_topk=("auto", pk.SparseMLAGpuConfig()))    # "auto" is xla on a CPU
    with pytest.raises(ValueError, match="takes config=XlaConfig"):
        model.forward_cached(tokens, create_cache(micro_cfg, 1, 16), options=ForwardOptions(kernels=wrong))
    with pytest.raises(ValueError, match="^KernelChoice indexer_topk='xla' takes config=XlaConfig"):
        ops.KernelChoice(indexer_topk=("xla", pk.SparseMLAGpuConfig()))


def test_cached_calls_read_only_the_kernels_of_their_options(micro_cfg, micro_model):
    """The cached calls attend sparse in the absorbed form: options asking for anything else
    (a mode, a form, remat...) are refused, naming the call and the fields."""
    model, tokens = micro_model, _tokens(micro_cfg, 1, 4)
    with pytest.raises(ValueError, match=r"GLMModel.forward_cached: a cached call reads only options.kernels .*"
                                         r"mode='dense', remat=True"):
        model.forward_cached(tokens, create_cache(micro_cfg, 1, 16), options=ForwardOptions(mode="dense", remat=True))
    with pytest.raises(TypeError, match=r"GLMModel.forward_cached: options must be a ForwardOptions"):
        model.forward_cached(tokens, create_cache(micro_cfg, 1, 16), options=ops.KernelChoice())
