"""How a token is drawn from logits: `SamplingParams` and the filters it names.

The filters apply in the order Hugging Face transformers applies its logits warpers, each to
the distribution the previous one left (renormalised):

    temperature -> top_k -> top_p -> min_p

* temperature T: logits / T; T == 0 is greedy (argmax, lowest id on ties; the other fields
  then do nothing).
* top_k k: keep the k most likely tokens (0: off).
* top_p p: keep the smallest most-likely-first set whose mass reaches p (the nucleus; 1: off).
* min_p m: keep the tokens whose probability is >= m times the most likely one's (0: off).

The most likely token always survives. Speculative decoding draws and verifies with the same
`sampling_probs`, so rejection sampling stays exact under every setting.

Per-row settings: `SamplingParams.stack([...])` holds one setting per batch row ([B] leaves);
the filters and `sample_tokens` broadcast a leaf of shape [B] over logits [B, ..., V], so one
compiled program serves any mix of settings in a batch. `sample_tokens` also takes one key
per row ([B] keys), so each row draws from its own stream whatever rows share the batch.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class SamplingError(ValueError):
    """A sampling field out of its range; `field`, `rule` and `value` say which and why."""

    def __init__(self, field: str, rule: str, value):
        super().__init__(f"{field} must be {rule}, got {value!r}")
        self.field, self.rule, self.value = field, rule, value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One sampling setting, a pytree of four scalars (or, from `stack`, four [B] arrays: one
    setting per batch row).

    Built from Python numbers it is validated (SamplingError naming the field); inside jit its
    leaves are traced, so one compiled program serves every setting."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        checks = (("temperature", lambda v: v >= 0, ">= 0 (0 = greedy)"),
                  ("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
                  ("top_k", lambda v: v >= 0 and float(v).is_integer(), "an integer >= 0 (0 = off)"),
                  ("min_p", lambda v: 0 <= v < 1, "in [0, 1) (0 = off)"))
        for name, ok, rule in checks:
            value = getattr(self, name)
            if isinstance(value, numbers.Number) and not ok(value):
                raise SamplingError(name, rule, value)

    @property
    def greedy(self) -> bool:
        """Whether this (concrete) setting is greedy decoding."""
        return self.temperature == 0

    def as_arrays(self) -> "SamplingParams":
        """The same setting with float32 / int32 array leaves (what a jitted call takes)."""
        return SamplingParams(temperature=jnp.float32(self.temperature), top_p=jnp.float32(self.top_p),
                              top_k=jnp.int32(self.top_k), min_p=jnp.float32(self.min_p))

    @staticmethod
    def stack(settings: Sequence["SamplingParams"]) -> "SamplingParams":
        """One setting per batch row: leaves float32 / int32 numpy [B] (each setting validated)."""
        if not settings:
            raise ValueError("SamplingParams.stack needs at least one setting")
        column = lambda name, dtype: np.array([getattr(p, name) for p in settings], dtype)  # noqa: E731
        return SamplingParams(temperature=column("temperature", np.float32), top_p=column("top_p", np.float32),
                              top_k=column("top_k", np.int32), min_p=column("min_p", np.float32))


GREEDY = SamplingParams()


def _against(value, logits: jnp.ndarray, dtype) -> jnp.ndarray:
    """A setting's leaf (a scalar, or [B] for per-row settings) shaped to broadcast over logits [B, ..., V]."""
    value = jnp.asarray(value, dtype)
    return value.reshape(value.shape + (1,) * (logits.ndim - value.ndim))


def filtered_logits(logits: jnp.ndarray, params: SamplingParams) -> jnp.ndarray:
    """logits [..., V] -> float32 tempered logits, -inf outside what top_k, top_p and min_p keep.

    params: scalar leaves, or [B] leaves for logits [B, ..., V] (one setting per row).
    params.temperature must be > 0 here (greedy is handled by `sample_tokens` / `sampling_probs`)."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(_against(params.temperature, logits, jnp.float32), 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)           # most likely first
    rank = jnp.arange(ranked.shape[-1])
    top_k = _against(params.top_k, logits, jnp.int32)
    keep = (rank < top_k) | (top_k <= 0)
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
    keep &= jnp.cumsum(probs, axis=-1) - probs < _against(params.top_p, logits, jnp.float32)   # mass before
    # min_p compares with the most likely token: a ratio, so the renormalisation does not matter.
    keep &= probs >= _against(params.min_p, logits, jnp.float32) * probs[..., :1]
    keep = keep.at[..., 0].set(True)
    mask = jnp.zeros_like(keep).at[tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep)
    return jnp.where(mask, scaled, -jnp.inf)


def sample_tokens(logits: jnp.ndarray, key: jax.Array, params: SamplingParams) -> jnp.ndarray:
    """logits [B, V] -> int32 [B]; greedy (argmax, lowest id on ties) where temperature == 0.

    key: one key for the batch, or [B] typed keys (row b draws from key[b] alone); params: scalar
    leaves or [B] leaves (one setting per row)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filtered_logits(logits, params)
    if key.ndim == 1 and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        sampled = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, filtered)
    else:
        sampled = jax.random.categorical(key, filtered, axis=-1)
    return jnp.where(_against(params.temperature, greedy, jnp.float32) > 0, sampled.astype(jnp.int32), greedy)


def sampling_probs(logits: jnp.ndarray, params: SamplingParams) -> jnp.ndarray:
    """float32 [..., V]: the distribution a token is drawn from (softmax of the filtered logits;
    one-hot argmax when temperature == 0). Target and draft both use it."""
    soft = jax.nn.softmax(filtered_logits(logits, params), axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(_against(params.temperature, logits, jnp.float32) > 0, soft, hard)
