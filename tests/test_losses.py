"""Each loss against a direct small implementation of its formula."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels as pk
from glm_jax import ops
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.decoder import indexer_kl
from glm_jax.model import GLMModel
from glm_jax.training.head_losses import linear_cross_entropy, linear_cross_entropy_with_tv, linear_nll_and_tv
from glm_jax.training.losses import (cross_entropy, end_to_end_tv, head_cross_entropy, shift_left, token_nll,
                                    total_variation)
from glm_jax.training.step import LossWeights, _targets_ahead, loss_terms
from conftest import jaxpr_equations, micro_config

#: The micro config cut to two layers, one IndexShare group (Full, Shared; a dense MLP then an
#: MoE) and the MTP layer: for the checks that do not count layers or groups.
TWO_LAYERS = dict(num_hidden_layers=2, index_topk_pattern="FS")


@functools.cache
def _micro_parts(**changes) -> tuple:
    """The micro model (`micro_config(**changes)`, seed 0), initialised once for the file ->
    (config, graphdef, params, the rest of its state)."""
    cfg = micro_config(**changes)
    return (cfg, *nnx.split(GLMModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_cross_entropy_matches_numpy():
    logits = np.random.default_rng(0).normal(size=(2, 3, 7)).astype(np.float32)
    targets = np.array([[1, 2, 3], [4, 5, 6]])
    mask = np.array([[1, 1, 0], [1, 0, 1]], bool)
    want = -np.log(_softmax(logits)[np.arange(2)[:, None], np.arange(3)[None], targets])[mask].mean()
    assert float(cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))) == pytest.approx(want, rel=1e-5)


def test_chunked_head_cross_entropy_equals_the_direct_one():
    """Through a head function in chunks of 3 of 7 positions (a ragged tail): the value and the
    gradients (head weight and hidden) of CE computed on the whole logits."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(5, 11)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(2, 7, 5)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, (2, 7)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 7)) > 0.3)
    direct = lambda w, h: cross_entropy(h @ w, targets, mask)
    chunked = lambda w, h: head_cross_entropy(lambda x: x @ w, h, targets, mask, chunk=3)
    assert float(chunked(w, h)) == pytest.approx(float(direct(w, h)), rel=1e-6)
    for got, want in zip(jax.grad(chunked, argnums=(0, 1))(w, h), jax.grad(direct, argnums=(0, 1))(w, h)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _head_case(dtype, b=2, s=7, hidden=6, vocab=11, seed=4):
    """Random hidden, target hidden [b, s, hidden] and kernel [hidden, vocab] in dtype, targets,
    a mask, and two per-position cotangents [b, s]."""
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    h, p, w = arr(b, s, hidden).astype(dtype), arr(b, s, hidden).astype(dtype), arr(hidden, vocab).astype(dtype)
    targets = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
    mask = jnp.asarray(rng.random((b, s)) > 0.3)
    return h, p, w, targets, mask, arr(b, s), arr(b, s)


def _full_logits(x, w):
    """The head on every position at once: float32 [B, S, V] (model-dtype products, f32 sums)."""
    return jnp.einsum("bsh,hv->bsv", x, w, preferred_element_type=jnp.float32)


def _assert_close(got, want, dtype, what):
    """float32: to rounding; bfloat16: to the bf16 dlogits and outputs (about 1% of the scale)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(np.abs(want).max(), 1e-3), err_msg=what)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_cross_entropy_equals_the_full_logits_formula(dtype):
    """Chunks of 3 of 7 positions: the masked-mean CE and its gradients (hidden, kernel, scaled by
    the cotangent), with and without the reported TV, which is the full formula's and carries no
    gradient (the target hidden gets none either)."""
    h, p, w, targets, mask, _, c = _head_case(dtype)
    want, want_grads = jax.value_and_grad(lambda h, w: cross_entropy(_full_logits(h, w), targets, mask), (0, 1))(h, w)
    got, got_grads = jax.value_and_grad(lambda h, w: 3.0 * linear_cross_entropy(h, w, targets, mask, chunk=3),
                                        (0, 1))(h, w)
    assert float(got) == pytest.approx(3.0 * float(want), rel=1e-5)
    for name, g, r in zip(("hidden", "kernel"), got_grads, want_grads, strict=True):
        assert g.dtype == dtype
        _assert_close(g, 3.0 * r, dtype, name)

    def with_tv(h, w, p):
        ce, tv = linear_cross_entropy_with_tv(h, w, targets, mask, p, chunk=3)
        return ce + jnp.sum(tv * c), tv

    (_, tv), grads = jax.value_and_grad(with_tv, (0, 1, 2), has_aux=True)(h, w, p)
    _assert_close(tv, total_variation(_full_logits(p, w), _full_logits(h, w)), jnp.float32, "tv")
    for name, g, r in zip(("hidden", "kernel"), grads[:2], want_grads, strict=True):
        _assert_close(g, r, dtype, name)
    assert not np.any(np.asarray(grads[2], np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_nll_and_tv_equal_the_full_logits_formulas(dtype):
    """Chunks of 3 of 7 positions: per-position CE and TV and their vector-Jacobian products
    (hidden, kernel) for independent per-position cotangents, together and for TV alone; the
    target side gets no gradient."""
    h, p, w, targets, _, a, c = _head_case(dtype)

    def direct(h, w, p):
        q_logits = _full_logits(h, w)
        return token_nll(q_logits, targets), total_variation(_full_logits(p, w), q_logits)

    got, got_vjp = jax.vjp(lambda h, w, p: linear_nll_and_tv(h, w, targets, p, chunk=3), h, w, p)
    want, want_vjp = jax.vjp(direct, h, w, p)
    for name, g, r in zip(("nll", "tv"), got, want, strict=True):
        _assert_close(g, r, jnp.float32, name)
    for cts in ((a, c), (jnp.zeros_like(a), c)):
        grads = got_vjp(cts)
        for name, g, r in zip(("hidden", "kernel"), grads[:2], want_vjp(cts)[:2], strict=True):
            assert g.dtype == dtype
            _assert_close(g, r, dtype, name)
        assert not np.any(np.asarray(grads[2], np.float32))


def test_linear_head_losses_hold_one_chunk_of_logits():
    """Value and gradient of each head loss at S = 16 in chunks of 4: the largest float32 array
    with a vocabulary axis is one chunk's logits [B, 4, V], never [B, S, V]. Compiled at S = 64,
    the temporaries of the MTP terms stay below half of one [B, S, V] float32 array (the same
    function in one chunk needs more than one)."""
    b, s, hidden, vocab, chunk = 2, 16, 8, 37, 4
    h, p, w, targets, mask, a, c = _head_case(jnp.bfloat16, b=b, s=s, hidden=hidden, vocab=vocab)
    losses = {
        "ce": lambda h, w, chunk: linear_cross_entropy(h, w, targets, mask, chunk=chunk),
        "ce_tv": lambda h, w, chunk: jnp.sum(linear_cross_entropy_with_tv(h, w, targets, mask, p, chunk=chunk)[1]),
        "nll_tv": lambda h, w, chunk: sum(jnp.sum(x * y) for x, y in
                                          zip(linear_nll_and_tv(h, w, targets, p, chunk=chunk), (a, c))),
    }
    for name, loss in losses.items():
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)), static_argnums=2)(h, w, chunk).jaxpr
        sizes = [int(np.prod(v.aval.shape)) for e in jaxpr_equations(jaxpr) for v in e.outvars
                 if v.aval.dtype == jnp.float32 and v.aval.shape and v.aval.shape[-1] == vocab]
        assert max(sizes) == b * chunk * vocab, (name, max(sizes))

    s, vocab = 64, 512                      # the lambdas above see the new arrays
    h, p, w, targets, mask, a, c = _head_case(jnp.bfloat16, b=b, s=s, hidden=hidden, vocab=vocab)
    temps = [jax.jit(jax.grad(losses["nll_tv"], (0, 1)), static_argnums=2).lower(h, w, k).compile()
             .memory_analysis().temp_size_in_bytes for k in (chunk, s)]
    full = b * s * vocab * 4
    assert temps[0] < full / 2 and temps[1] >= full, (temps, full)


def _old_loss(model, inputs, targets, weights: LossWeights, segment_ids):
    """`loss_terms` (expanded dense attention) as it was before the head losses were fused: the
    terms from the whole logits of `model.logits`. -> (total, {"lm", "mtp", "mtp_tv"})."""
    options = ForwardOptions(mode="dense", form="expanded", indexer_loss=weights.indexer > 0)
    out = model(inputs, options=options, segment_ids=segment_ids)
    s = inputs.shape[1]
    lm_mask = None if segment_ids is None else segment_ids > 0
    terms = {"lm": cross_entropy(model.logits(out.hidden), targets, lm_mask)}
    total = terms["lm"] + weights.indexer * out.indexer_kl / (s * len(model.cfg.full_layers))
    hidden, shared, ces, tvs = out.hidden, None, [], []
    for d in range(1, weights.mtp_depth + 1):
        mtp, kv = model.mtp_forward(hidden, shift_left(targets, d - 1), options=options, shared_kv=shared,
                                    segment_ids=segment_ids)
        mask = jnp.broadcast_to(_targets_ahead(segment_ids, s, d), targets.shape)
        ces.append(cross_entropy(model.logits(mtp.hidden), shift_left(targets, d), mask))
        tv_inputs = (shift_left(out.hidden, d), mtp.hidden)
        if not weights.tv:
            tv_inputs = jax.lax.stop_gradient(tv_inputs)
        tvs.append(total_variation(*map(model.logits, tv_inputs)))
        if d == 1:
            total = total + weights.indexer * mtp.indexer_kl / s
            shared = kv if weights.kv_share else None
        hidden = mtp.hidden
    terms["mtp"] = sum(ces) / len(ces)
    terms["mtp_tv"] = end_to_end_tv(tvs, _targets_ahead(segment_ids, s, weights.mtp_depth))
    return total + weights.mtp * terms["mtp"] + weights.tv * terms["mtp_tv"], terms


@pytest.mark.parametrize("tv,packed", [(0.5, True), (0.0, False)])
def test_loss_terms_with_mtp_depth_3_equal_the_full_logits_path(tv, packed):
    """MTP depth 3 with a trained (0.5) or only reported (0) TV, packed rows or not: the total,
    the LM, MTP and TV terms and the gradients of every parameter are those of the terms on the
    whole logits."""
    cfg, graphdef, params, rest = _micro_parts(**TWO_LAYERS)
    tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, cfg.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    segments = jnp.asarray([[1] * 5 + [2] * 6, [1] * 9 + [0] * 2], jnp.int32) if packed else None
    weights = LossWeights(mtp=0.3, mtp_depth=3, tv=tv)

    def new(params):
        return loss_terms(nnx.merge(graphdef, params, rest), inputs, targets, weights=weights, segment_ids=segments,
                          options=ForwardOptions(mode="dense", form="expanded"))

    def old(params):
        return _old_loss(nnx.merge(graphdef, params, rest), inputs, targets, weights, segments)

    both = jax.jit(lambda params: [jax.value_and_grad(f, has_aux=True)(params) for f in (new, old)])   # one program
    ((got, got_terms), got_grads), ((want, want_terms), want_grads) = both(params)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for name in ("lm", "mtp", "mtp_tv"):
        assert float(got_terms[name]) == pytest.approx(float(want_terms[name]), rel=1e-6), name
    assert float(want_terms["mtp_tv"]) > 0.01
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


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
    cfg, graphdef, params, rest = _micro_parts(**TWO_LAYERS)
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # depth 3 with KVShare and without, then depth 1 with it and without
    settings = [LossWeights(mtp_depth=3, kv_share=True, tv=0.5), LossWeights(mtp_depth=3, kv_share=False, tv=0.5),
                LossWeights(kv_share=True), LossWeights(kv_share=False)]

    @jax.jit
    def every_setting(params):          # one program for the four
        model = nnx.merge(graphdef, params, rest)
        options = ForwardOptions(mode=stage, form="expanded")
        return [loss_terms(model, inputs, targets, options=options, weights=w) for w in settings]

    deep_share, deep_own, one_share, one_own = every_setting(params)
    for total, terms in (deep_share, deep_own):
        assert np.isfinite(float(total)) and 0 <= float(terms["mtp_tv"]) <= 1
    assert float(deep_share[1]["mtp"]) != pytest.approx(float(deep_own[1]["mtp"]), rel=1e-6)
    # depth 1 alone does not depend on the KVShare switch
    assert float(one_share[1]["mtp"]) == float(one_own[1]["mtp"])


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
        return selected_set_kl(acc, idx_q=iq, idx_keys=ik, idx_w=iw, indices=idx)

    def per_layer(iq, ik, iw):
        scores = pk.indexer_scores(iq, ik, iw, q_pos=pos, kv_len=n, impl="reference")
        total = 0.0
        for q, latent in zip(qs, latents):
            logits = jnp.where(mask[:, None], jnp.einsum("bshd,btd->bhst", q, latent) * scale, -jnp.inf)
            probs = jnp.where(mask[:, None], jax.nn.softmax(logits, -1), 0.0).sum(1)
            target = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
            total = total + indexer_kl(target, scores, mask) / layers
        return total

    both = jax.jit(lambda *x: [jax.value_and_grad(f, (0, 1, 2))(*x) for f in (grouped, per_layer)])   # one program
    (got, got_grads), (want, want_grads) = both(iq, ik, iw)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_long_sequence_forms_equal_the_expanded_form():
    """The forms that hold no [S, T] matrices (dense: fused causal attention; sparse: sparse MLA
    with the chunked selected-set KL) give the expanded form's logits, KL and KL gradients."""
    cfg, graphdef, params, rest = _micro_parts(**TWO_LAYERS)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    run = lambda m, **kw: m(tokens, options=ForwardOptions(**kw))
    dense_logits = jax.jit(lambda params: [run(nnx.merge(graphdef, params, rest), mode="dense", form=form).logits
                                           for form in ("absorbed", "expanded")])
    np.testing.assert_allclose(*dense_logits(params), atol=2e-5)

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


@pytest.mark.parametrize("stage,form", [("sparse", "absorbed"), ("dense", "expanded")])
def test_remat_keeps_the_loss_and_gradients(stage, form):
    """Per-layer rematerialisation (only each layer's input and the top-k kept) changes memory,
    not results: the compiled step's temporaries shrink (XLA may not merge the recomputed layer
    with the original one, which would keep every activation alive again)."""
    cfg, graphdef, params, rest = _micro_parts(num_hidden_layers=3, index_topk_pattern="FSF")   # 2 groups, MTP
    tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, cfg.vocab_size)

    def loss(params, remat):
        model = nnx.merge(graphdef, params, rest)
        return loss_terms(model, tokens[:, :-1], tokens[:, 1:], weights=LossWeights(indexer=1.0),
                          options=ForwardOptions(mode=stage, form=form, remat=remat))[0]

    compiled = [jax.jit(jax.value_and_grad(loss), static_argnums=1).lower(params, r).compile() for r in (False, True)]
    temps = [c.memory_analysis().temp_size_in_bytes for c in compiled]
    assert temps[1] < 0.6 * temps[0], temps
    (plain, g_plain), (remat, g_remat) = (c(params) for c in compiled)
    assert float(remat) == pytest.approx(float(plain), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def _sorts(jaxpr) -> int:
    """Sort ops in a jaxpr and the jaxprs nested in its equations."""
    return sum(eqn.primitive.name == "sort" for eqn in jaxpr_equations(jaxpr))


def test_sparse_attention_backward_index_is_sorted_once_per_group():
    """The Pallas sparse-MLA backward's transposed index is built by each IndexShare group's Full
    layer and reused by its Shared layers: one sort per group (2 in the stack, 1 in MTP), not one
    per layer (6), beyond the sorts of the XLA path (which takes no index)."""
    cfg, graphdef, params, rest = _micro_parts()          # FSSFS: groups of 3 and 2 layers, one MTP layer
    tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, cfg.vocab_size)

    def sorts(attention):
        def loss(params):
            model = nnx.merge(graphdef, params, rest)
            config = pk.SparseMLAGpuConfig(dkv_mode="sorted") if attention == "pallas_gpu" else None
            kernels = ops.KernelChoice(sparse_mla=(attention, config), interpret=attention != "xla")
            return loss_terms(model, tokens[:, :-1], tokens[:, 1:], weights=LossWeights(indexer=1.0),
                              options=ForwardOptions(mode="sparse", form="absorbed", kernels=kernels))[0]
        return _sorts(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)

    assert sorts("pallas_gpu") - sorts("xla") == 3


