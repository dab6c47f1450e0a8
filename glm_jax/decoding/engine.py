"""A serving engine: requests of different lengths share a fixed number of batch slots and a
pool of cache pages; chunked prefill, then decode steps that are one jitted call each.

    engine = ServingEngine(model, slots=4, num_pages=64, page_size=16, max_context=512)
    results = engine.serve([Request(prompt_ids, max_new_tokens=32), ...])
    results[i].tokens / results[i].error;  engine.step_times: host time per decode step

Requests are admitted in waves of up to `slots`: each gets pages for prompt + max_new_tokens
rows from the pool (`glm_jax.cache.page_pool`); one that could never fit gets `error` (the memory
it needs) and the others run; one that does not fit now waits until earlier requests finish
and release their pages, which later requests reuse. A decode step is one jitted call on
fixed shapes (slots x page-table width, the whole pool) with the cache donated, so neither
the host work nor the compiled program changes as contexts grow.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import jax
import numpy as np

from glm_jax import ops
from glm_jax.decoding.generate import ContextTooLongError, GeneratorBase, decode_block
from glm_jax.decoding.sampling import GREEDY, SamplingParams
from glm_jax.multihost import global_array, to_host
from glm_jax.cache import CacheFullError, PagePool, shard_cache


@dataclasses.dataclass
class Request:
    prompt: np.ndarray                 # int32 [P]
    max_new_tokens: int


@dataclasses.dataclass
class Result:
    tokens: list[int] | None = None    # new tokens (up to max_new_tokens, cut at the stop token)
    error: str | None = None
    pages: list[int] = dataclasses.field(default_factory=list)   # the pool pages it used


@dataclasses.dataclass(frozen=True)
class StepTime:
    context: int          # longest sequence in the batch before the step
    host_s: float         # until the jitted call returned (host work: dispatch, no device wait)
    step_s: float         # until the new tokens were on the host


class ServingEngine(GeneratorBase):
    def __init__(self, model, *, slots: int, num_pages: int, page_size: int, max_context: int,
                 prefill_chunk: int = 64, kernels: ops.KernelChoice = ops.KernelChoice(), mesh=None,
                 collective: str = "permute"):
        super().__init__(model, batch=slots, max_len=max_context, prefill_chunk=prefill_chunk, kernels=kernels,
                         mesh=mesh, collective=collective)
        shards = 1 if mesh is None else mesh.shape.get("data", 1)
        self.pool = PagePool(self.cfg, num_pages=num_pages, page_size=page_size, data_shards=shards)
        # Room in every row's table for its longest context plus the padding of a prefill chunk.
        self.width = self.pool.pages_for(max_context + prefill_chunk)
        cache = self.pool.create_cache(slots, self.width, self.split)
        self.cache = cache if mesh is None else shard_cache(cache, mesh)
        self.step_times: list[StepTime] = []

    def _admit(self, pending: deque, results: list) -> list[tuple[int, Request]]:
        """Take requests for the next wave, in order, while slots and pages last."""
        wave: list[tuple[int, Request]] = []
        while pending and len(wave) < self.batch:
            i, req = pending[0]
            need = len(req.prompt) + req.max_new_tokens
            try:
                self.check_fits(len(req.prompt), req.max_new_tokens)
                if not self.pool.fits_ever(need):
                    self.pool.allocate(i, need, self._shard(len(wave)))   # raises, naming the memory
                if self.pool.free_pages(self._shard(len(wave))) < self.pool.pages_for(need):
                    break                                                   # wait for pages to free
                pages = self.pool.allocate(i, need, self._shard(len(wave)))
            except (ValueError, ContextTooLongError, CacheFullError) as e:
                pending.popleft()
                results[i] = Result(error=str(e))
                continue
            pending.popleft()
            results[i] = Result(pages=pages)
            wave.append((i, req))
        return wave

    def _shard(self, row: int) -> int:
        return row * self.pool.data_shards // self.batch

    def serve(self, requests: list[Request], *, sampling: SamplingParams = GREEDY, seed: int = 0,
              stop_token: int | None = None) -> list[Result]:
        results: list[Result | None] = [None] * len(requests)
        pending = deque(enumerate(requests))
        key = jax.random.key(seed)
        while pending:
            wave = self._admit(pending, results)
            if not wave:
                continue
            key, sub = jax.random.split(key)
            rows = self._run_wave(wave, self.put(sub), jax.tree.map(self.put, sampling.as_arrays()), stop_token)
            for (i, req), new in zip(wave, rows):
                results[i].tokens = new
                self.pool.release(i)
        return results

    def _run_wave(self, wave, key, sampling: SamplingParams, stop_token) -> list[list[int]]:
        ids = [i for i, _ in wave] + [None] * (self.batch - len(wave))
        prompts = [r.prompt for _, r in wave] + [np.zeros((0,), np.int32)] * (self.batch - len(wave))
        lengths = np.array([len(p) for p in prompts], np.int32)
        padded = np.zeros((self.batch, int(lengths.max())), np.int32)
        for b, p in enumerate(prompts):
            padded[b, :len(p)] = p
        cache = dataclasses.replace(
            self.cache, lengths=global_array(np.zeros((self.batch,), np.int32), self.cache.lengths.sharding),
            page_table=global_array(self.pool.page_table(ids, self.width), self.cache.page_table.sharding))
        logits, cache = self._prefill(cache, padded, lengths)
        budget = np.array([r.max_new_tokens for _, r in wave] + [0] * (self.batch - len(wave)))
        out = [[] for _ in range(self.batch)]
        done = budget == 0
        context = int(lengths.max())
        while not done.all():
            t0 = time.perf_counter()
            tokens, logits, cache, key = decode_block(self.graphdef, self.state, cache, logits, key, sampling,
                                                      self.kernels, 1)
            t1 = time.perf_counter()
            tokens = to_host(tokens)[:, 0]
            self.step_times.append(StepTime(context, t1 - t0, time.perf_counter() - t0))
            context += 1
            for b in np.flatnonzero(~done):
                if tokens[b] == stop_token:
                    done[b] = True
                    continue
                out[b].append(int(tokens[b]))
                done[b] = len(out[b]) >= budget[b]
        self.cache = cache
        return out[:len(wave)]
