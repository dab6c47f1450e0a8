"""Sparse MLA benchmark: Pallas kernel vs the XLA impl vs dense attention, next to the roofline.

    PYTHONPATH=. python3 benchmarks/sparse_mla.py            # on a GPU (or TPU: impl pallas_tpu)
    PYTHONPATH=. python3 benchmarks/sparse_mla.py --smoke    # tiny shapes, interpret mode, CPU

Prints, in one run: the measured device copy bandwidth and bf16 matmul rate (the ceilings);
a correctness check of the Pallas impl against the XLA impl (forward and gradients, fresh
random inputs); decode (64 heads, Dk 576, v 512, top-k 2048, one query per sequence) at batch
64 and 128, with bandwidth on the gathered bytes; paged decode (the same shapes over a paged
store of 64-row pages in shuffled order: `paged_sparse_mla` against the gather + kernel path
it replaces, next to the copy-bandwidth floor of the bytes the kernel must move); prefill
forward and backward (8K queries, top-k 2048, 128K context) with FLOP rates; dense attention
at the same shapes where it runs, and the context above which sparse beats dense. Times are
medians over repeats of a loop of calls, after a warm-up, each repeat ended by
block_until_ready. `--paged-only` runs the ceilings and the paged decode alone, with the Mosaic
GPU kernel (`lab/mosaic_sparse_mla.py`, outside the package and the registry) measured
beside the Triton one: its own table and JSON key "paged_decode_mosaic", each row with its
largest difference from the Triton kernel's output (a failure to compile is a row with its
error). `--mosaic-prefill` runs the ceilings and the prefill forward of both kernels.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks._measure import bench, ceilings
from benchmarks._report import failure

H, DK, DV = 64, 576, 512
SCALE = DK ** -0.5


def inputs(key, B, S, T, K, dtype=jnp.bfloat16, invalid=0.0, heads=H):
    kq, kk, ki, km = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, S, heads, DK), dtype)
    kv = jax.random.normal(kk, (B, T, DK), dtype)
    idx = jax.random.randint(ki, (B, S, K), 0, T, jnp.int32)
    if invalid:
        idx = jnp.where(jax.random.uniform(km, idx.shape) < invalid, -1, idx)
    return q, kv, idx


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    fin = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), fin):
        return float("inf")
    a, b = np.where(fin, a, 0), np.where(fin, b, 0)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(impl, interpret, key):
    """Pallas impl vs the XLA impl on upcast (float32) inputs: out, lse, dq, dkv."""
    B, S, T, K = (1, 2, 256, 40) if interpret else (2, 3, 4096, 2048)
    q, kv, idx = inputs(key, B, S, T, K, invalid=0.3)
    idx = idx.at[0, 0].set(-1)                           # a row with no valid index
    dout = jax.random.normal(jax.random.key(7), (B, S, H, DV), jnp.float32)

    def loss(impl, q, kv):
        out, lse = pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, impl=impl,
                                 interpret=interpret)
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jnp.sum(out.astype(jnp.float32) * dout) + 0.1 * lse_term, (out, lse)

    res = {}
    # float32 at 64 heads x 576 does not fit the GPU backward's shared memory: bf16 only there.
    dtypes = (("bf16", jnp.bfloat16),) if impl == "pallas_gpu" and not interpret else (
        ("bf16", jnp.bfloat16), ("f32", jnp.float32))
    for name, dt in dtypes:
        qd, kvd = q.astype(dt), kv.astype(dt)
        g = jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1), has_aux=True))
        (dq, dkv), (out, lse) = g(qd, kvd)
        q32, kv32 = qd.astype(jnp.float32), kvd.astype(jnp.float32)
        gr = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1), has_aux=True))
        (rdq, rdkv), (rout, rlse) = gr(q32, kv32)
        res[name] = {"out": rel(out, rout), "lse": rel(lse, rlse), "dq": rel(dq, rdq),
                     "dkv": rel(dkv, rdkv)}
    return res


def paged_inputs(key, B, T, K, page_size, dtype=jnp.bfloat16):
    """Decode over a paged store: q [B, 1, H, Dk], store [1, B*n + 1, P, Dk] (page 0 scratch),
    page_table int32 [B, n] (the pages shuffled over the store), indices [B, 1, K] logical rows."""
    kq, kk, ki, kp = jax.random.split(key, 4)
    n = -(-T // page_size)
    q = jax.random.normal(kq, (B, 1, H, DK), dtype)
    store = jax.random.normal(kk, (1, B * n + 1, page_size, DK), dtype)
    table = (1 + jax.random.permutation(kp, B * n)).reshape(B, n).astype(jnp.int32)
    idx = jax.random.randint(ki, (B, 1, K), 0, T, jnp.int32)
    return q, store, table, idx


def gather_then_attend(impl, interpret):
    """The path paged_sparse_mla replaces: the selected rows gathered through the page table into
    a [B, S*K, Dk] copy (the cache view's "rows" fetch), then `sparse_mla` over the copy."""
    def fn(q, store, table, idx):
        b, s, k = idx.shape
        page_size = store.shape[2]
        pages = jnp.take_along_axis(table, jnp.maximum(idx, 0).reshape(b, -1) // page_size, axis=1)
        rows = store[0, pages, jnp.maximum(idx, 0).reshape(b, -1) % page_size]            # [B, S*K, Dk]
        local = jnp.arange(s * k, dtype=jnp.int32).reshape(1, s, k)
        return pk.sparse_mla(q, rows, jnp.where(idx >= 0, local, -1), sm_scale=SCALE, v_dim=DV, impl=impl,
                             interpret=interpret)
    return jax.jit(fn)


def paged_decode(impl, config_type, interpret, bw, smoke, context):
    """Paged decode at batch 64 and 128: the paged kernel (best of a few configs) vs gather +
    kernel, next to the copy-bandwidth floor of the bytes the kernel must move (the selected
    rows, q, the output, the indices)."""
    T, K, page = (1024, 64, 16) if smoke else (context, 2048, 64)
    if backend_is_gpu() and not smoke:
        configs = [dict(), dict(head_group=64), dict(head_group=32), dict(block_k=32, num_stages=3),
                   dict(head_group=16, num_warps=4), dict(head_group=32, block_k=32, num_stages=3)]
    else:
        configs = [dict()]
    print(f"\n## paged decode: H={H}, Dk={DK}, v={DV}, top-k {K}, context {T}, pages of {page} rows "
          f"(shuffled), bf16, 1 query/sequence")
    print("| batch | paged us | config | floor us (bytes / copy BW) | % of copy BW | gather + kernel us | speedup |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for B in (2,) if smoke else (64, 128):
        q, store, table, idx = paged_inputs(jax.random.key(B + 1), B, T, K, page)
        paged = lambda cfg: jax.jit(lambda q, st, t, i: pk.paged_sparse_mla(
            q, st, t, i, sm_scale=SCALE, v_dim=DV, impl=impl, config=config_type(**cfg), interpret=interpret))
        best = fastest(paged, configs, q, store, table, idx)
        if best is None:
            continue
        t, cfg = best
        tg = bench(gather_then_attend(impl, interpret), q, store, table, idx)
        moved = B * K * DK * 2 + B * H * (DK + DV) * 2 + B * K * 4
        rows.append(dict(batch=B, paged=t, config=cfg, floor=moved / bw, pct=moved / t / bw, gather_kernel=tg))
        print(f"| {B} | {t * 1e6:.1f} | {cfg} | {moved / bw * 1e6:.1f} | {100 * moved / t / bw:.0f}% "
              f"| {tg * 1e6:.1f} | {tg / t:.2f}x |", flush=True)
    return rows


def mosaic_paged_decode(bw, smoke, context):
    """The Mosaic GPU kernel (`lab/mosaic_sparse_mla.py`) at the paged decode shapes, one row
    per (batch, config), in the same run as the Triton kernel's table above, each with its
    largest absolute difference from the Triton kernel's output on the same inputs; a config
    that fails to compile or run gets a row with its error's first line. In smoke mode (CPU)
    it runs in GPU interpret mode where this jax has one, else is skipped."""
    from lab import mosaic_sparse_mla
    T, K, page = (1024, 64, 16) if smoke else (context, 2048, 64)
    print(f"\n## paged decode, Mosaic GPU kernel (lab/mosaic_sparse_mla.py, outside the package): the shapes above")
    if smoke and not mosaic_sparse_mla.interpret_available():
        print("skipped: this jax has no Mosaic GPU interpret mode")
        return []
    configs = [dict()] if smoke else [dict(), dict(num_splits=4), dict(stages=1, num_splits=4)]
    print("| batch | mosaic us | config | floor us (bytes / copy BW) | % of copy BW | max abs diff from Triton |")
    print("|---|---|---|---|---|---|")
    rows = []
    for B in (2,) if smoke else (64, 128):
        q, store, table, idx = paged_inputs(jax.random.key(B + 1), B, T, K, page)
        moved = B * K * DK * 2 + B * H * (DK + DV) * 2 + B * K * 4
        want = pk.paged_sparse_mla(q, store, table, idx, sm_scale=SCALE, v_dim=DV, impl="pallas_gpu",
                                   interpret=smoke)[0]
        for cfg in configs:
            fn = jax.jit(lambda q, st, t, i, cfg=cfg: mosaic_sparse_mla.paged_sparse_mla(
                q, st, t, i, slot=0, sm_scale=SCALE, v_dim=DV, config=mosaic_sparse_mla.SparseMLAMosaicConfig(**cfg),
                interpret=smoke))
            try:
                t = bench(fn, q, store, table, idx)
                diff = float(jnp.max(jnp.abs(fn(q, store, table, idx)[0].astype(jnp.float32)
                                             - want.astype(jnp.float32))))
            except Exception as e:       # report, don't abort the run
                error = failure(e)
                rows.append(dict(impl="mosaic_gpu", batch=B, config=cfg, error=error))
                print(f"| {B} | failed | {cfg} | {moved / bw * 1e6:.1f} | {error} | |", flush=True)
                continue
            rows.append(dict(impl="mosaic_gpu", batch=B, paged=t, config=cfg, floor=moved / bw, pct=moved / t / bw,
                             max_abs_diff=diff))
            print(f"| {B} | {t * 1e6:.1f} | {cfg} | {moved / bw * 1e6:.1f} | {100 * moved / t / bw:.0f}% | "
                  f"{diff:.3g} |", flush=True)
    return rows


def mosaic_prefill_forward(mm, smoke, queries, context, heads):
    """The prefill forward at one shape (1 x queries over `context` keys, top-2048): the Triton
    kernel of the registry against the Mosaic GPU kernel (`lab/mosaic_sparse_mla.py`: a producer
    warpgroup gathering rows by TMA, two wgmma warpgroups), each as a share of the measured bf16
    matmul rate, with the Mosaic kernel's largest differences from the Triton kernel's out and
    lse; a config that fails is a row with its error's type and last line."""
    from lab import mosaic_sparse_mla
    S, T, K = (4, 256, 64) if smoke else (queries, context, 2048)
    q, kv, idx = inputs(jax.random.key(21), 1, S, T, K, heads=heads)
    flops = 2 * S * heads * K * (DK + DV)
    print(f"\n## prefill forward: 1 x {S} queries, H={heads}, top-k {K}, context {T}, bf16: Triton vs Mosaic GPU")
    print("| kernel | config | ms | TFLOP/s | % of matmul | max abs diff out / lse from Triton |")
    print("|---|---|---|---|---|---|")
    triton_cfgs = [dict()] if smoke else [dict(), dict(block_k=64, num_warps=8, num_stages=2)]
    mosaic_cfgs = [dict()] if smoke else [dict(), dict(num_splits=2), dict(num_splits=4), dict(stages=3)]
    cfg_type = pk.REGISTRY["sparse_mla"]["pallas_gpu"].config
    cases = [("triton", c, lambda c: jax.jit(lambda q, kv, i: pk.sparse_mla(
        q, kv, i, sm_scale=SCALE, v_dim=DV, impl="pallas_gpu", config=cfg_type(**c), interpret=smoke)))
        for c in triton_cfgs]
    cases += [("mosaic", c, lambda c: jax.jit(lambda q, kv, i: mosaic_sparse_mla.sparse_mla(
        q, kv, i, sm_scale=SCALE, v_dim=DV, config=mosaic_sparse_mla.SparseMLAMosaicConfig(**c), interpret=smoke)))
        for c in mosaic_cfgs]
    rows, want = [], None
    for kernel, cfg, make in cases:
        if kernel == "mosaic" and smoke and not mosaic_sparse_mla.interpret_available():
            print("| mosaic | | skipped: this jax has no Mosaic GPU interpret mode | | | |")
            continue
        try:
            fn = make(cfg)
            t = bench(fn, q, kv, idx, reps=3)
            out, lse = fn(q, kv, idx)
        except Exception as e:       # report, don't abort the run
            error = failure(e)
            rows.append(dict(kernel=kernel, config=cfg, error=error))
            print(f"| {kernel} | {cfg} | failed | | | {error} |", flush=True)
            continue
        if want is None:
            want = (out.astype(jnp.float32), lse)
        d_out = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want[0])))
        d_lse = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want[1]), lse - want[1], 0.0))))
        rows.append(dict(kernel=kernel, config=cfg, seconds=t, tflops=flops / t / 1e12, pct_matmul=flops / t / mm,
                         max_abs_diff_out=d_out, max_abs_diff_lse=d_lse))
        print(f"| {kernel} | {cfg} | {t * 1e3:.2f} | {flops / t / 1e12:.0f} | {100 * flops / t / mm:.0f}% | "
              f"{d_out:.3g} / {d_lse:.3g} |", flush=True)
    return rows


