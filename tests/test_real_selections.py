"""benchmarks/_selections.py (real_selections.py's): the trained default model's indexer selections, and their cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks import _selections
from benchmarks._selections import cache_path, full_layer_indices, heldout_tokens, trained_selections
from glm_jax.checkpoint import load_model_dir
from glm_jax.data.tokenizer import load_tokenizer

CHECKPOINT = "checkpoints/default"


def test_selections_are_causal_distinct_padded_deterministic_and_cached(tmp_path, monkeypatch):
    seq_len, topk = 512, 64
    idx = trained_selections(seq_len, topk=topk, checkpoint=CHECKPOINT, batch=2, cache_dir=tmp_path / "a")
    assert idx.dtype == np.int32 and idx.shape == (2, seq_len, topk)
    query = np.arange(seq_len)[None, :, None]
    valid = idx >= 0
    assert (valid == (np.arange(topk) < np.minimum(topk, query + 1))).all()     # min(K, s + 1), then -1
    assert (np.where(valid, idx, 0) <= query).all()                              # keys t <= s
    ordered = np.sort(idx, axis=-1)
    assert not ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()   # distinct
    assert not np.array_equal(idx[0], idx[1])                                    # two rows of text

    again = trained_selections(seq_len, topk=topk, checkpoint=CHECKPOINT, batch=2, cache_dir=tmp_path / "b")
    assert np.array_equal(idx, again)
    path = cache_path(tmp_path / "a", CHECKPOINT, seq_len, topk, 0, 0, 2)
    assert path.name == "default_s512_k64_g0_seed0_b2.npy" and path.exists()
    assert cache_path("runs/real_selections", CHECKPOINT, seq_len, topk, 1, 3, 1).as_posix() == \
        "runs/real_selections/default_s512_k64_g1_seed3.npy"

    def no_model_run(*args, **kwargs):
        raise AssertionError("a cached selection was computed again")

    monkeypatch.setattr(_selections, "select_group", no_model_run)
    loaded = trained_selections(seq_len, topk=topk, checkpoint=CHECKPOINT, batch=2, cache_dir=tmp_path / "a")
    assert loaded.dtype == np.int32 and np.array_equal(idx, loaded)


def test_native_topk_is_the_models_own_selection(tmp_path):
    """At the model's own top-k, the second group's selections (after the first group's layers)
    are those of the model's forward."""
    model = load_model_dir(CHECKPOINT, dtype="float32")
    seq_len = 2 * model.cfg.index_topk
    tokens = heldout_tokens(load_tokenizer(CHECKPOINT), 1, seq_len, 0)
    indices = full_layer_indices(model, jnp.asarray(tokens))[1]
    mine = trained_selections(seq_len, topk=model.cfg.index_topk, checkpoint=CHECKPOINT, group=1,
                              cache_dir=tmp_path)
    assert np.array_equal(mine, indices)
