"""The dense warm-up's indexer KL in the absorbed form (`glm_jax.layers.dense_indexer_kl` over
`pallas_kernels.dense_indexer_kl`): blockwise, equal in value and gradients to the expanded
form's per-layer KL on [S, T] matrices. (The op's contract, every implementation against a
numpy oracle: test_kernel_contract.py.) At the end: the Pallas GPU kernels outside the package
(lab/dense_indexer_kl_gpu.py), against the same expanded form and contract."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels as pk
from conftest import jaxpr_equations, micro_config
from kernel_contract import check_dense_indexer_kl, dense_indexer_kl_inputs
from glm_jax import ops
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.decoder import head_summed_target, _Rows, indexer_kl
from glm_jax.layers.dense_indexer_kl import DenseTarget, dense_group_kl
from glm_jax.layers.segments import segment_layout
from glm_jax.model import GLMModel
from glm_jax.training.step import LossWeights, loss_terms
from lab import dense_indexer_kl_gpu_vjp as lab_kl
from lab.dense_indexer_kl_gpu import DenseIndexerKLGpuConfig

B, S, H, LATENT, ROPE, HI, DI, SCALE = 2, 64, 4, 32, 16, 2, 16, 0.2


def _case(layers: int, packed: bool, seed: int = 0):
    """Random layers' absorbed queries and latent rows, indexer inputs and a row layout: row 1
    has kv_len < S; packed: 3 documents in row 0, 2 in row 1."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    targets = [DenseTarget(f32(B, S, H, LATENT + ROPE), f32(B, S, LATENT + ROPE)) for _ in range(layers)]
    idx = (f32(B, S, HI, DI), f32(B, S, DI), jnp.asarray(rng.random((B, S, HI)), jnp.float32))
    kv_len = jnp.asarray([S, S - 9], jnp.int32)
    if packed:
        segments = jnp.asarray([[1] * 20 + [2] * 27 + [3] * 17, [1] * 40 + [2] * 24], jnp.int32)
        positions, kv_start = segment_layout(segments)
    else:
        positions, kv_start = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)), None
    return targets, idx, _Rows(S, positions, kv_len, kv_start)


def _expanded_kl(targets, idx_q, idx_keys, idx_w, rows: _Rows):
    """The expanded form: per layer the [B, H, S, T] probabilities, their head-summed target and
    `indexer_kl` against the indexer's [B, S, T] scores, weighted 1 / layers."""
    mask = rows.causal()
    q_rows = jnp.broadcast_to(jnp.arange(rows.length, dtype=jnp.int32), idx_q.shape[:2])
    scores = pk.indexer_scores(idx_q, idx_keys, idx_w, q_pos=q_rows, kv_len=rows.kv_len, kv_start=rows.kv_start,
                               impl="reference")
    total = 0.0
    for t in targets:
        logits = jnp.einsum("bshd,btd->bhst", t.q, t.latent) * SCALE
        probs = jnp.where(mask[:, None], jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), -1), 0.0)
        total = total + indexer_kl(head_summed_target(probs), scores, mask) / len(targets)
    return total


def _fused_kl(targets, idx_q, idx_keys, idx_w, rows: _Rows, block: int):
    return dense_group_kl(targets, idx_q=idx_q, idx_keys=idx_keys, idx_w=idx_w, sm_scale=SCALE, kv_len=rows.kv_len,
                          kv_start=rows.kv_start,
                          options=ForwardOptions(kernels=ops.KernelChoice(
                              dense_indexer_kl=("xla", pk.DenseIndexerKLXlaConfig(block)))))


@pytest.mark.parametrize("layers,packed,block", [(3, False, 16), (2, False, 24), (3, True, 16), (2, True, 64)])
def test_fused_dense_kl_equals_the_expanded_form(layers, packed, block):
    """Value and gradients into the indexer's queries, keys and weights, for blocks that divide
    S and one that does not (24), packed rows or not; the attention side gets no gradient."""
    targets, idx, rows = _case(layers, packed)
    fused = functools.partial(_fused_kl, rows=rows, block=block)
    expanded = functools.partial(_expanded_kl, rows=rows)
    both = jax.jit(lambda *x: [jax.value_and_grad(f, (1, 2, 3))(*x) for f in (fused, expanded)])   # one program
    (got, got_grads), (want, want_grads) = both(targets, *idx)
    assert float(want) > 1.0
    np.testing.assert_allclose(got, want, rtol=2e-6)
    for name, g, w in zip(("queries", "keys", "weights"), got_grads, want_grads):
        assert float(np.abs(w).max()) > 1e-3, name
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6 * float(np.abs(w).max()), err_msg=name)
    assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(jax.grad(fused)(targets, *idx)))


