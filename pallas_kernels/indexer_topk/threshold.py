"""Exact top-k by threshold search: no sort over the row, only passes that count and compact.

The scores of one row (one query) are viewed through an order-preserving map to uint32 keys
(`float_to_key`), so "the k-th largest score" is an integer we can bracket and bisect.

1. **Sample.** Every few tiles of the row are sampled; the sample's order statistics give
   the first pass's edges, placed where about 2.5k down to 0.5k scores of the row are
   expected to be larger (plus an edge at the lowest valid score, so a bad sample costs a
   pass, never correctness).
2. **Count and refine.** A counting pass counts, per chunk of the row, the scores >= each of
   `num_edges` edges; the bracket becomes [lo, hi) with lo the highest edge reached by >= k
   scores and hi the next edge (reached by fewer than k). While more than `cap` scores are
   >= lo, another pass splits [lo, hi) evenly in key space (the bracket shrinks by
   `num_edges` per pass). The loop ends when <= cap scores are >= lo, or when hi = lo + 1
   (lo is then exactly the k-th largest score and only ties at lo are left). On indexer
   scores one pass is the rule.
3. **Compact.** One pass writes the positions of the scores >= hi ("above", fewer than k, in
   position order) to candidate slots [0, n_above), then those in [lo, hi) in position order
   after them, dropping what does not fit in `cap` slots. Because ties at lo are kept in
   position order, the lower-t-wins rule holds exactly.
4. **Order.** The <= cap candidates are sorted by (descending score, ascending t); the first
   k are the answer, -1 where fewer than k scores are valid.

The counting and compaction passes are pluggable (`count_fn`, `compact_fn`): the Pallas
implementations of each backend supply kernels, and the plain-jnp versions here define them.
`select_topk` runs over a scores array; `select_topk_from` over any `RowSource`, which need not
hold the scores at all: the GPU's fused source recomputes each pass's scores from the queries
and keys inside its count and compact kernels (no [S, T] scores in memory).
Scores of masked keys are -inf. All comparisons are float comparisons, so -0.0 and +0.0 are
the same score (as in the reference).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._common import normalize_zero

#: Edges per counting pass (the bracket shrinks by this factor per pass).
NUM_EDGES = 8
#: Sample size, as the expected rank in the sample of the row's k-th largest score.
SAMPLE_RANK = 16
#: Bound on refinement passes: 32 key bits, log2(NUM_EDGES) bits per pass, plus slack.
MAX_PASSES = 12
_SIGN = np.uint32(0x80000000)
_INT32_MAX = jnp.iinfo(jnp.int32).max

#: count_fn(scores f32 [R, T], edges f32 [R, E], active bool [R]) -> int32 [R, C, E]:
#:   per chunk c of the row, the number of scores >= each edge (rows not active may be 0).
CountFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
#: compact_fn(scores [R, T], lo f32 [R], hi f32 [R], above_offset int32 [R, C],
#:            between_offset int32 [R, C], cap) -> int32 [R, cap] positions, -1 where empty.
CompactFn = Callable[..., jax.Array]


def float_to_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest; -0.0 below +0.0)."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(u >= _SIGN, ~u, u | _SIGN)


def key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of `float_to_key`."""
    u = jnp.where(key >= _SIGN, key & np.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(u, jnp.float32)


#: The smallest key of a finite float (-FLT_MAX): ">= MIN_VALID" means "not masked" (a numpy
#: constant: importing the module starts no jax backend).
MIN_VALID_KEY = np.uint32(0x007FFFFF + 1)
#: The key just above +inf (a NaN pattern no score reaches).
ABOVE_INF_KEY = np.uint32(0xFF800000 + 1)


def chunk_count(num_keys: int, chunk: int) -> int:
    return -(-num_keys // chunk)


def count_xla(scores: jax.Array, edges: jax.Array, active: jax.Array, *, chunk: int) -> jax.Array:
    """Plain-jnp `CountFn`: scores [R, T], edges [R, E] -> int32 [R, ceil(T / chunk), E]."""
    del active
    rows, num_keys = scores.shape
    n = chunk_count(num_keys, chunk)
    padded = jnp.pad(scores, ((0, 0), (0, n * chunk - num_keys)), constant_values=-jnp.inf)
    ge = padded.reshape(rows, n, chunk, 1) >= edges[:, None, None, :]
    return jnp.sum(ge, axis=2, dtype=jnp.int32)


def compact_xla(scores: jax.Array, lo: jax.Array, hi: jax.Array, above_offset: jax.Array,
                between_offset: jax.Array, cap: int) -> jax.Array:
    """Plain-jnp `CompactFn` by running counts and a binary search per candidate slot.

    scores [R, T]; lo, hi f32 [R]; the offsets [R, C] give each chunk's first slot of its
    "above" (>= hi) and "between" ([lo, hi)) scores -> int32 [R, cap] positions, -1 if empty."""
    num_keys = scores.shape[1]
    above = scores >= hi[:, None]
    between = (scores >= lo[:, None]) & ~above
    run_above = jnp.cumsum(above, axis=1, dtype=jnp.int32)           # [R, T] inclusive
    run_between = jnp.cumsum(between, axis=1, dtype=jnp.int32)
    n_above = run_above[:, -1:]
    n_between = run_between[:, -1:]
    del above_offset, between_offset                                   # implied by the running counts
    slot = lax.broadcasted_iota(jnp.int32, (scores.shape[0], cap), 1)
    in_above = slot < n_above
    target = jnp.where(in_above, slot + 1, slot - n_above + 1)        # the target-th of its class
    filled = in_above | (target <= n_between)

    def first_reaching(running: jax.Array, goal: jax.Array) -> jax.Array:
        """Smallest t with running[t] >= goal, by bisection (running is nondecreasing)."""
        lo_t = jnp.zeros_like(goal)
        hi_t = jnp.full_like(goal, num_keys - 1)

        def step(_, bounds):
            a, b = bounds
            mid = (a + b) // 2
            ok = jnp.take_along_axis(running, mid, axis=1) >= goal
            return jnp.where(ok, a, mid + 1), jnp.where(ok, mid, b)

        a, _ = lax.fori_loop(0, max(1, num_keys.bit_length()), step, (lo_t, hi_t))
        return a

    t_above = first_reaching(run_above, target)
    t_between = first_reaching(run_between, target)
    pos = jnp.where(in_above, t_above, t_between)
    return jnp.where(filled, pos, -1).astype(jnp.int32)


class RowSource(Protocol):
    """The rows a threshold selection runs over: R rows of num_keys scores each (-inf = masked),
    seen only through these passes.

    count(edges f32 [R, E], active bool [R]) -> int32 [R, C, E]: per chunk, scores >= each edge.
    compact(lo f32 [R], hi f32 [R], above_offset int32 [R, C], between_offset int32 [R, C], cap)
        -> (positions int32 [R, cap], -1 where empty; their scores f32 [R, cap]).
    sample(tile, stride) -> f32 [R, n]: the scores of keys [j tile, (j + 1) tile) for every
        stride-th j (-inf past num_keys)."""

    rows: int
    num_keys: int

    def count(self, edges: jax.Array, active: jax.Array) -> jax.Array: ...

    def compact(self, lo: jax.Array, hi: jax.Array, above_offset: jax.Array, between_offset: jax.Array,
                cap: int) -> tuple[jax.Array, jax.Array]: ...

    def sample(self, tile: int, stride: int) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class ScoreRows:
    """A `RowSource` over a scores array f32 [R, T] and a backend's count / compact passes."""

    scores: jax.Array
    count_fn: CountFn
    compact_fn: CompactFn

    @property
    def rows(self) -> int:
        return self.scores.shape[0]

    @property
    def num_keys(self) -> int:
        return self.scores.shape[1]

    def count(self, edges, active):
        return self.count_fn(self.scores, edges, active)

    def compact(self, lo, hi, above_offset, between_offset, cap):
        cand = self.compact_fn(self.scores, lo, hi, above_offset, between_offset, cap)
        return cand, jnp.take_along_axis(self.scores, jnp.maximum(cand, 0), axis=1)

    def sample(self, tile, stride):
        rows, num_keys = self.scores.shape
        n_tiles = chunk_count(num_keys, tile)
        padded = jnp.pad(self.scores, ((0, 0), (0, n_tiles * tile - num_keys)), constant_values=-jnp.inf)
        return padded.reshape(rows, n_tiles, tile)[:, ::stride].reshape(rows, -1)


def _edges(lo: jax.Array, hi: jax.Array, num_edges: int) -> jax.Array:
    """uint32 [R] bracket -> uint32 [R, E]: lo, then (hi - lo) / E steps (>= 1), capped at hi."""
    span = hi - lo
    step = jnp.maximum(span // np.uint32(num_edges), np.uint32(1))
    j = jnp.arange(num_edges, dtype=jnp.uint32)
    offset = jnp.minimum(j[None, :] * step[:, None], span[:, None])
    return lo[:, None] + offset


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x, axis=-1) - x


def initial_edges(src: RowSource, k: int, num_edges: int, *, tile: int = 128,
                  sample_rank: int = SAMPLE_RANK) -> jax.Array:
    """First-pass edges from a sample: uint32 [R, E], nondecreasing, edge 0 = MIN_VALID_KEY.

    Every `stride`-th tile of `tile` scores is sampled, with the stride chosen so that the
    k-th largest score of the row is expected near rank `sample_rank` of the sample; edges 1..
    E-1 sit at sample ranks from 2.5x down to 0.5x that, i.e. where about 2.5k .. 0.5k scores
    of the row are expected to be larger. Edge 0 covers every valid score, so the pass stays
    correct whatever the sample says; a poor sample only costs another pass."""
    rows, num_keys = src.rows, src.num_keys
    stride = max(1, min(k // sample_rank, chunk_count(num_keys, tile)))
    sample = src.sample(tile, stride)
    expected = k * sample.shape[1] / max(num_keys, 1)          # rank of the k-th largest
    ranks = [expected * (2.5 - 2.0 * i / (num_edges - 2)) for i in range(num_edges - 1)]
    ranks = [min(max(int(r), 1), sample.shape[1]) for r in ranks]
    top = lax.top_k(sample, max(ranks))[0]                              # descending
    picked = top[:, jnp.asarray(ranks) - 1]                             # ascending values
    keys = jnp.maximum(float_to_key(picked), MIN_VALID_KEY)
    first = jnp.broadcast_to(MIN_VALID_KEY, (rows, 1))
    return lax.cummax(jnp.concatenate([first, keys], axis=1), axis=1)


def select_topk(scores: jax.Array, topk: int, *, count_fn: CountFn, compact_fn: CompactFn,
                cap: int | None = None, num_edges: int = NUM_EDGES,
                sample_rank: int = SAMPLE_RANK) -> jax.Array:
    """Exact top-k of each row of `scores` by threshold search (see the module docstring).

    scores float32 [R, T] (-inf = masked) -> int32 [R, topk] ordered by descending
    score then ascending position, -1 in the trailing slots when fewer than topk are valid."""
    return select_topk_from(ScoreRows(scores, count_fn, compact_fn), topk, cap=cap, num_edges=num_edges,
                            sample_rank=sample_rank)


def select_topk_from(src: RowSource, topk: int, *, cap: int | None = None, num_edges: int = NUM_EDGES,
                     sample_rank: int = SAMPLE_RANK) -> jax.Array:
    """`select_topk` over the rows of a `RowSource` -> int32 [R, topk]."""
    rows, num_keys = src.rows, src.num_keys
    k = min(topk, num_keys)
    cap = int(cap or max(2 * k, 64))

    def refine(state, edges):
        lo, hi, lo_chunks, hi_chunks, done, passes = state
        per_chunk = src.count(key_to_float(edges), ~done)                 # [R, C, E]
        counts = per_chunk.sum(axis=1)                                    # [R, E], nonincreasing
        j = jnp.maximum(jnp.sum(counts >= k, axis=1) - 1, 0)              # highest edge reached by k
        has_next = j + 1 < num_edges
        nxt = jnp.minimum(j + 1, num_edges - 1)
        edge_at = lambda i: jnp.take_along_axis(edges, i[:, None], axis=1)[:, 0]
        chunks_at = lambda i: jnp.take_along_axis(per_chunk, i[:, None, None], axis=2)[..., 0]
        new_lo, new_lo_chunks = edge_at(j), chunks_at(j)
        new_hi = jnp.where(has_next, edge_at(nxt), hi)
        new_hi_chunks = jnp.where(has_next[:, None], chunks_at(nxt), hi_chunks)
        n_lo = new_lo_chunks.sum(axis=1)
        finished = (n_lo <= cap) | (new_hi - new_lo <= 1) | (n_lo < k)
        keep = done[:, None]
        return (jnp.where(done, lo, new_lo), jnp.where(done, hi, new_hi),
                jnp.where(keep, lo_chunks, new_lo_chunks), jnp.where(keep, hi_chunks, new_hi_chunks),
                done | finished, passes + 1)

    # The bracket starts as [MIN_VALID, +inf]: the key above +inf is a NaN pattern, which no
    # score reaches, so the "above" class starts empty.
    lo = jnp.full((rows,), MIN_VALID_KEY, jnp.uint32)
    hi = jnp.full((rows,), ABOVE_INF_KEY, jnp.uint32)
    edges = initial_edges(src, k, num_edges, sample_rank=sample_rank)
    chunk_shape = jax.eval_shape(src.count, key_to_float(edges), jnp.ones((rows,), bool))
    zeros = jnp.zeros(chunk_shape.shape[:2], jnp.int32)
    state = refine((lo, hi, zeros, zeros, jnp.zeros((rows,), bool), jnp.int32(0)), edges)
    state = lax.while_loop(lambda s: ~jnp.all(s[4]) & (s[5] < MAX_PASSES),
                           lambda s: refine(s, _edges(s[0], s[1], num_edges)), state)
    lo, hi, lo_chunks, hi_chunks, _, _ = state

    above_offset = _exclusive_cumsum(hi_chunks)
    between_chunks = lo_chunks - hi_chunks
    between_offset = hi_chunks.sum(axis=1, keepdims=True) + _exclusive_cumsum(between_chunks)
    cand, cand_scores = src.compact(key_to_float(lo), key_to_float(hi), above_offset, between_offset, cap)

    valid = cand >= 0
    cand_scores = normalize_zero(cand_scores)
    neg = jnp.where(valid, -cand_scores, jnp.inf)
    t_key = jnp.where(valid, cand, _INT32_MAX)
    _, t_sorted = lax.sort((neg, t_key), dimension=1, num_keys=2)
    out = t_sorted[:, :k]
    out = jnp.where(out == _INT32_MAX, -1, out).astype(jnp.int32)
    if topk > k:
        out = jnp.pad(out, ((0, 0), (0, topk - k)), constant_values=-1)
    return out
