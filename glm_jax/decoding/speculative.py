"""MTP speculative decoding in one jitted `jax.lax.while_loop`.

State between iterations, per sequence (n = target cache length):
  pending   the last emitted token t_n, not yet fed to the target
  draft 1   MTP logits / normed hidden / indexer choice at position n-1, computed from the
            target's hidden h_{n-1} and t_n (it is the last row of the previous MTP extend)
Each iteration:
  1. draft: d_1 ~ q_1; steps j = 2..K apply the MTP layer again (shared parameters) to its own
     normed hidden and d_{j-1}. With KVShare (default) they reuse step 1's indices, so they run
     no indexer and read only KV computed from target hidden states; without it every step
     writes its KV and runs the MTP indexer over a cache that mixes target and draft KV.
  2. verify: one target forward over [t_n, d_1..d_K] (K+1 positions) -> p_0..p_K.
  3. accept: `rejection_sample` (exact; greedy when temperature == 0), or the base rule
     `match_sample` (verification="match"; exact too, accepts less often when sampling).
  4. draft extend: the MTP layer runs over the K+1 verified positions with the target's hidden
     states and the emitted tokens, refreshing its cache; the row of the last accepted position
     is the next iteration's draft step 1.
Sequences in a batch accept different numbers of tokens; all positions are per sequence.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from glm_jax.cache import KVCache, create_mtp_cache
from glm_jax.decoding.programs import ParamLayout, program
from glm_jax.decoding.runtime import DecodeRuntime, DecodeStats, cut, round_up
from glm_jax.decoding.rejection import VERIFICATION_RULES, match_sample, rejection_sample
from glm_jax.decoding.sampling import GREEDY, SamplingParams, sampling_probs
from glm_jax.forward_options import ForwardOptions
from glm_jax.multihost import to_host


def _sample(key, probs):
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def draft(model, q1_logits, g1, idx1, mtp_cache: KVCache, key, sampling: SamplingParams, *, num_draft: int,
          kv_share: bool, forward: ForwardOptions):
    """K draft tokens from draft step 1's outputs (q1_logits [B, V], g1 [B, hidden], idx1 [B, 1, topk]).

    -> (draft_tokens int32 [B, K], draft_probs [B, K, V])."""
    probs = [sampling_probs(q1_logits, sampling)]
    keys = jax.random.split(key, num_draft)
    tokens = [_sample(keys[0], probs[0])]
    hidden = g1[:, None]
    cache = mtp_cache
    for j in range(1, num_draft):
        positions = (mtp_cache.lengths + j - 1)[:, None]
        if kv_share:
            logits, hidden = model.mtp_draft_step(tokens[-1][:, None], hidden, positions, mtp_cache, idx1,
                                                  options=forward)
        else:
            logits, hidden, cache, _ = model.mtp_forward_cached(tokens[-1][:, None], hidden, cache, options=forward)
        probs.append(sampling_probs(logits[:, 0], sampling))
        tokens.append(_sample(keys[j], probs[-1]))
    return jnp.stack(tokens, axis=1), jnp.stack(probs, axis=1)


@program(static_argnames=("layout", "forward", "num_draft", "kv_share", "max_new", "verification"),
         donate_argnames=("cache", "mtp_cache"))
def _speculate(layout: ParamLayout, params: tuple, cache, mtp_cache, logits, hidden, key, sampling: SamplingParams, eos,
               *, forward: ForwardOptions, num_draft, kv_share, max_new, verification="rejection"):
    """Everything after the prefill: first token, draft step 1, then the while_loop.

    logits [B, V] / hidden [B, hidden]: the target's outputs at the last prompt position.
    -> (tokens int32 [B, max_new + K + 1] (-1 past the end), count [B], verify steps [B],
        accepted [B], accepted_at [K], cache, mtp_cache)."""
    model = layout.model(params)
    b = logits.shape[0]
    k = num_draft
    key, sub = jax.random.split(key)
    first = _sample(sub, sampling_probs(logits, sampling))
    q1, g1, mtp_cache, idx1 = model.mtp_forward_cached(first[:, None], hidden[:, None], mtp_cache, options=forward)
    out = jnp.full((b, max_new + k + 1), -1, jnp.int32).at[:, 0].set(first)
    rows = jnp.arange(b)[:, None]

    def cond(c):
        return jnp.any(~c["done"])

    def body(c):
        key, k_draft, k_verify = jax.random.split(c["key"], 3)
        d_tokens, d_probs = draft(model, c["q1"], c["g1"], c["idx1"], c["mtp_cache"], k_draft, sampling,
                                  num_draft=k, kv_share=kv_share, forward=forward)
        n = c["cache"].lengths
        verify_in = jnp.concatenate([c["pending"][:, None], d_tokens], axis=1)
        v_logits, v_hidden, cache = model.forward_cached(verify_in, c["cache"], options=forward)
        p = sampling_probs(v_logits, sampling)
        emitted, accepted = (rejection_sample(p, d_probs, d_tokens, k_verify) if verification == "rejection"
                             else match_sample(p, d_tokens, k_verify))
        cache = dataclasses.replace(cache, lengths=n + accepted + 1)
        q, g, mtp_cache, idx = model.mtp_forward_cached(jnp.maximum(emitted, 0), v_hidden, c["mtp_cache"],
                                                        options=forward)
        mtp_cache = dataclasses.replace(mtp_cache, lengths=c["mtp_cache"].lengths + accepted + 1)
        at = accepted[:, None, None]
        active = ~c["done"]
        slots = jnp.where(active[:, None] & (emitted >= 0), c["count"][:, None] + jnp.arange(k + 1), out.shape[1])
        new_out = c["out"].at[rows, slots].set(emitted, mode="drop")
        count = c["count"] + jnp.where(active, accepted + 1, 0)
        hit_eos = jnp.any((emitted == eos) & (emitted >= 0), axis=1)
        return dict(
            cache=cache, mtp_cache=mtp_cache, key=key, out=new_out, count=count,
            pending=jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0],
            q1=jnp.take_along_axis(q, at, axis=1)[:, 0], g1=jnp.take_along_axis(g, at, axis=1)[:, 0],
            idx1=jnp.take_along_axis(idx, at, axis=1),
            done=c["done"] | (count >= max_new) | hit_eos,
            steps=c["steps"] + active.astype(jnp.int32),
            accepted=c["accepted"] + jnp.where(active, accepted, 0),
            accepted_at=c["accepted_at"] + jnp.sum(
                (active[:, None] & (jnp.arange(k)[None, :] < accepted[:, None])).astype(jnp.int32), axis=0),
        )

    init = dict(cache=cache, mtp_cache=mtp_cache, key=key, out=out, count=jnp.ones((b,), jnp.int32),
                pending=first, q1=q1[:, 0], g1=g1[:, 0], idx1=idx1, done=(first == eos) | (max_new <= 1),
                steps=jnp.zeros((b,), jnp.int32), accepted=jnp.zeros((b,), jnp.int32),
                accepted_at=jnp.zeros((k,), jnp.int32))
    final = jax.lax.while_loop(cond, body, init)
    return (final["out"], final["count"], final["steps"], final["accepted"], final["accepted_at"],
            final["cache"], final["mtp_cache"])


class SpeculativeGenerator(DecodeRuntime):
    """Speculative decoding with the model's MTP layer as the draft model."""

    def __init__(self, model, *, batch: int = 1, max_len: int | None = None, num_draft: int = 3,
                 kv_share: bool = True, verification: str = "rejection", prefill_chunk: int = 256,
                 forward: ForwardOptions = ForwardOptions(), mesh=None, collective: str = "permute",
                 cuda_graphs: bool = False, kv_cache_dtype: str = "auto"):
        if model.mtp is None:
            raise ValueError("speculative decoding needs the model's MTP layer (num_nextn_predict_layers: 1)")
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        if verification not in VERIFICATION_RULES:
            raise ValueError(f"verification must be one of {VERIFICATION_RULES}, got {verification!r}")
        super().__init__(model, batch=batch, max_len=max_len, prefill_chunk=prefill_chunk, forward=forward,
                         mesh=mesh, collective=collective, cuda_graphs=cuda_graphs, mtp=True,
                         kv_cache_dtype=kv_cache_dtype)
        self.num_draft, self.kv_share, self.verification = num_draft, kv_share, verification
        self.stats = DecodeStats()

    def generate(self, prompt_ids, *, max_new_tokens: int, sampling: SamplingParams = GREEDY,
                 seed: int = 0, stop_token: int | None = None, progress=None) -> np.ndarray:
        """prompt_ids: see `DecodeRuntime._prompt_batch` -> int32 [B, max_new_tokens]
        (-1 where a sequence stopped early)."""
        padded, lengths = self._prompt_batch(prompt_ids, max_new_tokens)
        b, p = padded.shape
        k, chunk = self.num_draft, self.prefill_chunk
        cache_len = self.cache_rows(max(round_up(p, chunk), p + max_new_tokens + 2 * (k + 1)))
        cache = self.new_cache(b, cache_len)
        mtp_cache = self.put_replicated(create_mtp_cache(self.cfg, b, cache_len, self.cache_dtype))
        t0 = time.perf_counter()
        logits, hidden, cache, mtp_cache = self.prefill(cache, padded, lengths, progress, mtp_cache)
        logits.block_until_ready()
        t1 = time.perf_counter()
        key, sampling = self.sampling_args(seed, sampling)
        eos = self.put(np.int32(-1 if stop_token is None else stop_token))
        program = self.compiled(_speculate, (self.params, cache, mtp_cache, logits, hidden, key, sampling, eos),
                                forward=self.forward, num_draft=k, kv_share=self.kv_share, max_new=max_new_tokens,
                                verification=self.verification)
        t2 = time.perf_counter()
        out, count, steps, accepted, accepted_at, _, _ = program(self.params, cache, mtp_cache, logits, hidden, key,
                                                                 sampling, eos)
        out, steps, accepted, accepted_at = map(to_host, (out, steps, accepted, accepted_at))
        out = out[:, :max_new_tokens]
        t3 = time.perf_counter()
        new = int(np.sum(out >= 0))
        self.stats = DecodeStats(prompt_tokens=int(lengths.sum()), prefill_s=t1 - t0, new_tokens=new,
                                 compile_s=t2 - t1, decode_s=t3 - t1, steady_tokens=new, steady_s=t3 - t2,
                                 verify_steps=int(np.sum(steps)), accepted=int(np.sum(accepted)),
                                 accepted_at=accepted_at, steps_per_sequence=steps, accepted_per_sequence=accepted)
        return out

    def completions(self, prompt_ids, *, stop_token: int | None = None, **generate) -> Iterator[list[list[int]]]:
        """`generate`'s tokens, cut before the stop token (`runtime.cut`): yields them once, B lists."""
        yield [cut(row, stop_token) for row in self.generate(prompt_ids, stop_token=stop_token, **generate)]
