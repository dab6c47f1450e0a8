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
from flax import nnx

from glm_jax import ops
from jax.sharding import Mesh

from glm_jax.cache import KVCache, LayerSplit, create_cache, shard_cache
from glm_jax.decoding.programs import compiler_options, program
from glm_jax.decoding.sampling import GREEDY, SamplingParams, sample_tokens
from glm_jax.multihost import global_array, place, replicated, to_host
from glm_jax.sharding import ShardingError, logical_sharding, shard_params


#: Cache rows per sequence are a multiple of this (`GeneratorBase.cache_rows`).
CACHE_ROWS = 128


class ContextTooLongError(ValueError):
    """The prompt plus the tokens to generate do not fit the cache / the model's context."""


@program(static_argnames=("graphdef", "kernels"), donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, tokens, num_valid, cache: KVCache, kernels):
    """tokens int32 [B, C] (padded), num_valid int32 [B] -> (logits [B, V] of the last real token, cache)."""
    model = nnx.merge(graphdef, state)
    logits, _, cache = model.forward_cached(tokens, cache, kernels=kernels, num_valid=num_valid)
    last = jnp.take_along_axis(logits, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    return last, cache


@program(static_argnames=("graphdef", "kernels", "steps"), donate_argnames=("cache",))
def decode_block(graphdef, state, cache: KVCache, logits, key, sampling: SamplingParams, kernels, steps):
    """Sample from logits [B, V] by `sampling`, feed the token back, `steps` times (one jitted call).

    -> (tokens int32 [B, steps], logits [B, V] after the last token, cache, key)."""
    model = nnx.merge(graphdef, state)
    batch = logits.shape[0]

    def step(i, carry):
        cache, logits, key, out = carry
        key, sub = jax.random.split(key)
        token = sample_tokens(logits, sub, sampling)
        new_logits, _, cache = model.forward_cached(token[:, None], cache, kernels=kernels)
        return cache, new_logits[:, 0], key, out.at[:, i].set(token)

    out = jnp.zeros((batch, steps), jnp.int32)
    cache, logits, key, out = jax.lax.fori_loop(0, steps, step, (cache, logits, key, out))
    return out, logits, cache, key


class GeneratorBase:
    """What every generator shares: the split model, the batch size, the context check, and
    the placement on a device mesh (params by the logical-axis rules; with a `layer` axis > 1
    the target cache is LayerSplit across it). cuda_graphs: on a GPU, its programs run as CUDA
    graphs, loops included (`programs.compiler_options`)."""

    def __init__(self, model, *, batch: int, max_len: int | None, prefill_chunk: int,
                 kernels: ops.KernelChoice, mesh: Mesh | None = None, collective: str = "permute",
                 cuda_graphs: bool = False):
        self.cfg = model.cfg
        # XLA options of the programs: on a GPU with cuda_graphs, CUDA graphs (`programs`)
        self.options = compiler_options(jax.default_backend(), cuda_graphs)
        self.graphdef, self.state = nnx.split(model)
        self.mesh = mesh
        self.split = None
        if mesh is not None:
            data = mesh.shape.get("data", 1)
            if batch % data:
                raise ShardingError(f"a batch of {batch} prompt(s) cannot be split over mesh axis 'data' of "
                                    f"size {data}; give a multiple of {data} prompts or use data=1")
            self.state = shard_params(self.state, mesh)
            if mesh.shape.get("layer", 1) > 1:
                self.split = LayerSplit(mesh, collective=collective)
        self.batch = batch
        self.max_len = max_len or self.cfg.max_position_embeddings
        if self.max_len > self.cfg.max_position_embeddings:
            raise ContextTooLongError(
                f"max_len {self.max_len} exceeds the model's context of "
                f"{self.cfg.max_position_embeddings} tokens (max_position_embeddings)")
        self.prefill_chunk = prefill_chunk
        self.kernels = kernels

    @staticmethod
    def cache_rows(need: int) -> int:
        """Cache rows per sequence for `need` rows: rounded up to CACHE_ROWS, so that prompts of
        nearby lengths share the compiled programs (a program is compiled per cache shape)."""
        return round_up(need, CACHE_ROWS)

    def new_cache(self, batch: int, cache_len: int, dtype=None) -> KVCache:
        """An empty target cache, LayerSplit and placed on the mesh when there is one."""
        cache = create_cache(self.cfg, batch, cache_len, dtype, split=self.split)
        return committed(cache) if self.mesh is None else shard_cache(cache, self.mesh)

    def put(self, x, names: tuple[str | None, ...] | None = None):
        """A host value as a device array; on a mesh a global array, split by the logical `names`
        of its dims (None: replicated). Every process passes the same value."""
        if self.mesh is None:
            return committed(x if isinstance(x, np.ndarray) else jnp.asarray(x))   # numpy: no jnp dispatch first
        if names is None:
            return global_array(x, replicated(self.mesh))
        return global_array(x, logical_sharding(self.mesh, names, np.shape(x), "input"))

    def call_inputs(self, values: list, names: list) -> list:
        """Host values (numpy arrays, or pytrees of them) as a jitted call's inputs, each split by
        its logical names (one tuple for all of a pytree's leaves): on a mesh global arrays
        (`put`); without one the values themselves, which the call transfers for a few
        microseconds each (a device_put costs tens)."""
        if self.mesh is None:
            return values
        return [jax.tree.map(lambda x, n=n: self.put(x, n), v) for v, n in zip(values, names)]

    def put_replicated(self, tree):
        """A pytree of arrays (e.g. the MTP cache) whole on every device of the mesh."""
        if self.mesh is None:
            return committed(tree)
        return place(tree, jax.tree.map(lambda _: replicated(self.mesh), tree))

    def sampling_args(self, seed: int, sampling: SamplingParams):
        """(key, sampling as arrays) on the device; the same key on every process."""
        return self.put(jax.random.key(seed)), jax.tree.map(self.put, sampling.as_arrays())

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        need = prompt_len + max_new_tokens
        if prompt_len == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if need > self.max_len:
            raise ContextTooLongError(
                f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {need} exceeds the "
                f"context of {self.max_len} tokens; shorten the prompt or lower --max-new-tokens")

    def _prompt_batch(self, prompts, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """prompts: int [P], int [B, P], or a list of B int sequences of any lengths
        -> (padded int32 [B, P_max], lengths int32 [B]), checked against the batch and the context."""
        if isinstance(prompts, np.ndarray) or (len(prompts) and np.isscalar(prompts[0])):
            arr = np.asarray(prompts, np.int32)
            rows = [arr] if arr.ndim == 1 else list(arr)
        else:
            rows = [np.asarray(r, np.int32).reshape(-1) for r in prompts]
        if len(rows) != self.batch:
            raise ValueError(f"batch of {len(rows)} prompts, but the generator was built for {self.batch}")
        lengths = np.array([len(r) for r in rows], np.int32)
        for n in lengths:
            self.check_fits(int(n), max_new_tokens)
        padded = np.zeros((len(rows), int(lengths.max())), np.int32)
        for i, r in enumerate(rows):
            padded[i, :len(r)] = r
        return padded, lengths

    def prefill(self, cache: KVCache, padded: np.ndarray, lengths: np.ndarray, progress=None):
        """Chunked prefill of padded int32 [B, P] (real lengths [B]), one jitted call per chunk
        -> (logits float32 [B, V] after each row's last prompt token, cache)."""
        logits = None
        for start, tokens, num_valid in self._chunks(padded, lengths):
            last, cache = _prefill_chunk.with_options(self.options)(
                self.graphdef, self.state, self.put(tokens, ("batch", None)), self.put(num_valid, ("batch",)), cache,
                self.kernels)
            logits = last if logits is None else jnp.where(self.put((num_valid > 0)[:, None]), last, logits)
            if progress is not None:
                progress(min(start + self.prefill_chunk, padded.shape[1]), padded.shape[1])
        return logits, cache

    def _chunks(self, padded: np.ndarray, lengths: np.ndarray):
        """Prefill chunks: yields (start, tokens int32 [B, C] zero-padded, real tokens per row [B])."""
        c = self.prefill_chunk
        for start in range(0, padded.shape[1], c):
            tokens = np.zeros((padded.shape[0], c), np.int32)
            piece = padded[:, start:start + c]
            tokens[:, :piece.shape[1]] = piece
            yield start, tokens, np.clip(lengths - start, 0, c).astype(np.int32)


class Generator(GeneratorBase):
    """Holds one model; generates for a batch of prompts (of any lengths) from a fresh cache."""

    def __init__(self, model, *, batch: int = 1, max_len: int | None = None, prefill_chunk: int = 256,
                 block_size: int = 16, kernels: ops.KernelChoice = ops.KernelChoice(), cache_dtype=None,
                 mesh: Mesh | None = None, collective: str = "permute", cuda_graphs: bool = False):
        super().__init__(model, batch=batch, max_len=max_len, prefill_chunk=prefill_chunk, kernels=kernels,
                         mesh=mesh, collective=collective, cuda_graphs=cuda_graphs)
        self.block_size = block_size
        self.cache_dtype = cache_dtype
        # prompt_tokens, prefill_s, new_tokens (per sequence), decode_s and first_block_s /
        # first_block_tokens: the first decode block, which compiles the decode program
        self.stats: dict[str, float] = {}

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
        cache = self.new_cache(b, cache_len, self.cache_dtype)

        t0 = time.perf_counter()
        logits, cache = self.prefill(cache, padded, lengths, progress)
        logits.block_until_ready()
        self.stats = {"prompt_tokens": int(lengths.sum()), "prefill_s": time.perf_counter() - t0, "new_tokens": 0}

        key, sampling = self.sampling_args(seed, sampling)
        produced, stopped = 0, np.zeros((b,), bool)
        t1 = time.perf_counter()
        while produced < max_new_tokens:
            steps = self.block_size
            tokens, logits, cache, key = decode_block.with_options(self.options)(
                self.graphdef, self.state, cache, logits, key, sampling, self.kernels, steps)
            tokens = to_host(tokens)[:, : max_new_tokens - produced]
            produced += tokens.shape[1]
            now = time.perf_counter()
            if "first_block_s" not in self.stats:       # it compiled the decode program
                self.stats.update(first_block_s=now - t1, first_block_tokens=produced)
            self.stats.update(new_tokens=produced, decode_s=now - t1)
            yield tokens
            if stop_token is not None:
                stopped |= (tokens == stop_token).any(axis=1)
                if stopped.all():
                    break


def committed(tree):
    """Arrays committed to the default device, as the outputs of jitted calls are: a jitted
    program first called with uncommitted arguments (jnp.asarray) compiles a second time when
    its own outputs come back as arguments."""
    return jax.device_put(tree, jax.devices()[0])


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m

