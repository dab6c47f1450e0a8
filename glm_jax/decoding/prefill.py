"""The one prefill program of every decoding policy: `prefill_chunk`, a target forward over one
chunk of prompt tokens (`chunk_forward`) that the plain and speculative generators and the
serving engine all call.

One program fits them all because a contiguous cache is a paged cache: `create_cache` makes
one page per sequence (page size = its rows, page table [[0], [1], ...]), so the generators'
[B, T] cache and the engine's page pool are one KVCache type, read and written only through
page tables. What differs is which rows a chunk writes:
* rows=None (the generators): every row of the cache, through its own page table, from its
  own length;
* rows=`PrefillRows` (the engine): R rows of the pool, each through the page table and from
  the start given for it (the request's pages); the chunk runs on a view of the cache holding
  those tables and starts, and the view's tables and lengths are put back at the rows' slots.
The policies' extras are optional arguments of the same program, each a different trace of
the one jitted function (jit keys its cache on which are None): the MTP layer's cache
(`mtp_cache`, the speculative generator's draft state), installing each row in its engine
slot (`slots`, `slot_inputs`) and scoring the prompt (`targets`, a request's prompt
log-probabilities). A chunk's forward is the same computation whichever of them it carries,
so the tokens are those each policy produced with a prefill of its own.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from glm_jax.cache import KVCache
from glm_jax.decoding.programs import ParamLayout, program
from glm_jax.decoding.slots import SlotState, scores_of
from glm_jax.forward_options import ForwardOptions


class PrefillRows(NamedTuple):
    """The cache rows one prefill chunk writes, each through its own page table (the engine's)."""

    rows: jnp.ndarray             # int32 [R]: the cache row (slot) of each; B (a padding row): kept nowhere
    tables: jnp.ndarray           # int32 [R, W]: their page tables
    starts: jnp.ndarray           # int32 [R]: rows already written (the chunk's first position)

    def view(self, cache: KVCache) -> KVCache:
        """The cache as these R rows see it (their page tables and lengths)."""
        return dataclasses.replace(cache, page_table=self.tables, lengths=self.starts)

    def put_back(self, cache: KVCache, view: KVCache) -> KVCache:
        """`cache` holding what the view wrote, its tables and lengths at the rows' slots."""
        return dataclasses.replace(view, page_table=cache.page_table.at[self.rows].set(self.tables, mode="drop"),
                                   lengths=cache.lengths.at[self.rows].set(view.lengths, mode="drop"))


def chunk_forward(model, tokens, cache: KVCache, num_valid, forward: ForwardOptions):
    """The target forward of one prefill chunk: tokens int32 [B, C] (padded), num_valid int32
    [B] -> (logits [B, C, V], hidden [B, C, hidden], cache, the last real token's logits [B, V]
    and hidden [B, hidden])."""
    logits, hidden, cache = model.forward_cached(tokens, cache, options=forward, num_valid=num_valid)
    last = jnp.maximum(num_valid - 1, 0)[:, None, None]
    return (logits, hidden, cache, jnp.take_along_axis(logits, last, axis=1)[:, 0],
            jnp.take_along_axis(hidden, last, axis=1)[:, 0])


@program(static_argnames=("layout", "forward"), donate_argnames=("cache", "mtp_cache", "slots"))
def prefill_chunk(layout: ParamLayout, params: tuple, cache: KVCache, tokens, num_valid, forward: ForwardOptions,
                  rows: PrefillRows | None = None, mtp_cache: KVCache | None = None, mtp_inputs=None,
                  slots: SlotState | None = None, slot_inputs=None, targets=None):
    """The one prefill program. tokens int32 [R, C] (padded), num_valid int32 [R]: one chunk of
    every row of `cache` (rows None) or of the `rows` of a page pool.

    mtp_cache: None, or the MTP cache to prefill too, with mtp_inputs = (next_tokens [R, C] one
    ahead, num_valid_mtp [R]). slots: None, or the SlotState to install each row in (needs
    rows), with slot_inputs = (seeds uint32 [R], drawn int32 [R], sampling [R] leaves).
    targets: None, or int32 [R, C], the token after each position, to score.

    -> (last_logits [R, V], last_hidden [R, hidden]: the last real token's (None when installed
    in `slots`), cache, mtp_cache, slots, Scores [R, C] of the targets or None)."""
    model = layout.model(params)
    view = cache if rows is None else rows.view(cache)
    logits, hidden, view, last_logits, last_hidden = chunk_forward(model, tokens, view, num_valid, forward)
    cache = view if rows is None else rows.put_back(cache, view)
    if mtp_cache is not None:
        next_tokens, num_valid_mtp = mtp_inputs
        _, _, mtp_cache, _ = model.mtp_forward_cached(next_tokens, hidden, mtp_cache, options=forward,
                                                      num_valid=num_valid_mtp)
    if slots is not None:
        slots = slots.installed(rows.rows, last_logits, *slot_inputs)
        last_logits = last_hidden = None
    scores = None if targets is None else scores_of(logits, targets)
    return last_logits, last_hidden, cache, mtp_cache, slots, scores
