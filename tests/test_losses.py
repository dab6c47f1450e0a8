"""Each loss against a direct small implementation of its formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax import ops
from glm_jax.layers.decoder import indexer_kl
from glm_jax.model import GLMModel
from glm_jax.training.losses import (cross_entropy, end_to_end_tv, head_cross_entropy, head_total_variation,
                                    total_variation)
from glm_jax.training.step import LossWeights, loss_terms
from conftest import micro_config


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_cross_entropy_matches_numpy():
    logits = np.random.default_rng(0).normal(size=(2, 3, 7)).astype(np.float32)
    targets = np.array([[1, 2, 3], [4, 5, 6]])
    mask = np.array([[1, 1, 0], [1, 0, 1]], bool)
    want = -np.log(_softmax(logits)[np.arange(2)[:, None], np.arange(3)[None], targets])[mask].mean()
    assert float(cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))) == pytest.approx(want, rel=1e-5)


def test_chunked_head_terms_equal_the_direct_ones():
    """Through the head in chunks of 3 of 7 positions (a ragged tail): the values and the
    gradients (head weight and hidden) of CE and TV computed on the whole logits."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(5, 11)), jnp.float32)
    h, h2 = (jnp.asarray(rng.normal(size=(2, 7, 5)), jnp.float32) for _ in range(2))
    targets = jnp.asarray(rng.integers(0, 11, (2, 7)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 7)) > 0.3)

    def direct(w, h, h2):
        return cross_entropy(h @ w, targets, mask) + jnp.sum(total_variation(h @ w, h2 @ w) * jnp.arange(7.0))

    def chunked(w, h, h2):
        head = lambda x: x @ w
        return (head_cross_entropy(head, h, targets, mask, chunk=3)
                + jnp.sum(head_total_variation(head, h, h2, chunk=3) * jnp.arange(7.0)))

    assert float(chunked(w, h, h2)) == pytest.approx(float(direct(w, h, h2)), rel=1e-6)
    for got, want in zip(jax.grad(chunked, argnums=(0, 1, 2))(w, h, h2), jax.grad(direct, argnums=(0, 1, 2))(w, h, h2)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_total_variation_and_end_to_end():
    rng = np.random.default_rng(1)
    p, q1, q2 = (rng.normal(size=(1, 4, 5)).astype(np.float32) for _ in range(3))
    tv1 = 1 - np.minimum(_softmax(p), _softmax(q1)).sum(-1)
    tv2 = 1 - np.minimum(_softmax(p), _softmax(q2)).sum(-1)
    np.testing.assert_allclose(total_variation(jnp.asarray(p), jnp.asarray(q1)), tv1, rtol=1e-5)
    mask = np.array([[True, True, True, False]])
    want = (1 - 0.5 * ((1 - tv1) + (1 - tv1) * (1 - tv2)))[mask].mean()
    got = end_to_end_tv([jnp.asarray(tv1), jnp.asarray(tv2)], jnp.asarray(mask))
    assert float(got) == pytest.approx(want, rel=1e-5)
    # the target side gets no gradient
    g = jax.grad(lambda a: total_variation(a, jnp.asarray(q1)).sum())(jnp.asarray(p))
    assert not np.any(np.asarray(g))


def test_indexer_kl_matches_numpy():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(1, 3, 4)).astype(np.float32)
    mask = np.tril(np.ones((3, 4), bool), 1)[None]
    target = rng.random((1, 3, 4)) * mask
    target /= target.sum(-1, keepdims=True)
    q = np.where(mask, np.exp(logits), 0)
    q /= q.sum(-1, keepdims=True)
    want = np.sum(np.where(target > 0, target * (np.log(np.where(target > 0, target, 1)) - np.log(np.where(mask, q, 1))), 0))
    got = indexer_kl(jnp.asarray(target, jnp.float32), jnp.asarray(logits), jnp.asarray(mask))
    assert float(got) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_multi_depth_mtp_losses_with_and_without_kv_share(stage):
    cfg = micro_config()
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for kv_share in (True, False):
        w = LossWeights(mtp_depth=3, kv_share=kv_share, tv=0.5)
        total, terms = loss_terms(model, inputs, targets, stage=stage, weights=w, kernels=ops.KernelChoice())
        assert np.isfinite(float(total)) and 0 <= float(terms["mtp_tv"]) <= 1
        results[kv_share] = float(terms["mtp"])
    assert results[True] != pytest.approx(results[False], rel=1e-6)
    # depth 1 alone does not depend on the KVShare switch
    one = [float(loss_terms(model, inputs, targets, stage=stage, weights=LossWeights(kv_share=k),
                            kernels=ops.KernelChoice())[1]["mtp"]) for k in (True, False)]
    assert one[0] == one[1]


