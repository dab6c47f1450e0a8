"""Page pool and serving engine: paged decode == contiguous decode, pages reused after a request
finishes, an oversize request gets a clear error while the others run, host time per step flat."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from conftest import micro_config
from glm_jax.decoding.engine import Request, ServingEngine
from glm_jax.decoding.generate import Generator, decode_block
from glm_jax.model import GLMModel
from glm_jax.cache import CacheFullError, PagePool

PROMPTS = [np.arange(3, 12), np.arange(20, 25), np.arange(40, 53), np.arange(60, 90)]


@pytest.fixture(scope="module")
def model():
    return GLMModel(micro_config(max_position_embeddings=256), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def served(model):
    """4 requests over 2 slots and a pool that holds two of them at a time, plus one too big."""
    engine = ServingEngine(model, slots=2, num_pages=12, page_size=8, max_context=96, prefill_chunk=8)
    results = engine.serve([Request(p, 6) for p in PROMPTS] + [Request(np.arange(80), 10)])
    return engine, results


def test_paged_engine_equals_contiguous_generator(model, served):
    _, results = served
    for prompt, r in zip(PROMPTS, results):
        gen = Generator(model, batch=1, max_len=96, prefill_chunk=8, block_size=8)
        want = np.concatenate(list(gen.generate([prompt], max_new_tokens=6)), axis=1)[0].tolist()
        assert r.error is None and r.tokens == want


def test_pages_are_reused_after_a_request_finishes(served):
    engine, results = served
    first_wave = set(results[0].pages) | set(results[1].pages)
    assert set(results[2].pages) & first_wave          # the second wave runs in freed pages
    assert not engine.pool.held                         # every page went back
    assert engine.pool.free_pages() == engine.pool.num_pages - 1


def test_oversize_request_gets_clear_error_and_others_unaffected(served):
    _, results = served
    err = results[4].error
    assert results[4].tokens is None
    assert "needs 12 pages" in err and "MiB" in err and "whole pool" in err
    assert all(r.error is None and len(r.tokens) == 6 for r in results[:4])


def test_pool_allocator():
    pool = PagePool(micro_config(), num_pages=6, page_size=4)
    a = pool.allocate("a", 9)                 # 3 pages
    assert len(a) == 3 and 0 not in a         # page 0 is scratch
    with pytest.raises(CacheFullError, match="what is free now"):
        pool.allocate("b", 9)
    table = pool.page_table(["a", None], width=4)
    assert table[0].tolist() == a + [0] and table[1].tolist() == [0] * 4
    pool.release("a")
    assert sorted(pool.allocate("b", 9)) == sorted(a)


def test_decode_step_host_time_does_not_grow_with_context(model):
    engine = ServingEngine(model, slots=1, num_pages=40, page_size=8, max_context=250, prefill_chunk=8)
    engine.serve([Request(np.arange(1, 9), 8)])            # compile
    compiled = decode_block._cache_size()
    engine.step_times.clear()
    engine.serve([Request(np.arange(1, 9), 200)])
    assert decode_block._cache_size() == compiled          # one program for every context length
    times = engine.step_times
    early = np.median([t.host_s for t in times[:40]])
    late = np.median([t.host_s for t in times[-40:]])
    assert times[-1].context >= 20 * times[0].context // 2
    assert late < 3 * early + 1e-3, (early, late)
