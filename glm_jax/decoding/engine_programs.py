"""The serving engine's device side: the per-slot state and the compiled programs (prefill and
decode, plus a prefill that scores the prompt for requests that ask).

    params, layout = serving_params(state)
    programs = engine_programs(graphdef, layout, kernels, data_shards, placement, options)
    cache, slots = programs.prefill(params, cache, slots, rows, tables, starts, tokens, num_valid,
                                    seeds, drawn, sampling)
    cache, slots, scores = programs.prefill_scored(..., sampling, targets)   # prefill + prompt log-probs
    draws, cache, slots = programs.decode(params, cache, slots, control, steps=4)
    host = np.asarray(draws)                                     # int32 [B, 4, 2 + 2K]
    tokens, scores = drawn_tokens(host), drawn_scores(host)      # B lists of 4 ints, Scores [B, 4] of numpy

The programs have fixed shapes (the engine's slots B, the page-table width W, the prefill
chunk C, one prefill row per data shard R), so the whole engine runs on prefill and decode
for every mix of requests and context lengths. C is the engine's `prefill_chunk` or, with a
step token budget, also its smaller `decode_chunk`: jit compiles prefill (and prefill_scored)
once per chunk size, so at most two of each. The cache and the slot state are donated.

* `prefill` runs one chunk of up to C prompt tokens for R rows against the shared page pool,
  through a KVCache view holding those rows' page tables, and installs each row in its slot:
  page-table row, length, the logits after its last real token, seed, draw count, sampling.
  A padding row (row index B) writes only to its shard's scratch page and installs nothing.
* `prefill_scored` is `prefill` that also returns the `Scores` of every chunk position
  against `targets` (the prompt token after it): the prompt's log-probabilities, for requests
  that ask for them with echo. A program of its own, so plain prefill does no extra work; it
  compiles on the first such request.
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
  with their `Scores` (MAX_LOGPROBS alternatives) packed in one int32 [B, steps, 2 + 2K]
  array (`pack_draws` per step): one output to copy, wait for and read back per call, whether
  or not some request asked for log-probabilities.

Log-probabilities are the model's own: log_softmax of the raw logits, BEFORE temperature and
the top_k / top_p / min_p filters (what vLLM and OpenAI report by default), whatever the
request's sampling setting. Every request takes the same MAX_LOGPROBS alternatives from the
same compiled programs, so asking for a different count never recompiles.

What a call costs the host grows with the arrays passed: every call flattens its arguments and
checks each array's signature. So the parameters arrive as one flat tuple of arrays with the
graph definition closed over (hashing an nnx GraphDef as a static argument and flattening an
nnx State on every call cost most of a decode step's host time), and without the MTP layer's
arrays, which serving never reads (`serving_params`; inside the programs the MTP layer holds
shape-only placeholders).

On a GPU the programs are compiled to run as CUDA graphs (XLA command buffers), loops and
conditionals included (`programs.compiler_options`): XLA otherwise launches a step kernel by kernel
from the host and steps the layer scans' loops there, which cost a decode step of the
8-layer GLM-5.2-attention model 5.8 ms of host CPU on an H100, more than the device's step;
as graphs, 2.4 ms (benchmarks/engine_steps.py, docs/serving.md).

On a mesh the programs return the cache and the slot state with exactly the shardings they
were given (`Placement`, pinned as out_shardings): jit keys its dispatch on how a sharding is
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
from flax import nnx

from glm_jax import ops
from glm_jax.cache import KVCache
from glm_jax.decoding.programs import Options, jit
from glm_jax.decoding.runtime import chunk_forward
from glm_jax.decoding.sampling import SamplingParams, sample_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What each of the B slots carries on the device between steps."""

    logits: jnp.ndarray           # float32 [B, V]: the distribution the slot's next token is drawn from
    seeds: jnp.ndarray            # uint32 [B]: the request's seed
    drawn: jnp.ndarray            # int32 [B]: tokens the request has drawn so far (its key = (seed, drawn))
    sampling: SamplingParams      # [B] leaves


