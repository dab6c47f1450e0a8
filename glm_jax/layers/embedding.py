"""Embedding lookups whose gradient is summed in float32 without atomic adds.

The autodiff of `table[ids]` is a scatter-add of the cotangent rows into a table-shaped zero
array: on a GPU, colliding atomic adds in the table's dtype (bf16), slow when ids repeat and not
bitwise reproducible. `embed_lookup` gathers in the forward pass and builds the table gradient
in one of these ways (`BACKWARD`, or the `backward` argument):

* "sorted": sort the ids; in each block of `SORT_BLOCK` sorted rows, sum every run of equal
  ids with a [block, block] one-hot matmul (float32 accumulation); runs that cross block
  boundaries are joined by a segmented scan over the blocks' last runs; every vocabulary row
  then gathers the sum at its id's last occurrence. Sorts, gathers and matmuls only.
* "onehot": onehot(ids)^T @ cotangent over chunks of `ONEHOT_CHUNK` tokens, accumulated in
  float32 in a fixed order: 2 * tokens * vocab * hidden flops on tensor cores.
* "xla": plain `jnp.take` and its autodiff (the scatter-add), for comparison.

Both custom paths are deterministic: no float atomics, fixed summation orders. The module
parameter stays nnx.Embed's `embedding` [vocab, hidden] (checkpoints and the HF converter name it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.logical_axes import explicit_axes, leading_spec, on_auto_axes

#: The table gradient's method: "sorted", "onehot" or "xla".
BACKWARD = "sorted"
#: Sorted rows per one-hot block of the "sorted" backward.
SORT_BLOCK = 64
#: Tokens per chunk of the "onehot" backward.
ONEHOT_CHUNK = 2048


class Embed(nnx.Embed):
    """nnx.Embed whose table [num_embeddings, features] carries the logical names `axes`
    (default ("vocab", "embed")) and whose lookup runs through `embed_lookup` (its gradient
    without atomic adds). On a mesh with Explicit axes the lookup comes back laid out like the
    ids, features replicated. The parameter is nnx.Embed's `embedding`."""

    def __init__(self, num_embeddings: int, features: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32,
                 axes: tuple[str | None, str | None] = ("vocab", "embed"), **kwargs):
        metadata = {"out_sharding": tuple(axes), "eager_sharding": False, **kwargs.pop("embedding_metadata", {})}
        super().__init__(num_embeddings, features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                         embedding_metadata=metadata, **kwargs)

    def __call__(self, ids: jnp.ndarray, out_sharding=None) -> jnp.ndarray:
        if not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
            raise ValueError(f"Embed: ids must hold integers (token ids), got {jnp.asarray(ids).dtype}")
        if explicit_axes() or out_sharding is not None:
            out = out_sharding if out_sharding is not None else leading_spec(ids, ids.ndim + 1, ids.ndim)
            return on_auto_axes(self, lambda layer, ids: embed(layer, ids), (ids,), out)
        return embed(self, ids)


def embed(module: nnx.Embed, ids: jnp.ndarray, **options) -> jnp.ndarray:
    """`module(ids)` (an nnx.Embed) through `embed_lookup`: ids int [...] -> [..., features]."""
    table = module.embedding[...]
    if module.dtype is not None:
        table = table.astype(module.dtype)
    return embed_lookup(table, ids, **options)


def embed_lookup(table: jnp.ndarray, ids: jnp.ndarray, *, backward: str | None = None,
                 size: int | None = None) -> jnp.ndarray:
    """table [V, D], ids int [...] in [0, V) -> table rows [..., D].

    backward: "sorted" | "onehot" | "xla" (default `BACKWARD`); size: the block of "sorted"
    (default SORT_BLOCK) or the chunk of "onehot" (default ONEHOT_CHUNK)."""
    backward = backward or BACKWARD
    if backward == "xla":
        return jnp.take(table, ids, axis=0)
    if backward not in ("sorted", "onehot"):
        raise ValueError(f"unknown embedding backward {backward!r}: 'sorted', 'onehot' or 'xla'")
    size = size or (SORT_BLOCK if backward == "sorted" else ONEHOT_CHUNK)
    return _lookup(table, ids, (backward, size))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table, ids, how):
    return jnp.take(table, ids, axis=0)


def _lookup_fwd(table, ids, how):
    return jnp.take(table, ids, axis=0), (table, ids)