def test_grouped_selected_set_kl_equals_the_per_layer_sum():
    """The group's KL from the attention kernel's targets, the indexer side computed once on
    their weighted sum, equals the sum over the group's layers of share * the dense-matrix KL
    of each layer's head-summed attention, with the same gradients into the indexer's queries,
    keys and weights (one row selects nothing: padded slots)."""
    import pallas_kernels as pk
    from glm_jax.layers.selected_kl import add_target, selected_set_kl

    rng = np.random.default_rng(0)
    B, S, H, Dk, K, Hi, Di, scale, layers = 2, 9, 3, 8, 4, 2, 5, 0.3, 3
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    qs, latents, iq, ik = f32(layers, B, S, H, Dk), f32(layers, B, S, Dk), f32(B, S, Hi, Di), f32(B, S, Di)
    iw = jnp.asarray(rng.random((B, S, Hi)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)).at[1, 0].set(-1)
    n = jnp.full((B,), S, jnp.int32)
    idx = pk.indexer_topk(iq, ik, iw, topk=K, q_pos=pos, kv_len=n, impl="reference")
    b, s = jnp.arange(B)[:, None, None], jnp.arange(S)[None, :, None]
    mask = jnp.zeros((B, S, S), bool).at[b, s, jnp.maximum(idx, 0)].max(idx >= 0)

    def grouped(iq, ik, iw):
        acc = None
        for q, latent in zip(qs, latents):
            _, _, target = pk.sparse_mla(q, latent, idx, sm_scale=scale, v_dim=4, return_target=True)
            acc = add_target(acc, target, 1.0 / layers)
        return selected_set_kl(acc, idx_q=iq, idx_keys=ik, idx_w=iw, indices=idx, kernels=ops.KernelChoice())

    def per_layer(iq, ik, iw):
        scores = pk.indexer_scores(iq, ik, iw, q_pos=pos, kv_len=n, impl="reference")
        total = 0.0
        for q, latent in zip(qs, latents):
            logits = jnp.where(mask[:, None], jnp.einsum("bshd,btd->bhst", q, latent) * scale, -jnp.inf)
            probs = jnp.where(mask[:, None], jax.nn.softmax(logits, -1), 0.0).sum(1)
            target = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
            total = total + indexer_kl(target, scores, mask) / layers
        return total

    np.testing.assert_allclose(grouped(iq, ik, iw), per_layer(iq, ik, iw), rtol=1e-5)
    for a, b in zip(jax.grad(grouped, (0, 1, 2))(iq, ik, iw), jax.grad(per_layer, (0, 1, 2))(iq, ik, iw)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_long_sequence_forms_equal_the_expanded_form():
    """The forms that hold no [S, T] matrices (dense: fused causal attention; sparse: sparse MLA
    with the chunked selected-set KL) give the expanded form's logits, KL and KL gradients."""
    from glm_jax.layers.decoder import AttentionSettings

    cfg = micro_config()
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    run = lambda m, **kw: m(tokens, settings=AttentionSettings(**kw))
    np.testing.assert_allclose(run(model, mode="dense", form="absorbed").logits,
                               run(model, mode="dense", form="expanded").logits, atol=2e-5)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def kl(params, form):
        out = run(nnx.merge(graphdef, params, rest), mode="sparse", form=form, indexer_loss=True)
        return out.indexer_kl, out.logits

    kl_and_grads = jax.jit(jax.value_and_grad(kl, has_aux=True), static_argnums=1)
    (kl_a, logits_a), grads_a = kl_and_grads(params, "absorbed")
    (kl_e, logits_e), grads_e = kl_and_grads(params, "expanded")
    np.testing.assert_allclose(logits_a, logits_e, atol=2e-5)
    np.testing.assert_allclose(kl_a, kl_e, rtol=1e-5)
    assert float(kl_a) > 0
    for a, e in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_e)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="dense-stage indexer loss"):
        run(model, mode="dense", form="absorbed", indexer_loss=True)


@pytest.mark.parametrize("stage,form", [("sparse", "absorbed"), ("dense", "expanded")])
def test_remat_keeps_the_loss_and_gradients(stage, form):
    """Per-layer rematerialisation (only each layer's input and the top-k kept) changes memory,
    not results: the compiled step's temporaries shrink (XLA may not merge the recomputed layer
    with the original one, which would keep every activation alive again)."""
    cfg = micro_config()
    graphdef, params, rest = nnx.split(GLMModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, cfg.vocab_size)

    def loss(params, remat):
        model = nnx.merge(graphdef, params, rest)
        return loss_terms(model, tokens[:, :-1], tokens[:, 1:], stage=stage, weights=LossWeights(indexer=1.0),
                          kernels=ops.KernelChoice(), remat=remat, form=form)[0]

    compiled = [jax.jit(jax.value_and_grad(loss), static_argnums=1).lower(params, r).compile() for r in (False, True)]
    temps = [c.memory_analysis().temp_size_in_bytes for c in compiled]
    assert temps[1] < 0.6 * temps[0], temps
    (plain, g_plain), (remat, g_remat) = (c(params) for c in compiled)
    assert float(remat) == pytest.approx(float(plain), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def _sorts(jaxpr) -> int:
    """Sort ops in a jaxpr and the jaxprs nested in its equations."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "sort"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += _sorts(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += _sorts(sub)
    return count


def test_sparse_attention_backward_index_is_sorted_once_per_group():
    """The Pallas sparse-MLA backward's transposed index is built by each IndexShare group's Full
    layer and reused by its Shared layers: one sort per group (2 in the stack, 1 in MTP), not one
    per layer (6), beyond the sorts of the XLA path (which takes no index)."""
    cfg = micro_config()                        # FSSFS: groups of 3 and 2 layers, one MTP layer
    graphdef, params, rest = nnx.split(GLMModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, cfg.vocab_size)

    def sorts(attention):
        def loss(params):
            model = nnx.merge(graphdef, params, rest)
            kernels = ops.KernelChoice(attention=attention, interpret=attention != "xla")
            return loss_terms(model, tokens[:, :-1], tokens[:, 1:], stage="sparse", weights=LossWeights(indexer=1.0),
                              kernels=kernels, form="absorbed")[0]
        return _sorts(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)

    assert sorts("pallas_gpu") - sorts("xla") == 3