def test_the_group_builds_the_backward_index_its_kernel_will_use():
    """With the queries' heads and value width, a group's Full layer builds the index of the
    backward "auto" resolves to at this shape ("by_key": the key bitmap, shared by the group's
    layers; the kernel tests check gradients with a prebuilt bitmap), not the sorted mode's."""
    from pallas_kernels.sparse_mla.transpose import KeyBitmap, TransposedIndex

    cfg, graphdef, params, rest = _micro_parts()
    attn = nnx.merge(graphdef, params, rest).stacks[0].layers[0].self_attn
    indices = jax.random.randint(jax.random.key(6), (2, 16, cfg.index_topk), 0, 16)
    gpu = ops.KernelChoice(sparse_mla="pallas_gpu", interpret=True)
    assert isinstance(attn.backward_index(indices, 16, jnp.float32, ForwardOptions(kernels=gpu)), KeyBitmap)
    sorted_mode = gpu.replace(sparse_mla=("pallas_gpu", pk.SparseMLAGpuConfig(dkv_mode="sorted")))
    assert isinstance(attn.backward_index(indices, 16, jnp.float32, ForwardOptions(kernels=sorted_mode)), TransposedIndex)


def _forward_kernel_calls(jaxpr) -> int:
    """Calls of the Pallas sparse-MLA forward kernel in a jaxpr and the jaxprs nested in it."""
    return sum(eqn.primitive.name == "pallas_call"
               and "sparse_mla_fwd" in str(eqn.params.get("name") or eqn.params.get("name_and_src_info"))
               for eqn in jaxpr_equations(jaxpr))


