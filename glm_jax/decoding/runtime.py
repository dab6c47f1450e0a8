"""The decode runtime: what the generators and the serving engine share.

`DecodeRuntime` holds one model as every decoding program takes it: `params`, its arrays as one
flat tuple (placed on a mesh by the logical-axis rules), and `layout`, the static
`programs.ParamLayout` that rebuilds the model from them, the batch and context checks, the cache
(`new_cache`), the one prefill program (`prefill.prefill_chunk`: the target forward over a
chunk, and the MTP layer's when a speculative generator prefills its draft cache; the engine's
prefill over its page pool is the same program), the program builder (`program`: a `programs.Program` with
the runtime's XLA options, CUDA graphs on a GPU), and the values it puts on the device. Around it
the policies: `generate.Generator` (blocks of decode steps), `speculative.SpeculativeGenerator`
(MTP drafting and verification), `engine.ServingEngine` (continuous batching over a page pool).
They share one stop rule and one cut rule (`stops`, `cut`) and one stats shape (`DecodeStats`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from glm_jax.cache import KVCache, LayerSplit, create_cache, shard_cache
from glm_jax.cache.fp8 import layout_of, resolve_cache_dtype
from glm_jax.decoding.prefill import prefill_chunk
from glm_jax.decoding.programs import Options, ParamLayout, Program, compiler_options, flat_params
from glm_jax.decoding.sampling import SamplingParams
from glm_jax.forward_options import ForwardOptions, check_cached
from glm_jax.multihost import global_array, place, replicated
from glm_jax.sharding import ShardingError, logical_sharding, shard_params


#: Cache rows per sequence are a multiple of this (`DecodeRuntime.cache_rows`).
CACHE_ROWS = 128


class ContextTooLongError(ValueError):
    """The prompt plus the tokens to generate do not fit the cache / the model's context."""


def cut(tokens, stop: int | None) -> list[int]:
    """New tokens up to (not including) the stop token or the -1 padding: the one cut rule."""
    out = []
    for t in tokens:
        t = int(t)
        if t < 0 or t == stop:
            break
        out.append(t)
    return out


def stops(tokens, stop: int | None) -> bool:
    """Whether `tokens` (new tokens, in order) hold the stop token: the one stop rule."""
    return stop is not None and stop in [int(t) for t in tokens]


@dataclasses.dataclass
class DecodeStats:
    """What a generate call measured, one shape for every decoding policy.

    decode_s includes compile_s: the first call of the decode program (plain: the first block;
    speculative: compiling its loop, 0 once compiled); steady_tokens / steady_s exclude it.
    The speculative fields stay 0 / None for plain decoding."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0                # the prefill, with the compilation of its first chunk
    new_tokens: int = 0                   # summed over the sequences
    compile_s: float = 0.0
    decode_s: float = 0.0
    steady_tokens: int = 0
    steady_s: float = 0.0
    verify_steps: int = 0                 # target forwards over K+1 positions (summed over sequences)
    accepted: int = 0                     # accepted drafts, summed
    accepted_at: np.ndarray | None = None  # [K]: how often draft position j was accepted
    steps_per_sequence: np.ndarray | None = None      # int [B]: verify steps of each sequence
    accepted_per_sequence: np.ndarray | None = None   # int [B]: accepted drafts of each sequence

    @property
    def acceptance_length(self) -> float:
        """1 + mean accepted drafts per verify step (the serving convention)."""
        return 1.0 + self.accepted / max(self.verify_steps, 1)

    @property
    def acceptance_rate(self) -> np.ndarray:
        return self.accepted_at / max(self.verify_steps, 1)

    @property
    def acceptance_lengths(self) -> np.ndarray:
        """float [B]: each sequence's acceptance length."""
        return 1.0 + self.accepted_per_sequence / np.maximum(self.steps_per_sequence, 1)


