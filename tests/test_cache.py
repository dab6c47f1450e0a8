"""The cache package: a group's view writes through the page table into its own slots and goes
back into the cache; the view's top-k over its cached keys is the indexer's over the sequence;
decode through a paged cache, whose kernels read the store through the page table, gives the
full forward's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm_jax import ops
from glm_jax.cache import create_cache, create_paged_cache
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.indexer import Indexer
from glm_jax.model import GLMModel
from jitted_calls import forward_cached, forward_logits


def test_group_view_writes_its_slots_through_the_page_table(micro_cfg):
    # FSSFS: the group of layers 3, 4 has Full layer number 1; pages of 2 rows, 2 pages a sequence
    cfg, b, s = micro_cfg, 2, 2
    table = jnp.array([[3, 1], [2, 4]], jnp.int32)
    cache = create_paged_cache(cfg, 5, 2, table).advance(jnp.array([1, 2], jnp.int32))
    positions = cache.positions(s)
    np.testing.assert_array_equal(positions, [[1, 2], [2, 3]])

    latent = jax.random.normal(jax.random.key(0), (b, s, cfg.latent_dim))
    keys = jax.random.normal(jax.random.key(1), (b, s, cfg.index_head_dim))
    view = cache.group_view(3, 1, positions)
    view.write_latent(1, latent)
    view.write_index_keys(keys)
    written = cache.with_view(view)

    want_latent = np.zeros(cache.latent.shape, np.float32)
    want_keys = np.zeros(cache.index_keys.shape, np.float32)
    for i in range(b):
        for j in range(s):
            t = int(positions[i, j])
            page, offset = int(table[i, t // 2]), t % 2
            want_latent[4, page, offset] = latent[i, j]
            want_keys[1, page, offset] = keys[i, j]
    np.testing.assert_array_equal(written.latent, want_latent)
    np.testing.assert_array_equal(written.index_keys, want_keys)
    np.testing.assert_array_equal(written.lengths, cache.lengths)       # the caller advances them

    rows = view.read_latent(1)                                            # [B, 4, latent], in order
    assert rows.shape == (b, 4, cfg.latent_dim)
    for i in range(b):
        np.testing.assert_array_equal(rows[i, positions[i]], latent[i])
    np.testing.assert_array_equal(written.advance(s).lengths, [3, 4])


def test_view_select_equals_the_indexer_over_the_sequence(micro_cfg):
    cfg, b, s = micro_cfg, 2, 8
    indexer = Indexer(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    h = jax.random.normal(jax.random.key(2), (b, s, cfg.hidden_size))
    q_resid = jax.random.normal(jax.random.key(3), (b, s, cfg.q_lora_rank))
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    keys = indexer.keys(h, positions)
    kernels = ops.KernelChoice()
    want = indexer.select(h, q_resid, positions, keys, jnp.full((b,), s, jnp.int32), ForwardOptions(kernels=kernels))

    for cache in (create_cache(cfg, b, s),                                         # contiguous
                  create_paged_cache(cfg, 5, 4, jnp.array([[4, 1], [2, 3]], jnp.int32))):   # paged
        view = cache.group_view(0, 0, cache.positions(s), kernels)
        view.write_index_keys(keys)
        got = view.select(indexer.queries(q_resid, positions), indexer.head_weights(h), topk=cfg.index_topk)
        assert got.shape == (b, s, cfg.index_topk)
        np.testing.assert_array_equal(got, want)
    assert int(jnp.max(want)) > cfg.index_topk          # a real selection, not every row


def test_paged_decode_equals_full_forward(micro_cfg):
    """A cache of shuffled pages (2 rows each, interleaved between the sequences, the pool's
    scratch page 0 unused): a prefill chunk of 3 tokens (3 x top-4 < 16 rows: "paged" mode, the
    kernels read the chunk's own rows back from the store through the page table) gives the
    full forward's logits, and so does the next decode step with the Pallas GPU kernels
    (interpreted)."""
    model = GLMModel(micro_cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 4), 0, micro_cfg.vocab_size, jnp.int32)
    full = forward_logits(model, tokens)
    table = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, 18))[:16].reshape(2, 8), jnp.int32)
    cache = create_paged_cache(micro_cfg, 18, 2, table)
    prefill, _, cache = forward_cached(model, tokens[:, :3], cache)
    np.testing.assert_allclose(prefill, full[:, :3], atol=2e-4, rtol=1e-4)
    assert not np.asarray(cache.latent[:, 0]).any()                  # page 0 is nobody's

    pallas = ops.KernelChoice(indexer_topk="pallas_gpu", sparse_mla="pallas_gpu", interpret=True)
    step, _, _ = forward_cached(model, tokens[:, 3:4], cache, options=ForwardOptions(kernels=pallas))
    np.testing.assert_allclose(step, full[:, 3:4], atol=2e-4, rtol=1e-4)
