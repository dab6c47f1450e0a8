"""The dense warm-up's indexer KL (`pallas_kernels.dense_indexer_kl`) of one IndexShare group at
long lengths: forward and forward + backward per implementation, beside the op's matmul limit
and the bf16 matmul rate measured in the same run.

    PYTHONPATH=. python3 benchmarks/dense_kl_long.py --seq-len 32768 131072 --impls xla pallas_gpu \
        --json OUT/dense_kl_long.json [--trace OUT/trace]
    PYTHONPATH=. python3 benchmarks/dense_kl_long.py --smoke          # tiny shapes, CPU

Implementation pallas_gpu is the Pallas GPU kernels of `lab/dense_indexer_kl_gpu.py` (outside the
package: measured slower than xla forward + backward), registered for the run.

The group is the config's (default: configs/default-py.yaml, the default model: 4 layers of 8
heads, absorbed width kv_lora_rank + rope = 160, an indexer of 8 heads of 64), batch 1, one
document per row (`--documents N`: N equal packed documents), random bf16 operands.

The limit: the op's matmul FLOPs over the measured matmul rate. Per visible (query, key) pair
a pass over the tiles computes every layer's and head's attention logit (2 Dk FLOPs each) and
the indexer's per-head dots (2 Di each); the backward adds the indexer's two gradient products
(4 Di per head). The forward must visit the pairs twice (the attention's log-sum-exp, then the
target it normalises) and the backward once, so the limit counts three passes of logits.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._measure import bench, ceilings
from benchmarks._report import Table, device_kind, failure, write_json


def group_shapes(config_path: str) -> dict:
    """The op's shapes for one IndexShare group of the config."""
    from glm_jax.config import load_config

    cfg = load_config(config_path)
    full = cfg.full_layers
    layers = (full[1] if len(full) > 1 else cfg.num_hidden_layers) - full[0]      # the first group's
    return dict(layers=layers, heads=cfg.num_attention_heads, dk=cfg.latent_dim, index_heads=cfg.index_n_heads,
                index_dim=cfg.index_head_dim, sm_scale=float(cfg.softmax_scale))


