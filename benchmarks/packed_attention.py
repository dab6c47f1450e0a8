"""cuDNN's packed causal attention (`pallas_kernels.causal_attention`, impl "cudnn" with
segments) on a GPU: checked against a masked XLA reference, then timed on one packed row
against the unpacked causal kernel.

    PYTHONPATH=. python3 benchmarks/packed_attention.py --seq-len 131072 --json out.json

1. Correctness (small rows, several documents and trailing padding): output and the gradients
   of q, k, v equal those of XLA attention with the [S, S] document-causal mask, in float32.
2. Speed and memory (one row of --seq-len tokens in documents of random lengths around each
   --mean-doc): the packed kernel's forward + backward and its temporary memory next to the
   unpacked causal kernel over the same row (the baseline: a packed row skips the
   cross-document blocks), and each row's visible pairs at the measured bf16 matmul rate (the
   physical limit). The packed backward's memory grows with the segment bound.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from benchmarks._measure import bench, ceilings
from benchmarks._report import Table, write_json
from glm_jax.layers.segments import count_segments, segment_bound, segment_layout, segment_table

HEADS, WIDTH = 16, 192          # small-128k's heads and MLA q/k head width


def random_segments(rng, batch: int, seq_len: int, mean_doc: int, padding: int = 0) -> np.ndarray:
    """int32 [B, S] segment ids: documents of random lengths, then `padding` tokens of id 0."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq_len - padding:
            lengths.append(int(rng.integers(1, 2 * mean_doc)))
        ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[: seq_len - padding]
        rows.append(np.concatenate([ids, np.zeros(padding, ids.dtype)]))
    return np.stack(rows).astype(np.int32)


def packed_fn(segment_ids, scale):
    positions, _ = segment_layout(jnp.asarray(segment_ids))
    table = segment_table(positions, segment_bound(count_segments(segment_ids)))
    return lambda q, k, v: pallas_kernels.causal_attention(q, k, v, scale=scale, segments=table, impl="cudnn")


def masked_reference(segment_ids, scale):
    seg = jnp.asarray(segment_ids)
    s = seg.shape[1]
    causal = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :])

    def attend(q, k, v):
        f32 = lambda x: x.astype(jnp.float32)
        return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=mask[:, None], scale=scale,
                                            implementation="xla")
    return attend


def loss_and_grads(attend, weights):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * weights),
                                      argnums=(0, 1, 2)))


def check(rng, scale: float) -> float:
    """Largest error of output and gradients against the masked reference (relative to their scale)."""
    seg = random_segments(rng, 2, 1024, 150, padding=40)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 1024, HEADS, WIDTH)), jnp.bfloat16) for _ in range(3))
    w = jnp.asarray(rng.standard_normal((2, 1024, HEADS, WIDTH)), jnp.float32)
    worst = 0.0
    got_o, ref_o = packed_fn(seg, scale)(q, k, v).astype(jnp.float32), masked_reference(seg, scale)(q, k, v)
    got, ref = loss_and_grads(packed_fn(seg, scale), w)(q, k, v), loss_and_grads(masked_reference(seg, scale), w)(q, k, v)
    for name, a, b in [("out", got_o, ref_o)] + [(n, x, y) for n, x, y in zip("qkv", got[1], ref[1])]:
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / (jnp.max(jnp.abs(b)) + 1e-9))
        print(f"  {name if name == 'out' else 'd' + name}: max error {err:.2e} of the reference's largest value")
        worst = max(worst, err)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--mean-doc", type=int, nargs="+", default=[40000, 3000],
                    help="mean document lengths (tokens) of the packed rows timed")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("cuDNN's packed attention needs a GPU (Hopper or later)")
    rng = np.random.default_rng(0)
    scale = WIDTH ** -0.5
    print("correctness against masked XLA attention (2 rows of 1024 tokens, documents and padding):")
    worst = check(rng, scale)
    if worst > 2e-2:
        raise SystemExit(f"packed attention differs from the reference: {worst:.2e}")
    _, peak = ceilings(False)
    s = args.seq_len
    q, k, v = (jnp.asarray(rng.standard_normal((1, s, HEADS, WIDTH)), jnp.bfloat16) for _ in range(3))
    w = jnp.ones((1, s, HEADS, WIDTH), jnp.float32)
    unpacked = loss_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                           implementation="cudnn"), w)
    rows = [{"layout": "unpacked causal (crosses documents)", "documents": 1, "bound": None,
             "fwd_bwd_ms": bench(unpacked, q, k, v, reps=3) * 1e3, "temp_gib": temp_gib(unpacked, q, k, v),
             "limit_ms": 7 * 2 * s * (s + 1) / 2 * HEADS * WIDTH / peak * 1e3}]
    for mean_doc in args.mean_doc:
        seg = random_segments(rng, 1, s, mean_doc)
        packed = loss_and_grads(packed_fn(seg, scale), w)
        lengths = np.diff(np.flatnonzero(np.diff(np.concatenate([[-1], seg[0], [-1]])) != 0))
        # fwd (2 matmuls) + bwd (5) of 2 FLOPs per (query, key, width) over the visible pairs
        pairs = float(np.sum(lengths * (lengths + 1) / 2))
        rows.append({"layout": f"packed, documents of about {mean_doc} tokens", "documents": int(lengths.size),
                     "bound": segment_bound(count_segments(seg)), "fwd_bwd_ms": bench(packed, q, k, v, reps=3) * 1e3,
                     "temp_gib": temp_gib(packed, q, k, v), "limit_ms": 7 * 2 * pairs * HEADS * WIDTH / peak * 1e3})
    print(f"one row of {s} tokens, {HEADS} heads of width {WIDTH}, forward + backward "
          f"(limit: the visible pairs' matmuls at the measured {peak / 1e12:.0f} TFLOP/s):")
    table = Table("layout", "documents", "segment bound", "ms", "limit ms", "temporaries GiB")
    for r in rows:
        table.row(r["layout"], r["documents"], r["bound"] or "-", f"{r['fwd_bwd_ms']:.1f}", f"{r['limit_ms']:.1f}",
                  f"{r['temp_gib']:.1f}")
    write_json(args.json, {"seq_len": s, "matmul_tflops": peak / 1e12, "max_error": worst, "rows": rows})


def temp_gib(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2 ** 30


if __name__ == "__main__":
    main()
