"""embed_lookup: the rows of table[ids], and a table gradient equal to the scatter-add's, built
without scatter-adds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm_jax.layers.embedding import embed, embed_lookup

VOCAB, DIM = 53, 8
CUSTOM = [("sorted", 1), ("sorted", 16), ("sorted", 128), ("sorted", 4096), ("onehot", 64), ("onehot", 4096)]


def _ids(seed=0):
    """int32 [3, 234]: runs much longer than a block (id 7), ids at both ends, absent ids."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.integers(0, 40, 401), np.full(250, 7), [0, VOCAB - 1] * 24, [45] * 3])
    rng.shuffle(ids)
    return jnp.asarray(ids.reshape(3, -1), jnp.int32)


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed + 1)
    ids = _ids(seed)
    table = jnp.asarray(rng.normal(size=(VOCAB, DIM)), dtype)
    cotangent = jnp.asarray(rng.normal(size=(*ids.shape, DIM)), dtype)
    return table, ids, cotangent


def _table_grad(lookup, table, ids, cotangent):
    return jax.grad(lambda t: jnp.sum(lookup(t, ids).astype(jnp.float32) * cotangent.astype(jnp.float32)))(table)


def _exact_grad(ids, cotangent):
    """float64 [V, D]: each id's cotangent rows summed."""
    want = np.zeros((VOCAB, DIM))
    np.add.at(want, np.asarray(ids).reshape(-1), np.asarray(cotangent, np.float64).reshape(-1, DIM))
    return want


@pytest.mark.parametrize("backward,size", CUSTOM)
def test_float32_values_and_gradient_equal_take(backward, size):
    table, ids, cotangent = _inputs(jnp.float32)
    lookup = lambda t, i: embed_lookup(t, i, backward=backward, size=size)
    np.testing.assert_array_equal(lookup(table, ids), table[ids])
    got = _table_grad(lookup, table, ids, cotangent)
    plain = _table_grad(lambda t, i: t[i], table, ids, cotangent)
    exact = _exact_grad(ids, cotangent)
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    assert (np.asarray(got)[[41, 42, 43, 44, 46]] == 0).all()          # ids that never occur


@pytest.mark.parametrize("backward,size", CUSTOM[1:3] + CUSTOM[4:5])
def test_bfloat16_gradient_is_the_rounded_exact_sum(backward, size):
    """A bf16 table's gradient is summed in float32: the exact sum rounded to bf16."""
    table, ids, cotangent = _inputs(jnp.bfloat16)
    got = _table_grad(lambda t, i: embed_lookup(t, i, backward=backward, size=size), table, ids, cotangent)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(jnp.asarray(_exact_grad(ids, cotangent), jnp.float32).astype(jnp.bfloat16), np.float32)
    ulp = np.abs(want) * 2.0 ** -7 + 1e-30
    assert (np.abs(np.asarray(got, np.float32) - want) <= ulp).all()


def _grad_jaxpr(backward):
    table, ids, cotangent = _inputs(jnp.bfloat16)
    return str(jax.make_jaxpr(lambda t: _table_grad(
        lambda t, i: embed_lookup(t, i, backward=backward), t, ids, cotangent))(table))


def test_backward_has_no_scatter():
    assert "scatter-add" in _grad_jaxpr("xla")         # the check sees the plain lookup's scatter-add
    for backward in ("sorted", "onehot"):
        assert "scatter" not in _grad_jaxpr(backward), backward


def test_embed_reads_the_nnx_embed_table():
    module = nnx.Embed(VOCAB, DIM, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    _, ids, cotangent = _inputs(jnp.float32)
    np.testing.assert_array_equal(embed(module, ids), module(ids))

    def grad(lookup):
        return nnx.grad(lambda m: jnp.sum(lookup(m) * cotangent))(module)["embedding"][...]

    np.testing.assert_allclose(grad(lambda m: embed(m, ids)), grad(lambda m: m(ids)), rtol=1e-5, atol=1e-5)


def test_unknown_backward_is_refused():
    table, ids, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="unknown embedding backward"):
        embed_lookup(table, ids, backward="atomic")
