"""What the serving engine keeps per slot on the device (`SlotState`) and the log-probabilities
its programs report (`Scores`): the prefill installs a request in its slot and may score the
prompt, the decode draws from the slot and scores the draw.

Log-probabilities are the model's own: log_softmax of the raw logits, BEFORE temperature and
the top_k / top_p / min_p filters (what vLLM and OpenAI report by default), whatever the
request's sampling setting. Every request takes the same MAX_LOGPROBS alternatives from the
same compiled programs, so asking for a different count never recompiles.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm_jax.decoding.sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What each of the B slots carries on the device between steps."""

    logits: jnp.ndarray           # float32 [B, V]: the distribution the slot's next token is drawn from
    seeds: jnp.ndarray            # uint32 [B]: the request's seed
    drawn: jnp.ndarray            # int32 [B]: tokens the request has drawn so far (its key = (seed, drawn))
    sampling: SamplingParams      # [B] leaves

    def installed(self, rows: jnp.ndarray, logits, seeds, drawn, sampling: SamplingParams) -> "SlotState":
        """Slots rows int32 [R] (B: none, dropped) set to logits [R, V], seeds, drawn, sampling [R]."""
        put = lambda old, new: old.at[rows].set(new.astype(old.dtype), mode="drop")  # noqa: E731
        return SlotState(put(self.logits, logits), put(self.seeds, seeds), put(self.drawn, drawn),
                         jax.tree.map(put, self.sampling, sampling))


def empty_slots(batch: int, vocab: int) -> SlotState:
    return SlotState(jnp.zeros((batch, vocab), jnp.float32), jnp.zeros((batch,), jnp.uint32),
                     jnp.zeros((batch,), jnp.int32),
                     jax.tree.map(jnp.asarray, SamplingParams.stack([SamplingParams()] * batch)))


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