def fastest(make_fn, configs, *args):
    """(seconds, config) of the fastest make_fn(config)(*args), or None; a config that does not
    compile is reported and skipped."""
    best = None
    for cfg in configs:
        try:
            t = bench(make_fn(cfg), *args)
        except Exception as e:
            print(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def backend_is_gpu() -> bool:
    return jax.default_backend() == "gpu"


def dense_decode(q, kv):
    """Dense MQA decode over the whole latent cache (XLA): q [B,1,H,Dk], kv [B,T,Dk]."""
    s = jnp.einsum("bshd,btd->bsht", q, kv, preferred_element_type=jnp.float32) * SCALE
    p = jax.nn.softmax(s, axis=-1).astype(kv.dtype)
    return jnp.einsum("bsht,btd->bshd", p, kv[..., :DV])


def cudnn_attention(q, kv, causal):
    k = kv[:, :, None, :]
    v = kv[:, :, None, :DV]
    return jax.nn.dot_product_attention(q, k, v, scale=SCALE, is_causal=causal,
                                        implementation="cudnn")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--json", default=None, help="also write every number to this file")
    ap.add_argument("--decode-context", type=int, default=32768)
    ap.add_argument("--prefill-queries", type=int, default=8192)
    ap.add_argument("--prefill-context", type=int, default=131072)
    ap.add_argument("--prefill-heads", type=int, default=H)
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode measurements")
    ap.add_argument("--paged-only", action="store_true", help="only the ceilings and the paged decode")
    ap.add_argument("--mosaic-prefill", action="store_true",
                    help="only the ceilings and the prefill forward, Triton against Mosaic GPU "
                         "(--prefill-queries, --prefill-context, --prefill-heads)")
    args = ap.parse_args()
    smoke = args.smoke
    backend = jax.default_backend()
    impl = "pallas_tpu" if backend == "tpu" else "pallas_gpu"
    config_type = pk.REGISTRY["sparse_mla"][impl].config
    interpret = smoke
    on_gpu = backend_is_gpu()
    report = {"backend": backend, "device": str(jax.devices()[0].device_kind), "impl": impl}
    print(f"# sparse MLA benchmark on {report['device']} ({backend}), jax {jax.__version__}, "
          f"impl={impl}{' (interpret, smoke)' if smoke else ''}")

    bw, mm = ceilings(smoke)
    report["copy_bw"], report["matmul"] = bw, mm
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write); bf16 matmul {mm / 1e12:.0f} TFLOP/s")

    if args.mosaic_prefill:
        report["prefill_forward_mosaic"] = mosaic_prefill_forward(mm, smoke, args.prefill_queries,
                                                                  args.prefill_context, args.prefill_heads)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return
    if args.paged_only:
        report["paged_decode"] = paged_decode(impl, config_type, interpret, bw, smoke, args.decode_context)
        if impl == "pallas_gpu":         # the Mosaic GPU kernel beside the Triton one
            report["paged_decode_mosaic"] = mosaic_paged_decode(bw, smoke, args.decode_context)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return
    try:
        chk = check(impl, interpret, jax.random.key(3))
    except Exception as e:
        print(f"check FAILED to run: {type(e).__name__}: {str(e)[:300]}")
        chk = {}
    report["check"] = chk
    for dt, r in chk.items():
        print(f"check {dt} vs xla (f32): " + "  ".join(f"{k} {v:.1e}" for k, v in r.items()))

    def ours(**cfg):
        return jax.jit(lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, impl=impl,
                                                      config=config_type(**cfg), interpret=interpret))

    xla_fn = jax.jit(lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, impl="xla"))

    # ------------------------------------------------------------------ decode
    T = 1024 if smoke else args.decode_context
    K = 64 if smoke else 2048
    rows = []
    if on_gpu:
        configs = [dict(block_k=64, num_warps=8, num_stages=2), dict(block_k=32, num_warps=8, num_stages=3)]
    else:
        configs = [dict()]
    print(f"\n## decode: H={H}, Dk={DK}, v={DV}, top-k {K}, context {T}, bf16, 1 query/sequence")
    print("| batch | ours us | config | GB/s gathered | % of copy BW | xla us | dense-xla us | cudnn us |")
    print("|---|---|---|---|---|---|---|---|")
    for B in (() if args.prefill_only else (2,) if smoke else (64, 128)):
        q, kv, idx = inputs(jax.random.key(B), B, 1, T, K)
        best = fastest(lambda cfg: ours(**cfg), configs, q, kv, idx)
        if best is None:
            continue
        t, cfg = best
        gathered = B * K * DK * 2 + B * H * (DK + DV) * 2
        tx = bench(xla_fn, q, kv, idx)
        td = bench(jax.jit(dense_decode), q, kv)
        tc = None
        if on_gpu:
            try:
                tc = bench(jax.jit(functools.partial(cudnn_attention, causal=False)), q, kv)
            except Exception as e:
                print(f"  cudnn decode unavailable: {type(e).__name__}: {str(e)[:160]}")
        row = dict(batch=B, ours=t, config=cfg, gbs=gathered / t / 1e9, pct=gathered / t / bw,
                   xla=tx, dense=td, cudnn=tc)
        rows.append(row)
        print(f"| {B} | {t * 1e6:.1f} | {cfg} | {gathered / t / 1e9:.0f} | {100 * gathered / t / bw:.0f}% "
              f"| {tx * 1e6:.1f} | {td * 1e6:.1f} | {'n/a' if tc is None else f'{tc * 1e6:.1f}'} |")
    report["decode"] = rows

    # Crossover: dense decode time grows with the context, sparse does not.
    B = 2 if smoke else 64
    best_cfg = rows[0]["config"] if rows else {}
    cross = []
    print(f"\n## decode crossover (batch {B}): dense over the whole context vs sparse top-{K}")
    print("| context | sparse us | dense-xla us |")
    print("|---|---|---|")
    for ctx in (() if args.prefill_only else (256, 512, 1024) if smoke else (2048, 4096, 8192, 32768)):
        q, kv, idx = inputs(jax.random.key(ctx), B, 1, ctx, K)
        ts = bench(ours(**best_cfg), q, kv, idx)
        td = bench(jax.jit(dense_decode), q, kv)
        cross.append(dict(context=ctx, sparse=ts, dense=td))
        print(f"| {ctx} | {ts * 1e6:.1f} | {td * 1e6:.1f} |")
    report["decode_crossover"] = cross
    if not args.prefill_only:
        report["paged_decode"] = paged_decode(impl, config_type, interpret, bw, smoke, args.decode_context)

    # ------------------------------------------------------------------ prefill
    S = 128 if smoke else args.prefill_queries
    T = 1024 if smoke else args.prefill_context
    K = 64 if smoke else 2048
    heads = args.prefill_heads
    q, kv, idx = inputs(jax.random.key(11), 1, S, T, K, heads=heads)
    fwd_flops = 2 * S * heads * K * (DK + DV)
    bwd_flops = 2 * S * heads * K * (3 * DK + 2 * DV)
    print(f"\n## prefill: 1 x {S} queries, H={heads}, top-k {K}, context {T}, bf16")
    if on_gpu:
        pconfigs = [dict(block_k=64, num_warps=8, num_stages=2)]
    else:
        pconfigs = [dict()]
    best = None
    for cfg in pconfigs:
        try:
            t = bench(ours(**cfg), q, kv, idx, reps=3)
        except Exception as e:
            print(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"  fwd {cfg}: {t * 1e3:.2f} ms")
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        return
    tf, cfg = best
    dout = jax.random.normal(jax.random.key(12), (1, S, heads, DV), jnp.bfloat16)

    def grad_fn(fn):
        def loss(q, kv, i):
            out, _ = fn(q, kv, i)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    tg = bench(grad_fn(ours(**cfg)), q, kv, idx, reps=3)
    modes = {}
    if impl == "pallas_gpu":      # each way of adding up the latent rows' gradient
        for mode in ("sorted", "by_key"):
            modes[mode] = bench(grad_fn(ours(dkv_mode=mode, **cfg)), q, kv, idx, reps=3)
    txf = bench(xla_fn, q, kv, idx, reps=3)
    txg = bench(grad_fn(lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, impl="xla")),
                q, kv, idx, reps=3)
    tb = max(tg - tf, 1e-9)
    tcf = None
    if on_gpu:
        try:
            tcf = bench(jax.jit(functools.partial(cudnn_attention, causal=True)),
                        q, kv[:, :S], reps=3)
        except Exception as e:
            print(f"  cudnn prefill unavailable: {type(e).__name__}: {str(e)[:160]}")
    print("| pass | ours ms | TFLOP/s | % of matmul | xla ms |")
    print("|---|---|---|---|---|")
    print(f"| forward | {tf * 1e3:.2f} | {fwd_flops / tf / 1e12:.0f} | {100 * fwd_flops / tf / mm:.0f}% "
          f"| {txf * 1e3:.2f} |")
    print(f"| backward (grad - fwd) | {tb * 1e3:.2f} | {bwd_flops / tb / 1e12:.0f} | "
          f"{100 * bwd_flops / tb / mm:.0f}% | {(txg - txf) * 1e3:.2f} |")
    print(f"| forward + backward | {tg * 1e3:.2f} | {(fwd_flops + bwd_flops) / tg / 1e12:.0f} | "
          f"{100 * (fwd_flops + bwd_flops) / tg / mm:.0f}% | {txg * 1e3:.2f} |")
    for mode, t in modes.items():
        print(f"| backward, dkv_mode={mode} | {(t - tf) * 1e3:.2f} | {bwd_flops / (t - tf) / 1e12:.0f} | "
              f"{100 * bwd_flops / (t - tf) / mm:.0f}% | |")
    print(f"best forward config: {cfg}")
    if tcf is not None:
        dense_flops = 2 * S * S / 2 * heads * (DK + DV)
        print(f"cudnn dense causal forward over {S} keys: {tcf * 1e3:.2f} ms "
              f"({dense_flops / tcf / 1e12:.0f} TFLOP/s); sparse top-{K} beats it above a context of "
              f"~{int(S * tf / (2 * tcf))} keys (dense time grows linearly with the keys each query sees)")
    report["prefill"] = dict(queries=S, context=T, topk=K, fwd=tf, grad=tg, bwd=tb, config=cfg,
                             xla_fwd=txf, xla_grad=txg, cudnn_fwd_causal_S=tcf,
                             fwd_tflops=fwd_flops / tf / 1e12, bwd_tflops=bwd_flops / tb / 1e12,
                             heads=heads, grad_by_dkv_mode=modes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