def test_keep_attention_runs_the_sparse_forward_kernel_once_a_layer():
    """With remat, keep_attention saves the sparse attention's outputs: the forward kernel is not
    run again in the backward pass, and the loss and gradients are those of the plain remat (up
    to float32 rounding)."""
    cfg, graphdef, params, rest = _micro_parts(**TWO_LAYERS)     # and one MTP layer
    tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, cfg.vocab_size)
    kernels = ops.KernelChoice(sparse_mla="pallas_gpu", interpret=True)

    def loss(params, keep):
        model = nnx.merge(graphdef, params, rest)
        options = ForwardOptions(mode="sparse", form="absorbed", kernels=kernels, remat=True, keep_attention=keep)
        return loss_terms(model, tokens[:, :-1], tokens[:, 1:], weights=LossWeights(indexer=1.0), options=options)[0]

    traced = [jax.jit(jax.value_and_grad(loss), static_argnums=1).trace(params, keep) for keep in (False, True)]
    calls = [_forward_kernel_calls(t.jaxpr.jaxpr) for t in traced]
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert calls == [2 * layers, layers], calls
    (plain, g_plain), (kept, g_kept) = (t.lower().compile()(params) for t in traced)
    assert float(kept) == float(plain)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_kept), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)      # XLA fuses the two programs differently


