"""The serving engine's device side: its compiled programs (the shared prefill and the engine's
decode) and how a decode call's draws are packed and read back.

    programs = engine_programs(layout, forward, data_shards, outputs, options)
    _, _, cache, _, slots, scores = programs.prefill(
        layout, params, cache, tokens, num_valid, forward, rows=PrefillRows(rows, tables, starts),
        slots=slots, slot_inputs=(seeds, drawn, sampling), targets=None)   # targets: prompt log-probs
    draws, cache, slots = programs.decode(params, cache, slots, control, steps=4)
    host = np.asarray(draws)                                     # int32 [B, 4, 2 + 2K]
    tokens, scores = drawn_tokens(host), drawn_scores(host)      # B lists of 4 ints, Scores [B, 4] of numpy

The programs have fixed shapes (the engine's slots B, the page-table width W, the prefill
chunk C, one prefill row per data shard R), so the whole engine runs on prefill and decode
for every mix of requests and context lengths. C is the engine's `prefill_chunk` or, with a
step token budget, also its smaller `decode_chunk`: jit compiles the prefill once per chunk
size (and once more with targets), so at most two of each. The cache and the slot state are
donated.

* `prefill` is the generators' prefill program (`prefill.prefill_chunk`; on one device the
  same jitted function, so its compilations are shared): one chunk of up to C prompt tokens
  for R rows against the shared page pool, through a KVCache view holding those rows' page
  tables (`PrefillRows`), installing each row in its slot (`slots.SlotState`): page-table
  row, length, the logits after its last real token, seed, draw count, sampling. A padding
  row (row index B) writes only to its shard's scratch page and installs nothing. With
  `targets` (the prompt token after each position) it also returns their `Scores`: the
  prompt's log-probabilities, for requests that ask for them with echo; a trace of its own,
  so plain prefill does no extra work, compiled on the first such request.
* `decode` runs `steps` decode steps in one call (a static argument: one program per block
  size the engine uses, 1 and its `decode_steps`). Each step draws one token per slot from
  the slot's logits (its own key, from its seed and draw count; its own sampling setting),
  runs it through the model and keeps the new logits. `control` int32 [B, 3] = (steps, table
  column, page id) per slot: slot b runs the call's first control[b, 0] steps (0: idle); in
  the steps it does not run it reads and writes only its shard's scratch page and does not
  advance. A slot whose rows in the call cross into a new page gets it at that column before
  the first step (column W: none); with steps <= page_size the call's rows cross at most one
  page boundary, so the page of its last row is the only one it can lack. Writing a page
  already at its column changes nothing, so the engine names each drawing slot's newest page
  on every call and sends a new control only when one changes. It returns the drawn tokens
  with their `Scores` (MAX_LOGPROBS alternatives, `slots`) packed in one int32 [B, steps,
  2 + 2K] array (`pack_draws` per step): one output to copy, wait for and read back per call,
  whether or not some request asked for log-probabilities.

What a call costs the host grows with the arrays passed: every call flattens its arguments and
checks each array's signature. So the parameters arrive as one flat tuple of arrays (hashing an
nnx GraphDef as a static argument and flattening an nnx State on every call cost most of a
decode step's host time): the decode program closes over their `programs.ParamLayout`, the
prefill takes it as a static argument that hashes once; without the MTP layer's arrays, which
serving never reads (inside the programs the MTP layer holds shape-only placeholders).

On a GPU the programs are compiled to run as CUDA graphs (XLA command buffers), loops and
conditionals included (`programs.compiler_options`): XLA otherwise launches a step kernel by kernel
from the host and steps the layer scans' loops there, which cost a decode step of the
8-layer GLM-5.2-attention model 5.8 ms of host CPU on an H100, more than the device's step;
as graphs, 2.4 ms (benchmarks/engine_steps.py, docs/serving.md).

On a mesh the programs return the cache and the slot state with exactly the shardings they
were given (`OutputShardings`, pinned as out_shardings): jit keys its dispatch on how a sharding is
spelled, and left to itself it returns `P('layer', 'data')` for `P('layer', 'data', None, None)`,
so a program's second call would miss the entry of its first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm_jax.cache import KVCache
from glm_jax.decoding.prefill import prefill_chunk
from glm_jax.decoding.programs import Options, ParamLayout, jit
from glm_jax.decoding.sampling import sample_tokens
from glm_jax.decoding.slots import SlotState, Scores, scores_of
from glm_jax.forward_options import ForwardOptions


def pack_draws(tokens: jnp.ndarray, scores: Scores) -> jnp.ndarray:
    """tokens int32 [B] and their Scores [B] -> int32 [B, 2 + 2K]: per row the token, its
    log-prob, the K top log-probs and the K top ids (the floats' bits as int32, so exact)."""
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([tokens[:, None], bits(scores.logprob)[:, None], bits(scores.top_logprobs),
                            scores.top_ids], axis=1)


def drawn_tokens(draws: np.ndarray) -> list[list[int]]:
    """The tokens of a decode call's draws on the host, int32 [B, S, 2 + 2K] (`pack_draws` per
    step) -> per slot its S tokens, in step order."""
    return draws[:, :, 0].tolist()


def drawn_scores(draws: np.ndarray) -> Scores:
    """The Scores of a decode call's draws on the host, int32 [B, S, 2 + 2K] -> Scores [B, S]
    (numpy views into `draws`)."""
    k = (draws.shape[2] - 2) // 2
    return Scores(draws[:, :, 1].view(np.float32), draws[:, :, 2:2 + k].view(np.float32), draws[:, :, 2 + k:])


def row_keys(seeds: jnp.ndarray, drawn: jnp.ndarray) -> jax.Array:
    """[B] typed keys: row b's key for its draw number drawn[b] of the stream seeded by seeds[b]."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, drawn)


class EnginePrograms(NamedTuple):
    prefill: Callable             # `prefill.prefill_chunk`, jitted with the engine's options (and output shardings)
    decode: Callable


class OutputShardings(NamedTuple):
    """The shardings the programs return (hashable): the cache's and the slot state's own, and
    the tokens' (split over `data` as the slots)."""

    cache: tuple                            # (treedef, shardings) of the KVCache
    slots: tuple                            # (treedef, shardings) of the SlotState
    tokens: jax.sharding.Sharding

    @classmethod
    def of(cls, cache: KVCache, slots: SlotState, tokens: jax.sharding.Sharding) -> "OutputShardings":
        def frozen(tree):
            leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, tree))
            return treedef, tuple(leaves)
        return cls(frozen(cache), frozen(slots), tokens)

    def trees(self) -> tuple:
        """(cache shardings, slot state shardings) as pytrees."""
        return tuple(jax.tree.unflatten(treedef, leaves) for treedef, leaves in (self.cache, self.slots))


