"""Page pool: pages per request, growth on demand, page tables, reuse, clear errors (the engine
that uses it: tests/test_engine.py)."""

from __future__ import annotations

import pytest

from conftest import micro_config
from glm_jax.cache import CacheFullError, PagePool


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


def test_pool_grows_a_request_page_by_page():
    pool = PagePool(micro_config(), num_pages=6, page_size=4)
    assert len(pool.allocate("a", 4)) == 1
    assert pool.grow("a", 4) == [] and len(pool.grow("a", 5)) == 1 and len(pool.held["a"]) == 2
    assert len(pool.grow("a", 16)) == 2 and pool.free_pages() == 1
    with pytest.raises(CacheFullError, match="needs 3 pages .* what is free now: 1 free of 5 usable"):
        pool.grow("b", 9)
    with pytest.raises(CacheFullError, match="needs 6 pages .* the whole pool"):
        pool.check_fits_ever("b", 21)
    pool.check_fits_ever("b", 20)
    pool.release("a")
    pool.release("never-held")
    assert pool.free_pages() == pool.usable_pages == 5
