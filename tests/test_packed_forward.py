"""Packed rows: two documents in one row give each document's own logits, losses and indexer KL."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.segments import count_segments, same_segment_ahead, segment_layout, segment_table
from glm_jax.model import GLMModel
from glm_jax.training.losses import cross_entropy
from glm_jax.training.step import LossWeights, loss_terms

from conftest import micro_config

LENS = (8, 8)  # equal lengths: the documents alone run as one batch


@functools.partial(jax.jit, static_argnames=("graphdef", "options"))
def _forward(graphdef, state, inputs, targets, segment_ids, *, options):
    """-> (per-token CE [B, S], MTP depth-1 per-token CE [B, S], indexer KL, MTP indexer KL)."""
    model = nnx.merge(graphdef, state)
    out = model(inputs, options=options, segment_ids=segment_ids)
    mtp, _ = model.mtp_forward(out.hidden, targets, options=options, segment_ids=segment_ids)
    next_targets = jnp.concatenate([targets[:, 1:], targets[:, :1]], axis=1)
    per_token = lambda logits, y: jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[..., None], -1)[..., 0]
    return per_token(out.logits, targets), per_token(mtp.logits, next_targets), out.indexer_kl, mtp.indexer_kl


@pytest.fixture(scope="module")
def model_and_docs():
    cfg = micro_config(index_topk=3, num_hidden_layers=2, index_topk_pattern="FS")   # one IndexShare group
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, cfg.vocab_size, n + 1).astype(np.int32) for n in LENS]
    return model, docs


@pytest.mark.parametrize("mode,form", [("dense", "expanded"), ("sparse", "expanded"), ("sparse", "absorbed"),
                                       ("dense", "absorbed")])
def test_packed_row_equals_documents_alone(model_and_docs, mode, form):
    model, docs = model_and_docs
    options = ForwardOptions(mode=mode, form=form, indexer_loss=(mode, form) != ("dense", "absorbed"))
    graphdef, state = nnx.split(model)
    inputs = np.concatenate([d[:-1] for d in docs])[None]
    targets = np.concatenate([d[1:] for d in docs])[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(LENS)]).astype(np.int32)[None]
    packed = _forward(graphdef, state, inputs, targets, segments, options=options)
    alone = _forward(graphdef, state, np.stack([d[:-1] for d in docs]), np.stack([d[1:] for d in docs]), None,
                     options=options)
    for i, n in enumerate(LENS):
        start = sum(LENS[:i])
        np.testing.assert_allclose(packed[0][0, start:start + n], alone[0][i], rtol=1e-5, atol=1e-5)
        # MTP depth 1 predicts the target one further: defined for all but the document's last token
        np.testing.assert_allclose(packed[1][0, start:start + n - 1], alone[1][i, :n - 1], rtol=1e-5, atol=1e-5)
    # the KL is summed over queries and averaged over rows: one packed row holds both documents
    np.testing.assert_allclose(packed[2], len(LENS) * alone[2], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(packed[3], len(LENS) * alone[3], rtol=1e-4, atol=1e-6)


def test_segment_layout_and_masks():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    positions, kv_start = segment_layout(seg)
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 0, 1], list(range(7))])
    np.testing.assert_array_equal(kv_start, [[0, 0, 0, 3, 3, 5, 5], [0] * 7])
    np.testing.assert_array_equal(same_segment_ahead(seg, 1)[0], [1, 1, 0, 1, 0, 0, 0])


def test_segment_table_lists_each_segment():
    seg = np.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4]])
    positions, _ = segment_layout(jnp.asarray(seg))
    table = segment_table(positions, 5)
    np.testing.assert_array_equal(table.offsets, [[0, 3, 5, 6, -1, -1], [0, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(table.lengths, [[3, 2, 1, 2, -1], [8, -1, -1, -1, -1]])
    assert count_segments(seg) == 4


def test_padding_has_no_loss(model_and_docs):
    """The packed LM loss is the mean over real tokens: padding targets change nothing."""
    model, docs = model_and_docs
    inputs = np.concatenate([docs[0][:-1], np.zeros(3, np.int32)])[None]
    seg = np.concatenate([np.ones(LENS[0]), np.zeros(3)]).astype(np.int32)[None]
    weights = LossWeights(indexer=0.0, mtp=0.0)
    graphdef, state = nnx.split(model)

    @jax.jit
    def padded_and_alone(state):        # one program: the packed LM loss for two fills, the document alone
        model = nnx.merge(graphdef, state)
        padded = [loss_terms(model, inputs, np.concatenate([docs[0][1:], np.full(3, fill, np.int32)])[None],
                             options=ForwardOptions(mode="dense", form="expanded"), weights=weights,
                             segment_ids=seg)[1]["lm"] for fill in (0, 5)]
        out = model(docs[0][None, :-1], options=ForwardOptions(mode="dense", form="expanded"))
        return padded, cross_entropy(out.logits, docs[0][None, 1:])

    losses, alone = padded_and_alone(state)
    assert float(losses[0]) == float(losses[1])
    np.testing.assert_allclose(float(losses[0]), float(alone), rtol=1e-5)