class DecodeRuntime:
    """What every decoding policy (Generator, SpeculativeGenerator, ServingEngine) runs on: the
    split model, the batch size, the context check, the placement on a device mesh (params by
    the logical-axis rules; with a `layer` axis > 1 the target cache is LayerSplit across it),
    the cache, the prefill, and the programs' XLA options (`program`: on a GPU with cuda_graphs,
    CUDA graphs, loops included: `programs.compiler_options`); kv_cache_dtype: the cache's rows,
    "auto" (the model's dtype), "bf16" or "fp8" (`cache.fp8`: quantized when written, read by the
    kernels), refused in one line where the model or a named kernel cannot take it."""

    def __init__(self, model, *, batch: int, max_len: int | None, prefill_chunk: int,
                 forward: ForwardOptions = ForwardOptions(), mesh: Mesh | None = None, collective: str = "permute",
                 cuda_graphs: bool = False, mtp: bool = False, kv_cache_dtype: str = "auto"):
        self.cfg = model.cfg
        # The model's call-time options in every program (the cached calls read only its kernels).
        self.forward = check_cached(type(self).__name__, forward)
        kernels = forward.kernels
        self.cache_dtype = resolve_cache_dtype(self.cfg, kv_cache_dtype, attention=kernels["sparse_mla"].impl,
                                               indexer=kernels["indexer_topk"].impl)
        # XLA options of the programs: on a GPU with cuda_graphs, CUDA graphs (`programs`)
        self.options = compiler_options(jax.default_backend(), cuda_graphs)
        graphdef, state = nnx.split(model)
        self.mesh = mesh
        self.split = None
        if mesh is not None:
            data = mesh.shape.get("data", 1)
            if batch % data:
                raise ShardingError(f"a batch of {batch} prompt(s) cannot be split over mesh axis 'data' of "
                                    f"size {data}; give a multiple of {data} prompts or use data=1")
            state = shard_params(state, mesh)
            if mesh.shape.get("layer", 1) > 1:
                self.split = LayerSplit(mesh, collective=collective)
        # The parameters as the programs take them (the MTP layer's only with `mtp`).
        self.params, self.layout = flat_params(graphdef, state, mtp=mtp)
        self.batch = batch
        self.max_len = max_len or self.cfg.max_position_embeddings
        if self.max_len > self.cfg.max_position_embeddings:
            raise ContextTooLongError(
                f"max_len {self.max_len} exceeds the model's context of "
                f"{self.cfg.max_position_embeddings} tokens (max_position_embeddings)")
        self.prefill_chunk = prefill_chunk

    @staticmethod
    def cache_rows(need: int) -> int:
        """Cache rows per sequence for `need` rows: rounded up to CACHE_ROWS, so that prompts of
        nearby lengths share the compiled programs (a program is compiled per cache shape)."""
        return round_up(need, CACHE_ROWS)

    def new_cache(self, batch: int, cache_len: int, dtype=None) -> KVCache:
        """An empty target cache, LayerSplit and placed on the mesh when there is one; dtype: its
        rows' (None: the runtime's kv_cache_dtype)."""
        cache = create_cache(self.cfg, batch, cache_len, dtype or self.cache_dtype, split=self.split)
        return committed(cache) if self.mesh is None else shard_cache(cache, self.mesh)

    @property
    def cache_layout(self) -> str:
        """The cache's layout in words: "fp8", or its dtype's name ("bfloat16", "float32")."""
        return layout_of(self.cfg, self.cache_dtype)

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

    def check_prompt(self, prompt: np.ndarray, max_new_tokens: int) -> None:
        """A prompt (int [P]) holds the model's token ids and fits the context with max_new_tokens."""
        if len(prompt) and (prompt.min() < 0 or prompt.max() >= self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got "
                             f"{int(prompt.min())}..{int(prompt.max())}")
        self.check_fits(len(prompt), max_new_tokens)

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

    def program(self, p: Program):
        """The program `p` compiled with this runtime's XLA options (the one program builder of
        the generators; the engine's programs take the same `options`)."""
        return p.with_options(self.options)

    def compiled(self, p: Program, args: tuple, **static):
        """`p` compiled ahead of its call for `args` (after the layout: their shapes, dtypes and
        shardings), its static arguments and this runtime's options, so the time measured around
        the call excludes compilation; runtimes of one model share the compiled programs. Call it
        with (params, *args)."""
        leaves, treedef = jax.tree.flatten(args)
        return _compiled(p, self.layout, treedef, tuple(map(_spec_of, leaves)), self.options,
                         tuple(sorted(static.items())))

    def prefill(self, cache: KVCache, padded: np.ndarray, lengths: np.ndarray, progress=None, mtp_cache=None):
        """Chunked prefill of padded int32 [B, P] (real lengths [B]), one call of `prefill_chunk`
        per chunk -> (logits float32 [B, V] after each row's last prompt token, the target's
        hidden state there [B, hidden], cache, mtp_cache). With an MTP cache the MTP layer is
        prefilled too, its rows one token ahead (the speculative generator's draft state)."""
        b, p = padded.shape
        c = self.prefill_chunk
        shifted = np.concatenate([padded[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
        logits = hidden = None
        for start, tokens, num_valid in self._chunks(padded, lengths):
            mtp = None
            if mtp_cache is not None:     # the MTP rows: the tokens one ahead
                nxt = np.zeros_like(tokens)
                piece = shifted[:, start:start + c]
                nxt[:, :piece.shape[1]] = piece
                num_valid_mtp = np.clip(lengths - 1 - start, 0, c).astype(np.int32)
                mtp = (self.put(nxt, ("batch", None)), self.put(num_valid_mtp, ("batch",)))
            last, last_hidden, cache, mtp_cache, _, _ = self.program(prefill_chunk)(
                self.layout, self.params, cache, self.put(tokens, ("batch", None)), self.put(num_valid, ("batch",)),
                self.forward, mtp_cache=mtp_cache, mtp_inputs=mtp)
            if logits is None:
                logits, hidden = last, last_hidden
            else:
                fresh = self.put((num_valid > 0)[:, None])
                logits, hidden = jnp.where(fresh, last, logits), jnp.where(fresh, last_hidden, hidden)
            if progress is not None:
                progress(min(start + c, p), p)
        return logits, hidden, cache, mtp_cache

    def _chunks(self, padded: np.ndarray, lengths: np.ndarray):
        """Prefill chunks: yields (start, tokens int32 [B, C] zero-padded, real tokens per row [B])."""
        c = self.prefill_chunk
        for start in range(0, padded.shape[1], c):
            tokens = np.zeros((padded.shape[0], c), np.int32)
            piece = padded[:, start:start + c]
            tokens[:, :piece.shape[1]] = piece
            yield start, tokens, np.clip(lengths - start, 0, c).astype(np.int32)


def _spec_of(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@functools.lru_cache(maxsize=8)
def _compiled(p: Program, layout: ParamLayout, treedef, specs: tuple, options: Options, static: tuple):
    lowered = p.lower(layout, *jax.tree.unflatten(treedef, specs), **dict(static))
    return lowered.compile(dict(options) or None)


def committed(tree):
    """Arrays committed to the default device, as the outputs of jitted calls are: a jitted
    program first called with uncommitted arguments (jnp.asarray) compiles a second time when
    its own outputs come back as arguments."""
    return jax.device_put(tree, jax.devices()[0])


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
