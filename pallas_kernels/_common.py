"""Helpers shared by the implementations: the knob-less and `xla` configs, key masks, top-k
padding and the GPU kernels' dots (query chunking: `pallas_kernels.chunking`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.chunking import positive_int


def check_positive_fields(config) -> None:
    """Raises ValueError naming the first int field of the dataclass `config` that is set (not
    None) but not a positive int (block sizes, chunks, warps, stages)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is not None and not isinstance(value, (bool, str)):
            positive_int(f"{type(config).__name__}.{field.name}", value, " or None")


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """The config of an implementation without tuning knobs (the references, `jax.nn` calls)."""


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """Tuning of the `xla` implementations of the indexer and of sparse MLA.

    q_chunk: queries per chunk (only one chunk's intermediates are live at a time); None:
      the largest power of two <= MAX_Q_CHUNK whose intermediates stay under
      CHUNK_BUDGET_BYTES."""

    q_chunk: int | None = None

    def __post_init__(self):
        check_positive_fields(self)


def tpu_interpret(interpret: bool):
    """The `interpret` argument of a Mosaic TPU `pallas_call`: the TPU interpreter (which also
    simulates the DMAs and semaphores) when interpret, else False (compile)."""
    return pltpu.InterpretParams() if interpret else False


def dot(a, b):
    """a [m, k] . b [k, n], accumulated in float32 (inside GPU kernels)."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nt(a, b):
    """a [m, k] . b [n, k]^T, accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a [k, m]^T . b [k, n], accumulated in float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def online_softmax_step(carry, s, values):
    """One block of an online softmax inside a kernel: carry (m [M], l [M], accs: float32 [M, cs]
    per value chunk), s float32 [M, bk] logits (-inf = masked), values: the block's value chunks
    [bk, cs] -> the new carry (m stays -inf on rows with nothing so far; their p and l are 0)."""
    m, l, accs = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use[:, None])
    alpha = jnp.exp(m - m_use)
    pc = p.astype(values[0].dtype)
    return (m_new, l * alpha + jnp.sum(p, axis=1),
            tuple(a * alpha[:, None] + dot(pc, v) for a, v in zip(accs, values)))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pads `axis` of x at the end with `value` up to `size` (no-op when already that long)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_slots(indices: jax.Array, unit: int) -> jax.Array:
    """int32 [..., K] -> [..., Kp], Kp the next multiple of unit, the new slots -1."""
    k = indices.shape[-1]
    return pad_axis(jnp.asarray(indices, jnp.int32), indices.ndim - 1, -(-k // unit) * unit, -1)


def key_mask(q_pos: jax.Array, kv_len: jax.Array, num_keys: int,
             kv_start: jax.Array | None = None) -> jax.Array:
    """q_pos int [B, S], kv_len int [B], kv_start int [B, S] or None (0) -> bool [B, S, T]:
    kv_start[b, s] <= t <= q_pos[b, s] and t < kv_len[b]."""
    t = lax.broadcasted_iota(jnp.int32, (1, 1, num_keys), 2)
    q_pos = jnp.asarray(q_pos, jnp.int32)[:, :, None]
    kv_len = jnp.asarray(kv_len, jnp.int32)[:, None, None]
    valid = (t <= q_pos) & (t < kv_len)
    if kv_start is not None:
        valid &= t >= jnp.asarray(kv_start, jnp.int32)[:, :, None]
    return valid


def start_or_zero(kv_start: jax.Array | None, q_pos: jax.Array) -> jax.Array:
    """kv_start as int32 [B, S] (zeros when None: every key from 0 on)."""
    if kv_start is None:
        return jnp.zeros(jnp.shape(q_pos), jnp.int32)
    if jnp.shape(kv_start) != jnp.shape(q_pos):
        raise ValueError(f"kv_start must have the shape of q_pos {jnp.shape(q_pos)}, got {jnp.shape(kv_start)}")
    return jnp.asarray(kv_start, jnp.int32)


def pad_topk(indices: jax.Array, topk: int) -> jax.Array:
    """int32 [..., k] with k <= topk -> int32 [..., topk], the new columns -1."""
    extra = topk - indices.shape[-1]
    if extra <= 0:
        return indices
    fill = jnp.full(indices.shape[:-1] + (extra,), -1, jnp.int32)
    return jnp.concatenate([indices, fill], axis=-1)


def normalize_zero(x: jax.Array) -> jax.Array:
    """Maps -0.0 to +0.0 so that sorting (which orders -0.0 before +0.0) treats them as equal."""
    return jnp.where(x == 0, jnp.zeros_like(x), x)


def check_topk(topk) -> int:
    """Validates the static `topk` and returns it as a Python int."""
    return positive_int("topk", topk)
