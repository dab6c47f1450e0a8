"""LayerSplit decode on several devices against one device: step time, cache memory per device,
rows moved per step, and the tokens (greedy, which must be equal).

    PYTHONPATH=. python3 benchmarks/layer_split_decode.py --contexts 131072 262144      # 2 GPUs
    PYTHONPATH=. python3 benchmarks/layer_split_decode.py --contexts 1048576 --profile /tmp/ls_trace
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. \\
        python3 benchmarks/layer_split_decode.py --smoke                                 # CPU check

The model is benchmarks/long_context.py's 8-layer model with GLM-5.2's attention and the
IndexShare pattern (random weights; `--smoke` shrinks it). For each context, one prompt of
context - new-tokens random tokens is prefilled and --new-tokens are decoded greedily, first on
one device (the whole cache there), then with the cache split by layers over the --mesh
(`decode.py --mesh layer=2`: each device keeps the cache of half the layers; a layer's top-k
rows travel from its owner to the other devices). Per run: decode ms per step (after the first
decode block, which compiles), the cache bytes each device holds, and the rows a step moves
(every layer's top-k rows, owner to the others: layers x batch x top-k x row bytes) beside
the step time that moving them at the measured device-to-device rate would take. The tokens of
the split run must equal the one-device run's (exit status 1 if not).

--profile DIR traces a few decode blocks of the split run (jax.profiler; read the collectives'
overlap with compute in xprof). --json FILE writes the rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks._report import write_json

#: Tokens per decode block (one jitted call): the first block compiles and is not timed.
BLOCK = 16


def cache_bytes_per_device(cache) -> int:
    """Bytes of the cache's arrays held by the first device."""
    import jax

    first = jax.devices()[0]
    total = 0
    for leaf in jax.tree.leaves(cache):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == first:
                total += shard.data.nbytes
    return total


def transfer_rate(devices) -> float:
    """Bytes/s of one 256 MiB device-to-device copy (first to second device), median of 5."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jax.device_put(jnp.zeros((64 << 20,), jnp.float32), devices[0])
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        jax.device_put(x, devices[1]).block_until_ready()
        times.append(time.perf_counter() - t0)
    return x.nbytes / float(np.median(times[1:]))


def run(model, mesh, prompt, new_tokens: int, max_len: int, prefill_chunk: int, profile: str | None):
    """-> (tokens int [new_tokens], ms per decode step after the first block, cache bytes on device 0)."""
    import jax
    import numpy as np

    from glm_jax.decoding.generate import Generator

    gen = Generator(model, batch=1, max_len=max_len, prefill_chunk=prefill_chunk, block_size=BLOCK, mesh=mesh)
    blocks = []
    tracing = False
    for i, block in enumerate(gen.generate(prompt, max_new_tokens=new_tokens)):
        blocks.append(block)
        if profile and i == 1:
            jax.profiler.start_trace(profile)
            tracing = True
    if tracing:
        jax.profiler.stop_trace()
    s = gen.stats
    later = s.steady_tokens // gen.batch
    step_ms = 1e3 * s.steady_s / later if later > 0 else float("nan")
    cache = gen.new_cache(1, 16, None)
    per_token = cache_bytes_per_device(cache) / 16                     # bytes of one position on device 0
    return np.concatenate(blocks, axis=1)[0], step_ms, int(per_token * max_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 131072 262144; smoke 256")
    ap.add_argument("--mesh", default="layer=2")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64; smoke 32")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default 4096; smoke 64")
    ap.add_argument("--smoke", action="store_true", help="tiny model and context (CPU, simulated devices)")
    ap.add_argument("--profile", default=None, help="trace the split run's decode here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np
    from flax import nnx

    from benchmarks._serving_model import PATTERNS, model_config
    from glm_jax.model import GLMModel
    from glm_jax.sharding import make_mesh

    contexts = args.contexts or ([256] if args.smoke else [131072, 262144])
    new_tokens = args.new_tokens or (32 if args.smoke else 64)
    if new_tokens <= BLOCK:
        sys.exit(f"--new-tokens must be more than one decode block ({BLOCK}): the first block compiles, "
                 "the later ones are timed")
    chunk = args.prefill_chunk or (64 if args.smoke else 4096)
    mesh = make_mesh(args.mesh)
    devices = jax.devices()
    cfg = model_config(PATTERNS["IndexShare"], args.smoke)
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    rate = transfer_rate(devices)
    row_bytes = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    moved = cfg.num_hidden_layers * cfg.index_topk * row_bytes            # per step, batch 1
    print(f"{devices[0].device_kind} x {len(devices)}; mesh {args.mesh}; {cfg.num_hidden_layers} layers "
          f"({cfg.index_topk_pattern}), top-{cfg.index_topk}, {new_tokens} new tokens; device-to-device "
          f"{rate / 1e9:.1f} GB/s")
    print("| context | one device ms/step | split ms/step | split / one | cache MB on device 0 (one / split) | "
          "rows moved per step MB | at the copy rate ms | tokens equal |")
    print("|---|---|---|---|---|---|---|---|")
    rows, ok = [], True
    for context in contexts:
        prompt = np.random.default_rng(context).integers(1, cfg.vocab_size, context - new_tokens).astype(np.int32)
        one = run(model, None, prompt, new_tokens, context, chunk, None)
        split = run(model, mesh, prompt, new_tokens, context, chunk, args.profile)
        equal = bool(np.array_equal(one[0], split[0]))
        ok &= equal
        row = dict(context=context, one_ms=one[1], split_ms=split[1], one_cache_bytes=one[2],
                   split_cache_bytes=split[2], moved_bytes=moved, moved_ms=1e3 * moved / rate, tokens_equal=equal)
        rows.append(row)
        print(f"| {context} | {one[1]:.2f} | {split[1]:.2f} | {split[1] / one[1]:.2f} | "
              f"{one[2] / 1e6:.1f} / {split[2] / 1e6:.1f} | {moved / 1e6:.1f} | {row['moved_ms']:.3f} | {equal} |",
              flush=True)
        write_json(args.json, dict(mesh=args.mesh, device=devices[0].device_kind, rate=rate, rows=rows))
    if not ok:
        sys.exit("the split decode's tokens differ from one device's")


if __name__ == "__main__":
    main()