@functools.lru_cache(maxsize=8)
def engine_programs(layout: ParamLayout, forward: ForwardOptions, data_shards: int,
                    outputs: OutputShardings | None = None,
                    options: Options = ()) -> EnginePrograms:
    """The jitted programs for one model structure (shared by every engine built on it);
    outputs: the shardings they return on a mesh (None: left to jit, for one device); options: XLA
    compiler options ((name, value) pairs, `programs.compiler_options`). The prefill is the
    generators' program (`prefill.prefill_chunk`): on one device the very same jitted function."""
    if outputs is None:
        prefill, decode_out = prefill_chunk.with_options(options), {}
    else:
        cache_out, slots_out = outputs.trees()
        # (last logits, last hidden, cache, MTP cache, slots, Scores split over `data` by their rows)
        prefill = prefill_chunk.placed(options, out_shardings=(None, None, cache_out, None, slots_out,
                                                               outputs.tokens))
        decode_out = dict(out_shardings=(outputs.tokens, cache_out, slots_out))

    def scratch_pages(cache: KVCache, rows: int) -> jnp.ndarray:
        """int32 [rows]: the scratch page of each row's data shard (row r of `rows` is in shard r * shards // rows)."""
        shard = jnp.arange(rows, dtype=jnp.int32) * data_shards // rows
        return shard * (cache.num_pages // data_shards)

    @functools.partial(jit, options=options, donate_argnames=("cache", "slots"), static_argnames=("steps",),
                       **decode_out)
    def decode(params, cache: KVCache, slots: SlotState, control, steps: int):
        """control int32 [B, 3] (steps the slot runs, table column, page id), steps (static)
        -> (the drawn tokens and their Scores under the logits they were drawn from, int32
        [B, steps, 2 + 2K] (`pack_draws` per step; a slot's rows past its own steps are
        filler), cache, slots)."""
        batch = control.shape[0]
        table = cache.page_table.at[jnp.arange(batch), control[:, 1]].set(control[:, 2], mode="drop")
        scratch = scratch_pages(cache, batch)[:, None]

        def one_step(carry, step):
            """(cache, slots), the step's index -> ((cache, slots), its draws int32 [B, 2 + 2K])."""
            view, slots = carry
            active = control[:, 0] > step
            token = sample_tokens(slots.logits, row_keys(slots.seeds, slots.drawn), slots.sampling)
            scores = scores_of(slots.logits, token)
            view = dataclasses.replace(view, page_table=jnp.where(active[:, None], table, scratch))
            logits, _, view = layout.model(params).forward_cached(token[:, None], view, options=forward,
                                                                  num_valid=active.astype(jnp.int32))
            slots = dataclasses.replace(slots, logits=jnp.where(active[:, None], logits[:, 0], slots.logits),
                                        drawn=slots.drawn + active)
            return (view, slots), pack_draws(token, scores)

        (view, slots), draws = jax.lax.scan(one_step, (cache, slots), jnp.arange(steps, dtype=jnp.int32))
        return jnp.swapaxes(draws, 0, 1), dataclasses.replace(view, page_table=table), slots

    return EnginePrograms(prefill, decode)