def _check_small_tiles(impl, config):
    """The op's contract (test_kernel_contract.py) with tiles of 16: several query and key blocks,
    the last one padded."""
    *arrays, kv_len, kv_start = dense_indexer_kl_inputs(4)
    check_dense_indexer_kl(impl, *arrays, sm_scale=0.2, kv_len=kv_len, kv_start=kv_start, shares=(0.5, 0.5),
                           config=config)


def test_small_tiles_match_the_contract():
    _check_small_tiles("xla", pk.DenseIndexerKLXlaConfig(block=16))


def test_shares_weigh_the_layers():
    """Unequal shares: the fused KL is the shares' weighted sum of the layers' single-layer KLs."""
    targets, idx, rows = _case(2, packed=True, seed=1)
    single = [_fused_kl([t], *idx, rows, block=16) for t in targets]
    got = dense_group_kl(targets, idx_q=idx[0], idx_keys=idx[1], idx_w=idx[2], sm_scale=SCALE, kv_len=rows.kv_len,
                         kv_start=rows.kv_start, shares=(0.25, 0.75),
                         options=ForwardOptions(kernels=ops.KernelChoice(
                             dense_indexer_kl=("xla", pk.DenseIndexerKLXlaConfig(block=16)))))
    np.testing.assert_allclose(got, 0.25 * single[0] + 0.75 * single[1], rtol=2e-6)


def _sequence_squared(jaxpr) -> list:
    """The shapes of values (in jaxpr, nested ones included) with two axes of at least S."""
    shapes = {tuple(v.aval.shape) for eqn in jaxpr_equations(jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape")}
    return [shape for shape in shapes if sum(n >= S for n in shape) >= 2]


def test_no_sequence_squared_array_forward_or_backward():
    """Forward and backward hold [B, block, H, block] tiles, never a value with a query and a
    key axis of length S."""
    targets, idx, rows = _case(3, packed=True)
    grad = lambda fn: jax.make_jaxpr(jax.grad(fn, (1, 2, 3)))(targets, *idx).jaxpr
    assert _sequence_squared(grad(functools.partial(_fused_kl, rows=rows, block=16))) == []
    assert _sequence_squared(grad(functools.partial(_expanded_kl, rows=rows)))   # the check sees [S, T]


# ---------------------------------------------------------------------- in the model
def _micro_model():
    """The micro config's model (conftest.py: MoE, the MTP layer) cut to 3 layers in IndexShare
    groups of 1 and 2 -> (its vocabulary size, graphdef, params, the rest of its state)."""
    cfg = micro_config(num_hidden_layers=3, index_topk_pattern="FFS")
    return (cfg.vocab_size, *nnx.split(GLMModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...))


@pytest.mark.parametrize("packed,remat", [(True, True)])     # the plain causal case: the tests above
def test_loss_terms_dense_stage_absorbed_equals_expanded(packed, remat):
    """`loss_terms` with stage="dense" on the micro config: the absorbed form (fused causal
    attention, blockwise KL over tiles of 8) gives the expanded form's indexer KL terms (the
    decoder's groups and the MTP layer's) and the same gradients, the indexer's included."""
    vocab, graphdef, params, rest = _micro_model()
    tokens = jax.random.randint(jax.random.key(3), (2, 21), 0, vocab)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    segments = jnp.asarray([[1] * 7 + [2] * 9 + [3] * 4, [1] * 12 + [2] * 8], jnp.int32) if packed else None
    weights = LossWeights(indexer=1.0, mtp=0.3, mtp_depth=2)

    def loss(params, form):
        kernels = ops.KernelChoice(dense_indexer_kl=("xla", pk.DenseIndexerKLXlaConfig(block=8)))
        options = ForwardOptions(mode="dense", form=form, kernels=kernels, remat=remat and form == "absorbed")
        return loss_terms(nnx.merge(graphdef, params, rest), inputs, targets, options=options, weights=weights,
                          segment_ids=segments)

    both = jax.jit(lambda params: [jax.value_and_grad(loss, has_aux=True)(params, form)        # one program
                                   for form in ("absorbed", "expanded")])
    ((_, got), got_grads), ((_, want), want_grads) = both(params)
    for name in ("indexer_kl", "mtp_indexer_kl", "loss"):
        assert float(want[name]) > 0.01, name
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, err_msg=name)
    indexer_grads = 0
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads), strict=True):
        name = jax.tree_util.keystr(path)
        indexer_grads += "indexer" in name and float(np.abs(w).max()) > 0
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5 * max(float(np.abs(w).max()), 1e-3), err_msg=name)
    assert indexer_grads >= 8        # wq_b, wk, k_norm, weights_proj of the stacked groups and MTP