def test_keep_attention_needs_remat():
    from glm_jax.settings import SettingError
    from glm_jax.training.run_config import KernelsConfig

    with pytest.raises(SettingError, match="--remat"):
        KernelsConfig(keep_attention=True)
    assert KernelsConfig(remat=True, keep_attention=True).keep_attention


def test_the_step_config_holds_the_forward_options_whole():
    """StepConfig holds the model call's ForwardOptions as one field: `of` builds it from a run's
    settings, `with_forward` changes some of its fields (the loop's stage and segment bound), and
    its indexer_loss follows the loss weights as `loss_terms` sets it."""
    from glm_jax.training.run_config import KernelsConfig, TrainConfig
    from glm_jax.training.step import OptimizerConfig, StepConfig

    settings = TrainConfig(out="r", kernels=KernelsConfig(remat=True, keep_attention=True, attention_form="absorbed"))
    config = StepConfig.of(settings, stage="dense")
    assert config.forward == ForwardOptions(mode="dense", form="absorbed", remat=True, keep_attention=True,
                                            indexer_loss=config.weights.indexer > 0)
    step = config.with_forward(mode="sparse", max_segments=4)
    assert (step.forward.mode, step.forward.max_segments, step.forward.remat) == ("sparse", 4, True)
    assert step.optimizer == config.optimizer and step.weights == config.weights and hash(step) != hash(config)
    plain = StepConfig(OptimizerConfig(1e-3, 10, 2), forward=ForwardOptions(), weights=LossWeights(indexer=0.0))
    assert not plain.forward.indexer_loss
    assert StepConfig(plain.optimizer, forward=ForwardOptions(), weights=LossWeights(indexer=1.0)).forward.indexer_loss
    with pytest.raises(TypeError, match=r"StepConfig: forward must be a ForwardOptions .*got str 'sparse'"):
        StepConfig(plain.optimizer, forward="sparse")
    with pytest.raises(TypeError, match="positional argument"):
        ForwardOptions("sparse")