#: The most alternatives a request may ask the log-probabilities of: a static size, so requests
#: with any count (0..MAX_LOGPROBS) share the compiled programs.
MAX_LOGPROBS = 20


class Scores(NamedTuple):
    """Log-probabilities under the model's distribution (log_softmax of the raw logits, before
    temperature and the sampling filters) at positions [...]: [B] in decode, [R, C] in prefill.
    K = min(MAX_LOGPROBS, vocab)."""

    logprob: jnp.ndarray          # float32 [...]: the token's (drawn in decode, the next prompt token in prefill)
    top_logprobs: jnp.ndarray     # float32 [..., K]: the K most likely tokens', most likely first
    top_ids: jnp.ndarray          # int32 [..., K]: their ids (the lower id first on ties)


def scores_of(logits: jnp.ndarray, tokens: jnp.ndarray) -> Scores:
    """logits [..., V] (raw, before temperature), tokens int32 [...] -> their Scores."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(logprobs, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return Scores(chosen, top_logprobs, top_ids.astype(jnp.int32))


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


def empty_slots(batch: int, vocab: int) -> SlotState:
    return SlotState(jnp.zeros((batch, vocab), jnp.float32), jnp.zeros((batch,), jnp.uint32),
                     jnp.zeros((batch,), jnp.int32),
                     jax.tree.map(jnp.asarray, SamplingParams.stack([SamplingParams()] * batch)))


def row_keys(seeds: jnp.ndarray, drawn: jnp.ndarray) -> jax.Array:
    """[B] typed keys: row b's key for its draw number drawn[b] of the stream seeded by seeds[b]."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, drawn)


class EnginePrograms(NamedTuple):
    prefill: Callable
    prefill_scored: Callable
    decode: Callable


class ParamLayout(NamedTuple):
    """Where the serving parameters sit among the model state's leaves (hashable)."""

    treedef: jax.tree_util.PyTreeDef        # of the whole nnx State
    skipped: tuple                          # ((leaf index, jax.ShapeDtypeStruct), ...): leaves not passed

    def state(self, params: tuple):
        """The nnx State from the passed leaves, placeholders at the skipped ones."""
        passed = iter(params)
        skipped = dict(self.skipped)
        leaves = [skipped[i] if i in skipped else next(passed) for i in range(self.treedef.num_leaves)]
        return jax.tree.unflatten(self.treedef, leaves)


def serving_params(state) -> tuple[tuple, ParamLayout]:
    """The model state's arrays the serving programs read, as a flat tuple (every leaf but the
    MTP layer's), and their layout."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    unused = {i for i, (path, _) in enumerate(flat) if path[0] == jax.tree_util.DictKey("mtp")}
    params = tuple(x for i, (_, x) in enumerate(flat) if i not in unused)
    skipped = tuple((i, jax.ShapeDtypeStruct(flat[i][1].shape, flat[i][1].dtype)) for i in sorted(unused))
    return params, ParamLayout(treedef, skipped)


class Placement(NamedTuple):
    """The shardings the programs return (hashable): the cache's and the slot state's own, and
    the tokens' (split over `data` as the slots)."""

    cache: tuple                            # (treedef, shardings) of the KVCache
    slots: tuple                            # (treedef, shardings) of the SlotState
    tokens: jax.sharding.Sharding

    @classmethod
    def of(cls, cache: KVCache, slots: SlotState, tokens: jax.sharding.Sharding) -> "Placement":
        def frozen(tree):
            leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, tree))
            return treedef, tuple(leaves)
        return cls(frozen(cache), frozen(slots), tokens)

    def trees(self) -> tuple:
        """(cache shardings, slot state shardings) as pytrees."""
        return tuple(jax.tree.unflatten(treedef, leaves) for treedef, leaves in (self.cache, self.slots))


