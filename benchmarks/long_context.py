"""Long-context decode: IndexShare (one indexer per 4 layers) against every layer Full.

    PYTHONPATH=. python3 benchmarks/long_context.py                  # on a GPU
    PYTHONPATH=. python3 benchmarks/long_context.py --smoke          # tiny, CPU
    PYTHONPATH=. python3 benchmarks/long_context.py --prefill 200000 # prefill of one long prompt

The model has GLM-5.2's attention (64 heads, MLA latent 512 + 64 rope, indexer 32 heads x
128, top-2048, hidden 6144) and 8 layers with a small MoE; its cache is filled with random
rows up to the context (no 1M-token prefill), then decode steps run as one jitted call each,
with the cache donated. Two measurements per context and pattern, in one run:

* ms per decode step of the whole model, and tokens/s (batch / step time);
* ms of the attention + indexer work of one step, timed as the kernels alone at the model's
  shapes: every layer's sparse MLA over its 2048 selected rows, plus the indexer scan and
  top-k of every Full layer (8 with all layers Full, 2 with IndexShare).

The ratio all-Full / IndexShare of each is printed next to the copy bandwidth of the device
and the bytes the indexers read. `--json FILE` writes the rows for plotting.

`--prefill N` measures instead the chunked prefill of one N-token prompt (`--prefill-chunk`
tokens per jitted call, as decode.py prefills), compiled once and timed on a second run, for
each pattern: seconds, tokens/s, the ratio all-Full / IndexShare beside the published one
(1.82x at 200K tokens, IndexCache, H100) and beside the ratio of the two patterns' forward
FLOPs (`glm_jax.costs.prefill_flops`), which is what the ratio would be if time followed the arithmetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from benchmarks._measure import bench, ceilings
from benchmarks._report import Table, write_json
from benchmarks._serving_model import PATTERNS, model_config
from glm_jax import costs
from glm_jax.cache import KVCache, contiguous_page_table, create_cache
from glm_jax.decoding.generate import Generator
from glm_jax.model import GLMModel, abstract_model, params_by_part

#: IndexCache's prefill speed-up of IndexShare over every layer Full at 200K tokens (H100).
PUBLISHED_PREFILL_RATIO = 1.82



def filled_cache(cfg, batch: int, context: int, extra: int, key) -> KVCache:
    """A contiguous cache of `context` random rows per sequence (room for `extra` more)."""
    shape = jax.eval_shape(lambda: create_cache(cfg, batch, context + extra))   # no allocation
    k_latent, k_keys = jax.random.split(key)
    return dataclasses.replace(
        shape, latent=jax.random.normal(k_latent, shape.latent.shape, shape.latent.dtype),
        index_keys=jax.random.normal(k_keys, shape.index_keys.shape, shape.index_keys.dtype),
        page_table=contiguous_page_table(batch), lengths=jnp.full((batch,), context, jnp.int32))


def decode_stepper(cfg):
    """A jitted decode step of a randomly initialised model (cache donated) and its params."""
    graphdef, state = nnx.split(GLMModel(cfg, rngs=nnx.Rngs(0)))

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(state, tokens, cache):
        logits, _, cache = nnx.merge(graphdef, state).forward_cached(tokens, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    return step, state


def decode_step_ms(stepper, cfg, batch: int, context: int, steps: int, key) -> float:
    """Median ms of one decode step of the whole model at `context` cached rows."""
    step, state = stepper
    tokens = jnp.zeros((batch, 1), jnp.int32)
    cache = filled_cache(cfg, batch, context, steps + 3, key)
    for _ in range(2):                                            # compile, warm up
        tokens, cache = step(state, tokens, cache)
    jax.block_until_ready(tokens)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        tokens, cache = step(state, tokens, cache)
        jax.block_until_ready(tokens)
        times.append(time.perf_counter() - t)
    del cache
    return 1e3 * float(np.median(times))


def attention_ms(cfg, batch: int, context: int, key, interpret: bool) -> tuple[float, float]:
    """(ms of one layer's sparse MLA, ms of one Full layer's indexer top-k) at decode."""
    kq, kl, kw, ki, kk = jax.random.split(key, 5)
    dt = jnp.dtype(cfg.dtype)
    heads, latent = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    q = jax.random.normal(kq, (batch, 1, heads, latent), dt)
    rows = jax.random.normal(kl, (batch, context, latent), dt)
    iq = jax.random.normal(kw, (batch, 1, cfg.index_n_heads, cfg.index_head_dim), dt)
    ik = jax.random.normal(ki, (batch, context, cfg.index_head_dim), dt)
    w = jax.random.uniform(kk, (batch, 1, cfg.index_n_heads), jnp.float32)
    pos = jnp.full((batch, 1), context - 1, jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    topk = jax.jit(lambda iq, ik, w: pk.indexer_topk(iq, ik, w, topk=cfg.index_topk, q_pos=pos,
                                                      kv_len=lens, interpret=interpret))
    idx = topk(iq, ik, w)
    attend = jax.jit(lambda q, rows, idx: pk.sparse_mla(q, rows, idx, sm_scale=0.1, v_dim=cfg.kv_lora_rank,
                                                         interpret=interpret)[0])
    return 1e3 * bench(attend, q, rows, idx), 1e3 * bench(topk, iq, ik, w)


def prefill_seconds(cfg, length: int, chunk: int) -> float:
    """Seconds of the chunked prefill of one random `length`-token prompt (the second of two
    runs: the first compiles), as `Generator` prefills for decode.py."""
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    gen = Generator(model, batch=1, max_len=length + chunk, prefill_chunk=chunk, block_size=1)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, length), dtype=np.int32)
    for _ in range(2):
        next(gen.generate(prompt, max_new_tokens=1))
    return gen.stats.prefill_s


def prefill_main(length: int, chunk: int, smoke: bool, out: str | None) -> None:
    print(f"device {jax.devices()[0].device_kind}; prefill of one {length}-token prompt in chunks of {chunk}; "
          f"8 layers; patterns {PATTERNS}")
    table = Table("pattern", "prefill s", "tokens/s", "forward TFLOP")
    rows = {}
    for name, pattern in PATTERNS.items():
        cfg = model_config(pattern, smoke)
        active = costs.active_params(cfg, params_by_part(abstract_model(cfg)))
        seconds, flops = prefill_seconds(cfg, length, chunk), costs.prefill_flops(cfg, length, active)
        rows[name] = dict(pattern=name, prefill_s=seconds, tokens_per_s=length / seconds, flops=flops)
        table.row(name, f"{seconds:.3f}", f"{length / seconds:.0f}", f"{flops / 1e12:.1f}")
    full, share = rows["all Full"], rows["IndexShare"]
    ratio, flop_ratio = full["prefill_s"] / share["prefill_s"], full["flops"] / share["flops"]
    print(f"IndexShare prefill speed-up over all Full: {ratio:.2f}x measured; published "
          f"{PUBLISHED_PREFILL_RATIO:.2f}x (200K tokens, H100); {flop_ratio:.2f}x if time followed the FLOPs")
    write_json(out, dict(length=length, chunk=chunk, rows=list(rows.values()), ratio=ratio, flop_ratio=flop_ratio,
                         published_ratio=PUBLISHED_PREFILL_RATIO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model and contexts (CPU)")
    ap.add_argument("--contexts", type=int, nargs="+",
                    default=[32768, 131072, 262144, 524288, 1048576])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--prefill", type=int, metavar="N",
                    help="time the prefill of one N-token prompt instead of decode steps")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill call (default 8192)")
    args = ap.parse_args()
    if args.prefill:
        prefill_main(args.prefill, min(args.prefill_chunk, args.prefill), args.smoke, args.json)
        return
    contexts = [512, 2048] if args.smoke else args.contexts
    bw, _ = ceilings(args.smoke)
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e9:.0f} GB/s; batch {args.batch}; "
          f"8 layers; patterns {PATTERNS}")
    print("| context | pattern | ms/step | tokens/s | attention+indexer ms | indexer bytes/step (GB) | "
          "indexer-read limit ms |")
    print("|---|---|---|---|---|---|---|")
    rows, measured = [], {}
    key = jax.random.key(0)
    for name, pattern in PATTERNS.items():
        cfg = model_config(pattern, args.smoke)
        stepper = decode_stepper(cfg)
        for context in contexts:
            step = decode_step_ms(stepper, cfg, args.batch, context, args.steps, key)
            attn, index = attention_ms(cfg, args.batch, context, key, args.smoke)
            full = pattern.count("F")
            attn_total = len(pattern) * attn + full * index
            read = full * args.batch * context * cfg.index_head_dim * jnp.dtype(cfg.dtype).itemsize
            measured[context, name] = (step, attn_total)
            print(f"| {context} | {name} | {step:.2f} | {args.batch / step * 1e3:.0f} | {attn_total:.2f} | "
                  f"{read / 1e9:.2f} | {read / bw * 1e3:.2f} |", flush=True)
            rows.append(dict(context=context, pattern=name, step_ms=step, attention_indexer_ms=attn_total,
                             sparse_mla_ms=attn, indexer_ms=index))
        del stepper
    for context in contexts:
        (s_full, a_full), (s_share, a_share) = measured[context, "all Full"], measured[context, "IndexShare"]
        print(f"| {context} | ratio all Full / IndexShare | {s_full / s_share:.2f}x | | "
              f"{a_full / a_share:.2f}x | | |", flush=True)
    write_json(args.json, dict(copy_bytes_per_s=bw, batch=args.batch, rows=rows))


if __name__ == "__main__":
    main()
