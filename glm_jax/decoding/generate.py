"""Generation from a KV cache: chunked prefill, then blocks of jitted decode steps.

    gen = Generator(model, batch=1, max_len=2048)
    for tokens in gen.generate(prompt_ids, max_new_tokens=200): ...   # yields [B, n] blocks

Each prefill chunk and each block of `block_size` decode steps is one jitted call with the
cache donated, so it is updated in place; the Python loop runs once per block, not per layer.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from glm_jax.cache import KVCache
from glm_jax.decoding.programs import ParamLayout, program
from glm_jax.decoding.runtime import DecodeRuntime, DecodeStats, cut, round_up, stops
from glm_jax.decoding.sampling import GREEDY, SamplingParams, sample_tokens
from glm_jax.forward_options import ForwardOptions
from glm_jax.multihost import to_host


@program(static_argnames=("layout", "forward", "steps"), donate_argnames=("cache",))
def decode_block(layout: ParamLayout, params: tuple, cache: KVCache, logits, key, sampling: SamplingParams,
                 forward: ForwardOptions, steps):
    """Sample from logits [B, V] by `sampling`, feed the token back, `steps` times (one jitted call);
    the model from its flat `params` (`programs.flat_params`).

    -> (tokens int32 [B, steps], logits [B, V] after the last token, cache, key)."""
    model = layout.model(params)
    batch = logits.shape[0]

    def step(i, carry):
        cache, logits, key, out = carry
        key, sub = jax.random.split(key)
        token = sample_tokens(logits, sub, sampling)
        new_logits, _, cache = model.forward_cached(token[:, None], cache, options=forward)
        return cache, new_logits[:, 0], key, out.at[:, i].set(token)

    out = jnp.zeros((batch, steps), jnp.int32)
    cache, logits, key, out = jax.lax.fori_loop(0, steps, step, (cache, logits, key, out))
    return out, logits, cache, key


class Generator(DecodeRuntime):
    """Holds one model; generates for a batch of prompts (of any lengths) from a fresh cache."""

    def __init__(self, model, *, batch: int = 1, max_len: int | None = None, prefill_chunk: int = 256,
                 block_size: int = 16, forward: ForwardOptions = ForwardOptions(), kv_cache_dtype: str = "auto",
                 mesh: Mesh | None = None, collective: str = "permute", cuda_graphs: bool = False):
        super().__init__(model, batch=batch, max_len=max_len, prefill_chunk=prefill_chunk, forward=forward,
                         mesh=mesh, collective=collective, cuda_graphs=cuda_graphs, kv_cache_dtype=kv_cache_dtype)
        self.block_size = block_size
        self.stats = DecodeStats()      # compile_s: the first decode block, which compiles the decode program

    def generate(self, prompt_ids: np.ndarray, *, max_new_tokens: int, sampling: SamplingParams = GREEDY,
                 seed: int = 0, stop_token: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Iterator[np.ndarray]:
        """prompt_ids: see `_prompt_batch` -> yields int32 numpy blocks [B, n] of new tokens.

        Stops after max_new_tokens or once every sequence has produced stop_token (the block
        holding it is the last; tokens after the stop token are the caller's to drop)."""
        padded, lengths = self._prompt_batch(prompt_ids, max_new_tokens)
        b, p = padded.shape
        # Room for whole prefill chunks and whole decode blocks (their padding rows are written).
        need = max(round_up(p, self.prefill_chunk), p + round_up(max_new_tokens, self.block_size))
        cache_len = self.cache_rows(need)
        cache = self.new_cache(b, cache_len)

        t0 = time.perf_counter()
        logits, _, cache, _ = self.prefill(cache, padded, lengths, progress)
        logits.block_until_ready()
        self.stats = DecodeStats(prompt_tokens=int(lengths.sum()), prefill_s=time.perf_counter() - t0)

        key, sampling = self.sampling_args(seed, sampling)
        produced, first, stopped = 0, 0, np.zeros((b,), bool)
        t1 = time.perf_counter()
        while produced < max_new_tokens:
            tokens, logits, cache, key = self.program(decode_block)(
                self.layout, self.params, cache, logits, key, sampling, self.forward, self.block_size)
            tokens = to_host(tokens)[:, : max_new_tokens - produced]
            produced += tokens.shape[1]
            now = time.perf_counter()
            if not first:                   # the first block compiled the decode program
                first, self.stats.compile_s = produced, now - t1
            self.stats.new_tokens, self.stats.decode_s = b * produced, now - t1
            self.stats.steady_tokens, self.stats.steady_s = b * (produced - first), now - t1 - self.stats.compile_s
            yield tokens
            stopped |= [stops(row, stop_token) for row in tokens]
            if stopped.all():
                break

    def completions(self, prompt_ids, *, stop_token: int | None = None, **generate) -> Iterator[list[list[int]]]:
        """`generate`'s tokens as each block comes, cut before the stop token (`runtime.cut`):
        yields B lists of new tokens (empty once a sequence has stopped)."""
        stopped = np.zeros((self.batch,), bool)
        for block in self.generate(prompt_ids, stop_token=stop_token, **generate):
            pieces = [[] if done else cut(row, stop_token) for row, done in zip(block, stopped)]
            stopped |= [len(piece) < len(row) for piece, row in zip(pieces, block)]
            yield pieces
