"""Speculative decoding: exact rejection sampling, greedy equivalence, KVShare semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax import ops
from glm_jax.cache import create_cache, create_mtp_cache
from glm_jax.decoding import GREEDY, rejection_sample
from glm_jax.decoding.rejection import match_sample
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.speculative import SpeculativeGenerator, draft
from glm_jax.forward_options import ForwardOptions
from glm_jax.model import GLMModel
from conftest import in_own_process, micro_config

DRAWS = 40_000
# Total-variation distance between the empirical and the target distribution: with 40k draws
# over 6 tokens its standard deviation is ~0.005, so 0.02 is a >4-sigma bound.
TV_TOL = 0.02


def _random_dist(key, shape, zero_fraction):
    k1, k2 = jax.random.split(key)
    w = jax.random.exponential(k1, shape)
    w = jnp.where(jax.random.uniform(k2, shape) < zero_fraction, 0.0, w)
    w = w.at[..., 0].add(1e-3 * (jnp.sum(w, -1) == 0))      # never an all-zero row
    return w / jnp.sum(w, -1, keepdims=True)


@pytest.mark.parametrize("rule,seed", [("rejection", 0), ("rejection", 1), ("rejection", 2), ("match", 0)])
def test_emitted_tokens_follow_the_target(rule, seed):
    k, v = 2, 6
    kp, kq, kd, ks = jax.random.split(jax.random.key(seed), 4)
    p = _random_dist(kp, (1, k + 1, v), 0.3)      # zeros where q may be positive ...
    q = _random_dist(kq, (1, k, v), 0.3)          # ... and zeros where p is positive
    keys = jax.random.split(ks, DRAWS)
    dkeys = jax.random.split(kd, DRAWS)

    def one(dkey, key):
        drafts = jax.random.categorical(dkey, jnp.log(q[0]), axis=-1).astype(jnp.int32)[None]
        return rejection_sample(p, q, drafts, key) if rule == "rejection" else match_sample(p, drafts, key)

    tokens, accepted = jax.vmap(one)(dkeys, keys)
    tokens, accepted = np.asarray(tokens)[:, 0], np.asarray(accepted)[:, 0]
    assert ((tokens >= 0).sum(1) == accepted + 1).all()
    for pos in range(k + 1):
        seen = tokens[:, pos][tokens[:, pos] >= 0]
        if seen.size < 2000:
            continue
        freq = np.bincount(seen, minlength=v) / seen.size
        tv = 0.5 * np.abs(freq - np.asarray(p[0, pos])).sum()
        assert tv < TV_TOL, (pos, tv, freq, np.asarray(p[0, pos]))
    # acceptance of the first draft: sum min(p, q) (rejection sampling), sum p q (the base rule)
    want = float(jnp.sum(jnp.minimum(p[0, 0], q[0, 0]) if rule == "rejection" else p[0, 0] * q[0, 0]))
    assert abs(np.mean(accepted >= 1) - want) < 0.015


def test_rejection_sample_greedy_and_shapes():
    v = 5
    p = jax.nn.one_hot(jnp.array([[1, 2, 3]]), v)
    q = jax.nn.one_hot(jnp.array([[1, 4]]), v)
    tokens, n = rejection_sample(p, q, jnp.array([[1, 4]], jnp.int32), jax.random.key(0))
    assert tokens.tolist() == [[1, 2, -1]] and n.tolist() == [1]
    tokens, n = rejection_sample(p, p[:, :2], jnp.array([[1, 2]], jnp.int32), jax.random.key(0))
    assert tokens.tolist() == [[1, 2, 3]] and n.tolist() == [2]
    with pytest.raises(ValueError, match="K\\+1"):
        rejection_sample(p[:, :2], q, jnp.array([[1, 4]], jnp.int32), jax.random.key(0))


@pytest.fixture(scope="module")
def model() -> GLMModel:
    """The micro config's model (seed 0), shared by the tests that only read it."""
    return GLMModel(micro_config(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kv_share", [True, False])
def test_greedy_speculative_equals_greedy_plain(model, kv_share):
    cfg = model.cfg
    prompts = np.stack([np.arange(1, 14), np.arange(20, 33)]) % cfg.vocab_size
    plain = np.concatenate(list(Generator(model, batch=2, max_len=64, prefill_chunk=8, block_size=4)
                                .generate(prompts, max_new_tokens=15)), axis=1)[:, :15]
    spec = SpeculativeGenerator(model, batch=2, max_len=64, num_draft=3, prefill_chunk=8, kv_share=kv_share)
    np.testing.assert_array_equal(spec.generate(prompts, max_new_tokens=15), plain)
    s = spec.stats
    assert s.verify_steps == s.steps_per_sequence.sum() > 0 and s.accepted == s.accepted_per_sequence.sum()
    assert s.acceptance_lengths.shape == (2,) and np.all((1 <= s.acceptance_lengths) & (s.acceptance_lengths <= 4))
    with pytest.raises(ValueError, match="verification must be one of"):
        SpeculativeGenerator(model, batch=2, max_len=64, verification="greedy")


@nnx.jit
def _target_then_mtp(model, tokens, cache, mtp_cache):
    """The target's cached forward over tokens [B, N], then the MTP's over its hidden states
    -> model.mtp_forward_cached's (logits, hidden, MTP cache, indices), as one program."""
    _, hidden, _ = model.forward_cached(tokens, cache)
    return model.mtp_forward_cached(tokens, hidden, mtp_cache)


def test_kv_share_draft_runs_no_indexer_and_reads_only_target_kv(model, monkeypatch):
    cfg = model.cfg
    b, n = 2, 9
    tokens = jax.random.randint(jax.random.key(1), (b, n), 0, cfg.vocab_size)
    q1, g1, mtp_cache, idx1 = _target_then_mtp(model, tokens, create_cache(cfg, b, 32),
                                               create_mtp_cache(cfg, b, 32))
    q1, g1, idx1 = q1[:, -1], g1[:, -1], idx1[:, -1:]

    calls = {"indexer": 0, "max_index": -1}
    real_topk, real_mla = ops.paged_indexer_topk, ops.paged_sparse_mla

    def spy_topk(*a, **k):
        calls["indexer"] += 1
        return real_topk(*a, **k)

    def record_max_index(indices):
        calls["max_index"] = max(calls["max_index"], int(np.max(indices)))

    def spy_mla(q, kv_pages, page_table, indices, **k):   # the cache positions every draft step attends
        jax.debug.callback(record_max_index, indices)
        return real_mla(q, kv_pages, page_table, indices, **k)

    # Traced afresh for each setting (the draft steps are a Python loop, so each call of an op in
    # the trace is one call in the run); the attended indices come back through the callback.
    run_draft = nnx.jit(draft, static_argnames=("sampling", "num_draft", "kv_share", "forward"))

    monkeypatch.setattr(ops, "paged_indexer_topk", spy_topk)
    monkeypatch.setattr(ops, "paged_sparse_mla", spy_mla)
    for kv_share, want_calls in ((True, 0), (False, 2)):
        calls.update(indexer=0, max_index=-1)
        d, probs = run_draft(model, q1, g1, idx1, mtp_cache, jax.random.key(2), sampling=GREEDY, num_draft=3,
                             kv_share=kv_share, forward=ForwardOptions())
        jax.effects_barrier()
        assert d.shape == (b, 3) and probs.shape == (b, 3, cfg.vocab_size)
        assert calls["indexer"] == want_calls
        if kv_share:   # positions 0..n-1 hold KV computed from the target's hidden states
            assert 0 <= calls["max_index"] <= n - 1
        else:          # the baseline reads the draft steps' own KV at positions n, n+1
            assert calls["max_index"] >= n


def test_ragged_batch_equals_one_by_one(model):
    """Prompts of different lengths in one batch give each prompt's own greedy continuation, from
    the plain and from the speculative generator. In a process of its own (one for both, which
    share the model and its start): compiling it late in a long test worker crashed XLA (a
    segfault inside the compile or the cache write), never alone."""
    if not in_own_process("tests/test_speculative.py::test_ragged_batch_equals_one_by_one"):
        return
    cfg = model.cfg
    prompts = [np.arange(1, 12) % cfg.vocab_size, np.arange(30, 34), np.arange(50, 69) % cfg.vocab_size]

    def run(speculative, batch, items):
        if speculative:
            return SpeculativeGenerator(model, batch=batch, max_len=64, num_draft=2, prefill_chunk=8).generate(
                items, max_new_tokens=9)
        gen = Generator(model, batch=batch, max_len=64, prefill_chunk=8, block_size=4)
        return np.concatenate(list(gen.generate(items, max_new_tokens=9)), axis=1)[:, :9]

    for speculative in (False, True):
        together = run(speculative, 3, prompts)
        for i, prompt in enumerate(prompts):
            np.testing.assert_array_equal(together[i], run(speculative, 1, [prompt])[0], err_msg=f"{speculative=}")
