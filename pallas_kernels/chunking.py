"""Query chunking: the helpers that keep only one chunk of queries' intermediates live, shared by
the `xla` implementations and by the model's losses (public: `glm_jax.training` uses them too).

Every array chunked here has the query axis at position 1 ([B, S, ...])."""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

#: Upper bound on the bytes of the per-chunk intermediates of the `xla` impls.
CHUNK_BUDGET_BYTES = 256 * 2**20
#: Upper bound on the default query chunk.
MAX_Q_CHUNK = 256


def choose_q_chunk(seq_len: int, bytes_per_query: int, q_chunk: int | None = None, *,
                   budget: int = CHUNK_BUDGET_BYTES, max_chunk: int = MAX_Q_CHUNK) -> int:
    """The number of queries processed at once, in [1, max(seq_len, 1)].

    An explicit `q_chunk` wins (capped at seq_len). Otherwise the largest power of two
    <= max_chunk whose intermediates (bytes_per_query each) fit in `budget`."""
    seq_len = int(seq_len)
    if q_chunk is not None:
        return max(1, min(positive_int("q_chunk", q_chunk, " or None"), seq_len))
    c = max(1, min(int(budget) // max(1, int(bytes_per_query)), int(max_chunk)))
    c = 1 << (c.bit_length() - 1)
    return max(1, min(c, seq_len))


def map_query_chunks(fn: Callable, args: Sequence[jax.Array], pad_values: Sequence, chunk: int, *,
                     remat: bool = False):
    """Applies fn(*chunk_args) to consecutive chunks of `chunk` queries and concatenates.

    Every array in `args` has the query axis at position 1 ([B, S, ...]); every output leaf of
    fn has it at position 1 too. S need not be a multiple of `chunk`: the tail is padded with
    `pad_values` (one per arg) and the outputs sliced back to S. Chunks run sequentially
    (lax.map), so only one chunk's intermediates are live; with remat=True each chunk is
    rematerialised in the backward pass, so its intermediates are not stored either."""
    seq_len = args[0].shape[1]
    if seq_len <= chunk:
        return fn(*args)
    n = -(-seq_len // chunk)

    def merge(y):
        y = jnp.moveaxis(y, 0, 1)
        y = y.reshape((y.shape[0], n * chunk) + y.shape[3:])
        return y[:, :seq_len]

    body = jax.checkpoint(fn) if remat else fn
    xs = tuple(split_query_chunks(a, v, chunk) for a, v in zip(args, pad_values))
    ys = lax.map(lambda chunk_args: body(*chunk_args), xs)
    return jax.tree.map(merge, ys)


def split_query_chunks(x: jax.Array, pad_value, chunk: int) -> jax.Array:
    """[B, S, ...] -> [n, B, chunk, ...] with n = ceil(S / chunk), the tail padded with pad_value."""
    seq_len = x.shape[1]
    n = -(-seq_len // chunk)
    pad = n * chunk - seq_len
    if pad:
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, widths, constant_values=jnp.asarray(pad_value, x.dtype))
    return jnp.moveaxis(x.reshape((x.shape[0], n, chunk) + x.shape[2:]), 1, 0)


def positive_int(name: str, value, alternatives: str = "") -> int:
    """value as an int; a ValueError naming `name` unless it is an int >= 1."""
    try:
        result = operator.index(value)
    except TypeError:
        result = 0
    if result < 1:
        raise ValueError(f"{name} must be a positive int{alternatives}, got {value!r}")
    return result
