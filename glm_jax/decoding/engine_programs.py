"""The serving engine's device side: the per-slot state and the two compiled programs.

    programs = engine_programs(graphdef, treedef, kernels, data_shards)
    cache, slots = programs.prefill(params, cache, slots, rows, tables, starts, tokens, num_valid,
                                    seeds, drawn, sampling)
    tokens, cache, slots = programs.decode(params, cache, slots, control)

Both programs have fixed shapes (the engine's slots B, the page-table width W, the prefill
chunk C, one prefill row per data shard R), so the whole engine runs on these two programs
for every mix of requests and context lengths. The cache and the slot state are donated.

* `prefill` runs one chunk of up to C prompt tokens for R rows against the shared page pool,
  through a KVCache view holding those rows' page tables, and installs each row in its slot:
  page-table row, length, the logits after its last real token, seed, draw count, sampling.
  A padding row (row index B) writes only to its shard's scratch page and installs nothing.
* `decode` draws one token per slot from the slot's logits (its own key, from its seed and
  draw count; its own sampling setting), runs it through the model and keeps the new logits.
  `control` int32 [B, 3] = (active, table column, page id) per slot: an inactive slot reads
  and writes only its shard's scratch page and does not advance; a slot whose sequence
  crosses into a new page gets it at that column (column W: none).

The parameters arrive as a flat tuple of arrays and the graph definition is closed over:
hashing an nnx GraphDef as a static argument and flattening an nnx State on every call cost
most of a decode step's host time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax import ops
from glm_jax.cache import KVCache
from glm_jax.decoding.sampling import SamplingParams, sample_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What each of the B slots carries on the device between steps."""

    logits: jnp.ndarray           # float32 [B, V]: the distribution the slot's next token is drawn from
    seeds: jnp.ndarray            # uint32 [B]: the request's seed
    drawn: jnp.ndarray            # int32 [B]: tokens the request has drawn so far (its key = (seed, drawn))
    sampling: SamplingParams      # [B] leaves


def empty_slots(batch: int, vocab: int) -> SlotState:
    return SlotState(jnp.zeros((batch, vocab), jnp.float32), jnp.zeros((batch,), jnp.uint32),
                     jnp.zeros((batch,), jnp.int32),
                     jax.tree.map(jnp.asarray, SamplingParams.stack([SamplingParams()] * batch)))


def row_keys(seeds: jnp.ndarray, drawn: jnp.ndarray) -> jax.Array:
    """[B] typed keys: row b's key for its draw number drawn[b] of the stream seeded by seeds[b]."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, drawn)


class EnginePrograms(NamedTuple):
    prefill: Callable
    decode: Callable


@functools.lru_cache(maxsize=8)
def engine_programs(graphdef, treedef, kernels: ops.KernelChoice, data_shards: int) -> EnginePrograms:
    """The two jitted programs for one model structure (shared by every engine built on it)."""

    def model_of(params):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, params))

    def scratch_pages(cache: KVCache, rows: int) -> jnp.ndarray:
        """int32 [rows]: the scratch page of each row's data shard (row r of `rows` is in shard r * shards // rows)."""
        shard = jnp.arange(rows, dtype=jnp.int32) * data_shards // rows
        return shard * (cache.latent.shape[1] // data_shards)

    @functools.partial(jax.jit, donate_argnames=("cache", "slots"))
    def prefill(params, cache: KVCache, slots: SlotState, rows, tables, starts, tokens, num_valid, seeds, drawn,
                sampling: SamplingParams):
        """rows int32 [R] (B = padding), tables int32 [R, W], starts / num_valid / drawn int32 [R],
        tokens int32 [R, C], seeds uint32 [R], sampling [R] leaves -> (cache, slots)."""
        view = dataclasses.replace(cache, page_table=tables, lengths=starts)
        logits, _, view = model_of(params).forward_cached(tokens, view, kernels=kernels, num_valid=num_valid)
        last = jnp.take_along_axis(logits, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)[:, 0]
        cache = dataclasses.replace(view, page_table=cache.page_table.at[rows].set(tables, mode="drop"),
                                    lengths=cache.lengths.at[rows].set(view.lengths, mode="drop"))
        put = lambda old, new: old.at[rows].set(new.astype(old.dtype), mode="drop")  # noqa: E731
        slots = SlotState(put(slots.logits, last), put(slots.seeds, seeds), put(slots.drawn, drawn),
                          jax.tree.map(put, slots.sampling, sampling))
        return cache, slots

    @functools.partial(jax.jit, donate_argnames=("cache", "slots"))
    def decode(params, cache: KVCache, slots: SlotState, control):
        """control int32 [B, 3] (active, table column, page id) -> (tokens int32 [B], cache, slots)."""
        batch = control.shape[0]
        active = control[:, 0] > 0
        table = cache.page_table.at[jnp.arange(batch), control[:, 1]].set(control[:, 2], mode="drop")
        token = sample_tokens(slots.logits, row_keys(slots.seeds, slots.drawn), slots.sampling)
        view = dataclasses.replace(cache, page_table=jnp.where(active[:, None], table,
                                                               scratch_pages(cache, batch)[:, None]))
        logits, _, view = model_of(params).forward_cached(token[:, None], view, kernels=kernels,
                                                          num_valid=active.astype(jnp.int32))
        slots = dataclasses.replace(slots, logits=jnp.where(active[:, None], logits[:, 0], slots.logits),
                                    drawn=slots.drawn + active)
        return token, dataclasses.replace(view, page_table=table), slots

    return EnginePrograms(prefill, decode)