@functools.lru_cache(maxsize=8)
def engine_programs(graphdef, layout: ParamLayout, kernels: ops.KernelChoice, data_shards: int,
                    placement: Placement | None = None,
                    options: Options = ()) -> EnginePrograms:
    """The jitted programs for one model structure (shared by every engine built on it);
    placement: what they return on a mesh (None: left to jit, for one device); options: XLA
    compiler options ((name, value) pairs, `programs.compiler_options`)."""
    prefill_out, scored_out, decode_out = {}, {}, {}
    if placement is not None:
        cache_out, slots_out = placement.trees()
        prefill_out.update(out_shardings=(cache_out, slots_out))
        # Scores and decode's packed draws are split over `data` by their leading (row) dim.
        scored_out.update(out_shardings=(cache_out, slots_out, placement.tokens))
        decode_out.update(out_shardings=(placement.tokens, cache_out, slots_out))

    def model_of(params):
        return nnx.merge(graphdef, layout.state(params))

    def scratch_pages(cache: KVCache, rows: int) -> jnp.ndarray:
        """int32 [rows]: the scratch page of each row's data shard (row r of `rows` is in shard r * shards // rows)."""
        shard = jnp.arange(rows, dtype=jnp.int32) * data_shards // rows
        return shard * (cache.num_pages // data_shards)

    def prefill_logits(params, cache: KVCache, slots: SlotState, rows, tables, starts, tokens, num_valid, seeds,
                       drawn, sampling: SamplingParams):
        """rows int32 [R] (B = padding), tables int32 [R, W], starts / num_valid / drawn int32 [R],
        tokens int32 [R, C], seeds uint32 [R], sampling [R] leaves -> (cache, slots, the chunk's
        logits float32 [R, C, V])."""
        view = dataclasses.replace(cache, page_table=tables, lengths=starts)
        logits, _, view, last, _ = chunk_forward(model_of(params), tokens, view, num_valid, kernels)
        cache = dataclasses.replace(view, page_table=cache.page_table.at[rows].set(tables, mode="drop"),
                                    lengths=cache.lengths.at[rows].set(view.lengths, mode="drop"))
        put = lambda old, new: old.at[rows].set(new.astype(old.dtype), mode="drop")  # noqa: E731
        slots = SlotState(put(slots.logits, last), put(slots.seeds, seeds), put(slots.drawn, drawn),
                          jax.tree.map(put, slots.sampling, sampling))
        return cache, slots, logits

    @functools.partial(jit, options=options, donate_argnames=("cache", "slots"), **prefill_out)
    def prefill(params, cache: KVCache, slots: SlotState, rows, tables, starts, tokens, num_valid, seeds, drawn,
                sampling: SamplingParams):
        """`prefill_logits`' arguments -> (cache, slots)."""
        cache, slots, _ = prefill_logits(params, cache, slots, rows, tables, starts, tokens, num_valid, seeds, drawn,
                                         sampling)
        return cache, slots

    @functools.partial(jit, options=options, donate_argnames=("cache", "slots"), **scored_out)
    def prefill_scored(params, cache: KVCache, slots: SlotState, rows, tables, starts, tokens, num_valid, seeds,
                       drawn, sampling: SamplingParams, targets):
        """`prefill_logits`' arguments, targets int32 [R, C] (the token after each position)
        -> (cache, slots, Scores [R, C] of the targets)."""
        cache, slots, logits = prefill_logits(params, cache, slots, rows, tables, starts, tokens, num_valid, seeds,
                                              drawn, sampling)
        return cache, slots, scores_of(logits, targets)

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
            logits, _, view = model_of(params).forward_cached(token[:, None], view, kernels=kernels,
                                                              num_valid=active.astype(jnp.int32))
            slots = dataclasses.replace(slots, logits=jnp.where(active[:, None], logits[:, 0], slots.logits),
                                        drawn=slots.drawn + active)
            return (view, slots), pack_draws(token, scores)

        (view, slots), draws = jax.lax.scan(one_step, (cache, slots), jnp.arange(steps, dtype=jnp.int32))
        return jnp.swapaxes(draws, 0, 1), dataclasses.replace(view, page_table=table), slots

    return EnginePrograms(prefill, prefill_scored, decode)