def operands(shapes: dict, seq_len: int, documents: int, seed: int = 0):
    """Random operands of the op: (qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start)."""
    keys = iter(jax.random.split(jax.random.key(seed), 4 * shapes["layers"] + 4))
    normal = lambda shape, scale=1.0: (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(jnp.bfloat16)
    b, s, h, dk = 1, seq_len, shapes["heads"], shapes["dk"]
    qs = tuple(normal((b, s, h, dk)) for _ in range(shapes["layers"]))
    latents = tuple(normal((b, s, dk)) for _ in range(shapes["layers"]))
    idx_q = normal((b, s, shapes["index_heads"], shapes["index_dim"]), 0.3)
    idx_keys = normal((b, s, shapes["index_dim"]), 0.3)
    idx_w = jax.random.uniform(next(keys), (b, s, shapes["index_heads"]), jnp.float32, 0.05, 0.2)
    starts = np.arange(s) // -(-s // documents) * -(-s // documents)
    kv_start = jnp.asarray(starts[None].astype(np.int32))
    return qs, latents, idx_q, idx_keys, idx_w, jnp.full((b,), s, jnp.int32), kv_start


def visible_pairs(seq_len: int, documents: int) -> int:
    """(query, key) pairs with the key visible: causal within each document."""
    size = -(-seq_len // documents)
    lengths = [min(size, seq_len - i * size) for i in range(documents)]
    return sum(n * (n + 1) // 2 for n in lengths)


def limit_flops(shapes: dict, pairs: int) -> tuple[float, float]:
    """(forward, forward + backward) matmul FLOPs at the op's limit (module docstring)."""
    logits = shapes["layers"] * shapes["heads"] * 2 * shapes["dk"]
    index = shapes["index_heads"] * 2 * shapes["index_dim"]
    forward = pairs * (2 * logits + index)
    return forward, forward + pairs * (logits + index + 2 * index)


def programs(shapes: dict, impl: str, config, interpret: bool = False):
    """Jitted (forward, forward + backward) of the op with impl (interpret: Pallas on a CPU)."""
    import pallas_kernels

    def loss(idx_q, idx_keys, idx_w, qs, latents, kv_len, kv_start):
        rows = pallas_kernels.dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, sm_scale=shapes["sm_scale"],
                                               kv_len=kv_len, kv_start=kv_start, impl=impl, config=config,
                                               interpret=interpret)
        return jnp.sum(rows)

    return jax.jit(loss), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def measure(shapes: dict, seq_len: int, documents: int, impl: str, reps: int, rate: float, config=None,
            trace: str | None = None) -> dict:
    """One row: ms forward and forward + backward, each beside its limit."""
    qs, latents, idx_q, idx_keys, idx_w, kv_len, kv_start = operands(shapes, seq_len, documents)
    args = (idx_q, idx_keys, idx_w, qs, latents, kv_len, kv_start)
    fwd, both = programs(shapes, impl, config, interpret=impl.startswith("pallas") and jax.default_backend() == "cpu")
    pairs = visible_pairs(seq_len, documents)
    limit_fwd, limit_both = limit_flops(shapes, pairs)
    row = dict(seq_len=seq_len, documents=documents, impl=impl, pairs=pairs,
               limit_forward_ms=1e3 * limit_fwd / rate, limit_forward_backward_ms=1e3 * limit_both / rate)
    t = bench(fwd, *args, reps=reps, inner=1)
    row.update(forward_ms=1e3 * t, forward_loss=float(fwd(*args)))
    t = bench(both, *args, reps=reps, inner=1)
    row.update(forward_backward_ms=1e3 * t, forward_backward_tflops=limit_both / t / 1e12)
    if trace:
        from benchmarks._traces import summarize

        path = f"{trace}/{impl}-{seq_len}"
        with jax.profiler.trace(path, create_perfetto_trace=True):
            jax.block_until_ready(both(*args))
        row["trace_summary"] = summarize(path, steps=1, top=15)
        print(row["trace_summary"], file=sys.stderr, flush=True)
    return row


def main(argv=None) -> int:
    from lab import dense_indexer_kl_gpu_vjp

    with dense_indexer_kl_gpu_vjp.registered():          # impl pallas_gpu: the lab's kernels
        return _run(argv)


def _run(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default-py.yaml")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--impls", nargs="+", default=["xla", "pallas_gpu"])
    ap.add_argument("--documents", type=int, default=1, help="equal packed documents per row")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace", metavar="DIR", help="also trace one forward + backward per row into DIR and "
                    "print its kernels (run with XLA_FLAGS=--xla_gpu_enable_command_buffer=)")
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any backend")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seq_len, args.reps = [256], 1
    shapes = group_shapes(args.config)
    bw, rate = ceilings(args.smoke)
    print(f"device: {device_kind()}; bf16 matmul {rate / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s "
          f"(measured in this run); group: {shapes}", flush=True)
    table = Table("tokens", "impl", "forward ms", "limit", "forward + backward ms", "limit", "of the limit")
    rows = []
    for seq_len in args.seq_len:
        for impl in args.impls:
            try:
                row = measure(shapes, seq_len, args.documents, impl, args.reps, rate, trace=args.trace)
                table.row(f"{seq_len:,}", impl, f"{row['forward_ms']:.1f}", f"{row['limit_forward_ms']:.1f}",
                          f"{row['forward_backward_ms']:.1f}", f"{row['limit_forward_backward_ms']:.1f}",
                          f"{row['limit_forward_backward_ms'] / row['forward_backward_ms']:.1%}")
            except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
                row = dict(seq_len=seq_len, impl=impl, failed=failure(e))
                table.row(f"{seq_len:,}", impl, row["failed"])
            rows.append(row)
    write_json(args.json, dict(device=device_kind(), matmul_tflops=rate / 1e12, copy_tbps=bw / 1e12,
                               group=shapes, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
