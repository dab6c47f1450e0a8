"""The builders of the decoding policies over `runtime.DecodeRuntime`: `build_decoder` (decode.py's:
the serving engine with --max-batch, else `build_generator`), `build_generator` (what a
DecodeConfig describes: plain or speculative), the serving engine with room for every slot
(`engine_with_room`; `engine_for_prompts` for decode.py --max-batch; `build_engine` for the
server: every slot at the full context)."""

from __future__ import annotations

import jax
import numpy as np

from glm_jax.cache import page_bytes
from glm_jax.cache.fp8 import store_dtype
from glm_jax.decoding.decode_config import DecodeConfig
from glm_jax.decoding.engine import ServingEngine
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.policy import Choice, choose
from glm_jax.decoding.speculative import SpeculativeGenerator
from glm_jax.forward_options import ForwardOptions


def build_generator(model, settings: DecodeConfig, *, batch: int, mesh=None):
    """The generator for `batch` prompts that `settings` describe -> (generator, the
    `policy.Choice` saying why it speculates or not): speculative with settings.speculative
    drafts, or when that is None where it measured faster (`policy.choose`); plain otherwise."""
    if model.mtp is None:
        choice = Choice(0, "plain decoding: the model has no MTP layer to draft with")
    elif settings.speculative is not None:
        choice = Choice(settings.speculative, f"{'plain' if settings.speculative == 0 else 'speculative'} decoding: "
                                              f"--speculative {settings.speculative}")
    else:
        choice = choose(jax.default_backend(), batch)
    common = dict(mesh=mesh, collective=settings.collective, forward=settings.forward(), batch=batch,
                  max_len=settings.max_len, prefill_chunk=settings.prefill_chunk,
                  kv_cache_dtype=settings.kv_cache_dtype)
    if choice.num_draft:
        return SpeculativeGenerator(model, num_draft=choice.num_draft, kv_share=settings.kv_share, **common), choice
    return Generator(model, **common), choice


def build_decoder(model, settings: DecodeConfig, prompts: list[np.ndarray], *, mesh=None):
    """decode.py's policy for `prompts` (int32 [P_i] each) -> (policy, its `policy.Choice` or
    None): with settings.max_batch the serving engine, that many prompts decoding at a time
    (`engine_for_prompts`; None), else `build_generator`'s generator for them all at once."""
    if settings.max_batch is None:
        return build_generator(model, settings, batch=len(prompts), mesh=mesh)
    return engine_for_prompts(model, prompts, max_batch=settings.max_batch, max_new_tokens=settings.max_new_tokens,
                              max_len=settings.max_len, prefill_chunk=settings.prefill_chunk,
                              decode_steps=settings.decode_steps, mesh=mesh, collective=settings.collective,
                              forward=settings.forward(), kv_cache_dtype=settings.kv_cache_dtype), None


def engine_for_prompts(model, prompts: list[np.ndarray], *, max_batch: int, max_new_tokens: int,
                       max_len: int | None = None, **settings) -> ServingEngine:
    """A ServingEngine of `max_batch` slots for `prompts` (int32 [P_i] each) and max_new_tokens
    (`engine_with_room` for the longest of them); settings: those of `engine_with_room`."""
    return engine_with_room(model, slots=max_batch, longest=max(len(p) for p in prompts) + max_new_tokens,
                            max_context=max_len or model.cfg.max_position_embeddings, **settings)


def engine_with_room(model, *, slots: int, longest: int, max_context: int, prefill_chunk: int = 256,
                     page_size: int = 16, step_token_budget: int | None = None,
                     forward: ForwardOptions = ForwardOptions(), mesh=None,
                     collective: str = "permute", decode_steps: int = 1, kv_cache_dtype: str = "auto",
                     cache_bytes: int | None = None) -> ServingEngine:
    """A ServingEngine of `slots` slots whose pool holds every slot at `longest` tokens at once
    (per data shard), so no request waits for pages or is preempted; or, given cache_bytes, the
    pages that many bytes hold in the kv_cache_dtype layout (`pool_pages`: the FP8 layout's
    pages are smaller, so the same bytes admit more tokens; requests wait for pages then).
    step_token_budget, decode_steps, kv_cache_dtype: as for ServingEngine."""
    if slots < 1:
        raise ValueError(f"max_batch must be >= 1, got {slots}")
    shards = 1 if mesh is None else mesh.shape.get("data", 1)
    if cache_bytes is None:
        num_pages = shards * (-(-slots // shards) * -(-longest // page_size) + 1)
    else:
        num_pages = pool_pages(model.cfg, cache_bytes, page_size, kv_cache_dtype, shards)
    return ServingEngine(model, slots=slots, num_pages=num_pages, page_size=page_size,
                         max_context=max_context, prefill_chunk=prefill_chunk,
                         step_token_budget=step_token_budget, forward=forward, mesh=mesh, collective=collective,
                         decode_steps=decode_steps, kv_cache_dtype=kv_cache_dtype)


def pool_pages(cfg, cache_bytes: int, page_size: int, kv_cache_dtype: str = "auto", shards: int = 1) -> int:
    """The pages of a pool of at most cache_bytes (whole pages of page_size tokens in the
    kv_cache_dtype layout, `cache.page_bytes`; a multiple of the data shards). ValueError if
    that leaves a shard fewer than 2 pages (one is scratch)."""
    size = page_bytes(cfg, page_size, store_dtype(kv_cache_dtype))
    pages = int(cache_bytes) // size // shards * shards
    if pages < 2 * shards:
        raise ValueError(f"a KV cache of {cache_bytes} bytes holds {int(cache_bytes) // size} pages of {size} bytes "
                         f"({page_size} tokens, {kv_cache_dtype}); the pool needs at least {2 * shards}")
    return pages


def build_engine(model, *, slots: int, page_size: int, max_context: int, prefill_chunk: int,
                 step_token_budget: int | None = None, decode_steps: int = 1, **placement):
    """A ServingEngine whose pool holds every slot at the full context at once (so no request
    is ever preempted for pages), or the pages of placement's cache_bytes (`engine_with_room`);
    step_token_budget, decode_steps: as for ServingEngine."""
    return engine_with_room(model, slots=slots, longest=max_context + prefill_chunk, max_context=max_context,
                            prefill_chunk=prefill_chunk, page_size=page_size, step_token_budget=step_token_budget,
                            decode_steps=decode_steps, **placement)