def _lookup_bwd(how, residuals, g):
    table, ids = residuals
    method, size = how
    ids, g = ids.reshape(-1), g.reshape(-1, g.shape[-1])
    grad = (sorted_table_grad if method == "sorted" else onehot_table_grad)(ids, g, table.shape[0], size)
    return grad.astype(table.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _precision(dtype):
    """Exact float32 products on GPUs too (no TF32); bf16 inputs need nothing."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def onehot_table_grad(ids, g, vocab: int, chunk: int) -> jnp.ndarray:
    """ids int [N], g [N, D] -> float32 [vocab, D]: sum of g's rows per id, by one-hot matmuls
    over chunks of `chunk` tokens added in chunk order."""
    n, d = g.shape
    pad = -n % chunk
    ids = jnp.concatenate([ids, jnp.full((pad,), -1, ids.dtype)]).reshape(-1, chunk)   # -1: no row
    g = jnp.concatenate([g, jnp.zeros((pad, d), g.dtype)]).reshape(-1, chunk, d)

    def add_chunk(acc, chunk_rows):
        chunk_ids, chunk_g = chunk_rows
        onehot = (chunk_ids[:, None] == jnp.arange(vocab, dtype=ids.dtype)).astype(g.dtype)   # [C, V]
        return acc + jnp.einsum("cv,cd->vd", onehot, chunk_g, preferred_element_type=jnp.float32,
                                precision=_precision(g.dtype)), None

    grad, _ = jax.lax.scan(add_chunk, jnp.zeros((vocab, d), jnp.float32), (ids, g))
    return grad


def sorted_table_grad(ids, g, vocab: int, block: int) -> jnp.ndarray:
    """ids int [N], g [N, D] -> float32 [vocab, D]: sum of g's rows per id, by sorting (see the
    module docstring)."""
    n, d = g.shape
    order = jnp.argsort(ids, stable=True)
    ids, rows = ids[order], jnp.take(g, order, axis=0)
    pad = -n % block                      # padding rows join the last run with zero rows
    ids = jnp.concatenate([ids, jnp.broadcast_to(ids[-1], (pad,))])
    rows = jnp.concatenate([rows, jnp.zeros((pad, d), rows.dtype)])
    num_blocks = (n + pad) // block
    block_ids = ids.reshape(num_blocks, block)
    starts = jnp.concatenate([jnp.ones((num_blocks, 1), bool), block_ids[:, 1:] != block_ids[:, :-1]], 1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1                  # [nb, B]: run within block
    onehot = (run[:, :, None] == jnp.arange(block, dtype=jnp.int32)).astype(rows.dtype)   # [nb, B, B]
    run_sums = jnp.einsum("bij,bid->bjd", onehot, rows.reshape(num_blocks, block, d),
                          preferred_element_type=jnp.float32, precision=_precision(rows.dtype))
    carry_in = _carry_between_blocks(run_sums, run[:, -1], block_ids)

    # Each id's total: its last occurrence's run sum, plus the carry if that run starts its block.
    vocab_ids = jnp.arange(vocab, dtype=ids.dtype)
    last = jnp.searchsorted(ids, vocab_ids, side="right", method="scan_unrolled") - 1   # [V]
    last = jnp.maximum(last, 0)
    present = ids[last] == vocab_ids
    blk, r = last // block, run.reshape(-1)[last]
    total = jnp.take(run_sums.reshape(-1, d), blk * block + r, axis=0) + jnp.where(
        (r == 0)[:, None], jnp.take(carry_in, blk, axis=0), 0.0)
    return jnp.where(present[:, None], total, 0.0)


def _carry_between_blocks(run_sums, last_run, block_ids):
    """run_sums float32 [nb, B, D], last_run int32 [nb] (each block's last run), block_ids [nb, B]
    -> float32 [nb, D]: the sum of the rows before block b that belong to its first run."""
    tail = jnp.take_along_axis(run_sums, last_run[:, None, None], axis=1)[:, 0]    # [nb, D]
    continues = jnp.concatenate([jnp.zeros((1,), bool), block_ids[1:, 0] == block_ids[:-1, -1]])
    passes = continues & (last_run == 0)       # one run that goes on: the carry passes through

    def combine(a, b):                          # carry_out = tail + passes * carry_in, composed
        (pass_a, sum_a), (pass_b, sum_b) = a, b
        return pass_a & pass_b, jnp.where(pass_b[:, None], sum_a + sum_b, sum_b)

    _, carry_out = jax.lax.associative_scan(combine, (passes, tail))
    previous = jnp.concatenate([jnp.zeros_like(carry_out[:1]), carry_out[:-1]])
    return jnp.where(continues[:, None], previous, 0.0)