# ---------------------------------------------------------------------- the lab's Pallas GPU kernels
# lab/dense_indexer_kl_gpu.py (outside the package: measured slower than xla forward + backward),
# run through the public op while `registered()` makes it an impl.
@pytest.mark.parametrize("packed", [False, True])
def test_pallas_kernels_equal_the_expanded_form(packed):
    """The lab's Pallas GPU forward and backward kernels, selected as a train step selects them
    (registered; interpret mode; tiles of 16, S = 40 padded
    to 48, widths 48 = 32 + 16 columns): the expanded form's value and gradients (the keys'
    gradient from the kernel over key blocks, the others from the one over query blocks)."""
    targets, idx, rows = _case(2, packed, seed=2)
    s = 40
    targets = [DenseTarget(t.q[:, :s], t.latent[:, :s]) for t in targets]
    idx = tuple(x[:, :s] for x in idx)
    rows = _Rows(s, rows.positions[:, :s], jnp.minimum(rows.kv_len, s - 3), None if rows.kv_start is None
                 else rows.kv_start[:, :s])

    def fused(targets, *idx):
        kernels = ops.KernelChoice(dense_indexer_kl=(lab_kl.IMPL, DenseIndexerKLGpuConfig(block=16)), interpret=True)
        return dense_group_kl(targets, idx_q=idx[0], idx_keys=idx[1], idx_w=idx[2], sm_scale=SCALE,
                              kv_len=rows.kv_len, kv_start=rows.kv_start, options=ForwardOptions(kernels=kernels))

    expanded = functools.partial(_expanded_kl, rows=rows)
    with lab_kl.registered():       # one program for both forms
        both = jax.jit(lambda *x: [jax.value_and_grad(f, (1, 2, 3))(*x) for f in (fused, expanded)])
        (got, got_grads), (want, want_grads) = both(targets, *idx)
    assert float(want) > 1.0
    np.testing.assert_allclose(got, want, rtol=2e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-6 * float(np.abs(w).max()))


def test_lab_pallas_kernels_match_the_contract():
    with lab_kl.registered():
        _check_small_tiles(lab_kl.IMPL, DenseIndexerKLGpuConfig(block=16))


def test_lab_registration_ends_with_its_block():
    """The registry holds the lab's impl only inside `registered()`, and refuses it twice."""
    with lab_kl.registered():
        assert pk.impl_choices("dense_indexer_kl") == ("auto", "reference", "xla", lab_kl.IMPL)
        assert pk.resolve_impl("dense_indexer_kl", "auto") == "xla"
        with pytest.raises(RuntimeError, match="already has"), lab_kl.registered():
            pass
    assert pk.impl_choices("dense_indexer_kl") == ("auto", "reference", "xla")
    with pytest.raises(ValueError, match="dense_indexer_kl='pallas_gpu': valid choices"):
        ops.KernelChoice(dense_indexer_kl=lab_kl.IMPL)


def test_pallas_kernels_lower_to_triton_for_h100():
    """The forward and backward kernels at the default model's widths (4 layers of 8 heads over
    160-wide latent rows, 8 indexer heads of 64, tiles of 64), lowered to Triton for an H100."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
    s = jax.ShapeDtypeStruct
    batch, seq = 2, 512
    qs = tuple(s((batch, seq, 8, 160), jnp.bfloat16) for _ in range(4))
    latents = tuple(s((batch, seq, 160), jnp.bfloat16) for _ in range(4))
    idx = (s((batch, seq, 8, 64), jnp.bfloat16), s((batch, seq, 64), jnp.bfloat16), s((batch, seq, 8), jnp.float32))

    def kl(qs, latents, iq, ik, iw):
        rows = pk.dense_indexer_kl(qs, latents, iq, ik, iw, sm_scale=SCALE, kv_len=jnp.full((batch,), seq, jnp.int32),
                                   impl=lab_kl.IMPL, config=DenseIndexerKLGpuConfig(block=64))
        return jnp.sum(rows)

    with jax.sharding.use_abstract_mesh(mesh), lab_kl.registered():
        for fn, kernels in ((kl, 1), (jax.grad(kl, argnums=(2, 3, 4)), 3)):
            text = jax.jit(fn).trace(qs, latents, *idx).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == kernels


def test_auto_block_grows_the_tile_at_long_lengths_within_its_memory():
    from pallas_kernels.dense_indexer_kl.xla import auto_block

    assert auto_block(4096, 16, 8) == 512                   # the default recipe's rows
    assert auto_block(131072, 1, 8) == 2048                 # the default model at 128K: 64 query blocks
    assert auto_block(65536, 1, 64) == 1024                 # GLM-5.2's attention shape at 64K
    assert auto_block(1 << 20, 1, 1024) == 512              # a doubled tile would pass MAX_TILE_BYTES
    assert auto_block(100, 1, 8) == 512                     # capped at S by the op
