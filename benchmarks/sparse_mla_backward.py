"""Sparse MLA backward: the deterministic GPU backward (`sparse_mla.gpu_backward`) against the
GPU kernel's "by_key" dkv mode (`impl="pallas_gpu"`) and the XLA impl, next to the ceilings.

    PYTHONPATH=. python3 benchmarks/sparse_mla_backward.py --json out.json     # on a GPU
    PYTHONPATH=. python3 benchmarks/sparse_mla_backward.py --smoke             # CPU, interpret

Prints, in one run: the measured copy bandwidth and bf16 matmul rate (benchmarks/_measure.py);
a correctness check on fresh random inputs (bf16 gradients of every GPU backward against the
XLA impl's in float32, with -1 padding and an empty row); then at (a) 16 heads, 64K queries,
T = 64K and (b) 64 heads, 8K queries, T = 128K (Dk 576, v 512, top-2048, uniformly random
indices: no two neighbouring queries share rows, the worst case for caches) the forward,
forward + backward and backward (= the difference) of each implementation with ms, TFLOP/s
and % of the matmul rate; the new backward alone (its kernels, given the transposed index)
and the transposed index build; the bandwidth floor of the new design and of any design;
the largest |difference| of dq and dkv against the XLA impl; and whether two runs of
each backward give bitwise equal gradients.

    PYTHONPATH=. python3 benchmarks/sparse_mla_backward.py --shape default-py       # on a GPU
    PYTHONPATH=. python3 benchmarks/sparse_mla_backward.py --shape default-py --smoke

`--shape default-py` times instead the attention of one layer of the default training recipe
(configs/default-py.yaml: B=16 x S=4096 queries, 8 heads, Dk 160 = kv_lora 128 + rope 32, v
128, top-256 of the sequence's 4096 keys, bf16), once per dkv mode of `impl="pallas_gpu"`
("by_key", "sorted"; `--modes`) and the XLA impl: forward and forward +
backward (`jax.grad` in q and kv of a loss of out and lse), "old" (the queries padded to 16
heads in memory before the kernels, as they were: `jnp.pad` of q, the outputs sliced back)
beside "new" (the kernels read the 8 heads and pad inside the program), with the copy floor
(the selected rows' bytes at the HBM bandwidth: once for the forward, twice for forward +
backward) and what "auto" takes at this shape. Indices: causal random (query s selects
min(K, s + 1) distinct keys of [0, s]), or `--indices FILE.npy` (int32 [B, S, K], e.g. a trained
indexer's top-k). Then the parts of the deterministic backwards alone (the indices' bitmap and
sorted index, the dq kernel, the keys kernel, pairs + reduce), a correctness check against the
XLA impl in float32 at heads 8 and 3, and `--sweep` times the keys kernel's settings.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks import _sparse_mla_default_py as default_py
from benchmarks._report import failure, write_json
from benchmarks._sparse_mla_default_py import grad_fn
from benchmarks._measure import bench, ceilings
from pallas_kernels.sparse_mla import gpu, gpu_backward as gb, gpu_pairs, gpu_tiles
from pallas_kernels.sparse_mla import transpose as tr

DK, DV = 576, 512
SCALE = 192 ** -0.5


def inputs(key, S, T, K, heads, dtype=jnp.bfloat16):
    kq, kk, ki, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (1, S, heads, DK), dtype)
    kv = jax.random.normal(kk, (1, T, DK), dtype)
    idx = jax.random.randint(ki, (1, S, K), 0, T, jnp.int32)
    dout = jax.random.normal(kd, (1, S, heads, DV), dtype)
    return q, kv, idx, dout


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def new_config(bwd_cfg):
    """The `gpu.SparseMLAGpuConfig` of "new": dkv_mode "sorted", the forward at one program per
    query of 64 rows per step, and bwd_cfg (`gb.backward`'s keyword settings) as its `bwd_`
    fields."""
    return gpu.SparseMLAGpuConfig(dkv_mode="sorted", block_k=64, num_splits=1,
                                  **{f"bwd_{name}": value for name, value in bwd_cfg.items()})


def impls(interpret, heads, bwd_cfg):
    """name -> sparse_mla(q, kv, idx) -> (out, lse). "pallas_gpu by_key": the other backward of
    `sparse_mla.gpu.sparse_mla`; "new" is this backward ("sorted", `new_config`), which
    `pk.sparse_mla(impl="pallas_gpu")` takes by default at these shapes."""
    common = dict(sm_scale=SCALE, v_dim=DV, interpret=interpret)
    out = {
        "new": lambda q, kv, i: gpu.sparse_mla(q, kv, i, config=new_config(bwd_cfg), **common),
        "pallas_gpu by_key": lambda q, kv, i: gpu.sparse_mla(q, kv, i, config=gpu.SparseMLAGpuConfig(
            dkv_mode="by_key"), **common),
        "xla": lambda q, kv, i: pk.sparse_mla(q, kv, i, impl="xla", sm_scale=SCALE, v_dim=DV),
    }
    return out


def check(interpret, key, bwd_cfg):
    """bf16 gradients of each GPU backward vs the XLA impl on upcast inputs (relative L2)."""
    S, T, K, heads = (3, 256, 40, 16) if interpret else (5, 4096, 2048, 64)
    res = {}
    for h in ((heads,) if interpret else (16, 64)):
        q, kv, idx, dout = inputs(key, S, T, K, h)
        idx = jnp.where(jax.random.uniform(jax.random.key(5), idx.shape) < 0.3, -1, idx)
        idx = idx.at[0, 0].set(-1).at[0, 1, 0].set(T + 7)
        ref = grad_fn(impls(False, h, {})["xla"], dout)(q.astype(jnp.float32), kv.astype(jnp.float32), idx)
        for name, fn in impls(interpret, h, bwd_cfg).items():
            if name == "xla":
                continue
            dq, dkv = grad_fn(fn, dout)(q, kv, idx)
            res[f"{name} H={h}"] = {"dq": rel(dq, ref[0]), "dkv": rel(dkv, ref[1])}
    return res


def bytes_floor(S, H, K, T, dk_bytes=2, fuse_dq=True):
    """(any design, this design) bytes of one backward: gathered rows, q / dout read, dq written,
    dkv written; this design adds the per-pair gradients written and read back (bf16) and, when
    dq is not fused, the rows gathered again and ds^T written and read."""
    gather = S * K * DK * dk_bytes
    q_io = S * H * (2 * DK + DV) * dk_bytes
    dkv = T * DK * 4
    anyd = gather + q_io + dkv
    ours = anyd + 2 * S * K * DK * dk_bytes
    if not fuse_dq:
        ours += gather + 2 * S * K * H * dk_bytes
    return anyd, ours


def run_shape(name, S, T, K, heads, bw, mm, interpret, bwd_cfg, which, report, reps):
    print(f"\n## ({name}) {heads} heads, {S} queries, T={T}, K={K}, Dk={DK}, v={DV}, bf16, "
          f"random indices")
    q, kv, idx, dout = inputs(jax.random.key(S + heads), S, T, K, heads)
    fwd_flops = 2 * S * heads * K * (DK + DV)
    bwd_flops = 2 * S * heads * K * (3 * DK + 2 * DV)
    fuse = bwd_cfg.get("fuse_dq", gpu_tiles.head_rows(heads) <= gpu_tiles.FUSED_DQ_MAX_HEADS)
    anyd, ours = bytes_floor(S, heads, K, T, fuse_dq=fuse)
    row = dict(shape=name, S=S, T=T, K=K, heads=heads, fwd_flops=fwd_flops, bwd_flops=bwd_flops,
               matmul_limit_bwd_ms=bwd_flops / mm * 1e3, bytes_any=anyd, bytes_new=ours,
               bw_limit_any_ms=anyd / bw * 1e3, bw_limit_new_ms=ours / bw * 1e3, impls={})
    print(f"backward limits: matmul {row['matmul_limit_bwd_ms']:.1f} ms ({bwd_flops / 1e12:.2f} TFLOP); "
          f"bandwidth, any design (rows gathered once, q/dout/dq/dkv once) {row['bw_limit_any_ms']:.1f} ms "
          f"({anyd / 1e9:.0f} GB); this design (+ per-pair gradients written and read"
          f"{'' if fuse else ', rows re-gathered for dq'}) {row['bw_limit_new_ms']:.1f} ms ({ours / 1e9:.0f} GB)")
    fns = impls(interpret, heads, bwd_cfg)
    grads = {}
    print("| impl | fwd ms | fwd+bwd ms | bwd ms | bwd TFLOP/s | % of matmul | max|d dq| vs xla | "
          "max|d dkv| vs xla | bitwise repeatable |")
    print("|---|---|---|---|---|---|---|---|---|")
    for impl in which:
        fn = fns[impl]
        r = {}
        try:
            r["fwd_ms"] = bench(jax.jit(fn), q, kv, idx, reps=reps, inner=1) * 1e3
            g = grad_fn(fn, dout)
            r["grad_ms"] = bench(g, q, kv, idx, reps=reps, inner=1) * 1e3
            r["bwd_ms"] = r["grad_ms"] - r["fwd_ms"]
            r["bwd_tflops"] = bwd_flops / (r["bwd_ms"] * 1e-3) / 1e12
            r["bwd_pct_matmul"] = 100 * bwd_flops / (r["bwd_ms"] * 1e-3) / mm
            a = jax.block_until_ready(g(q, kv, idx))
            b = jax.block_until_ready(g(q, kv, idx))
            r["bitwise_repeatable"] = bool(all(np.array_equal(np.asarray(x), np.asarray(y))
                                               for x, y in zip(a, b)))
            grads[impl] = a
            del b
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it, go on
            r["failed"] = failure(e)
        row["impls"][impl] = r
    base = "xla" if "xla" in grads else None
    for impl, r in row["impls"].items():
        if impl in grads and base is not None:
            r["max_abs_dq_vs_xla"] = float(jnp.max(jnp.abs(grads[impl][0].astype(jnp.float32)
                                                               - grads[base][0].astype(jnp.float32))))
            r["max_abs_dkv_vs_xla"] = float(jnp.max(jnp.abs(grads[impl][1].astype(jnp.float32)
                                                                - grads[base][1].astype(jnp.float32))))
            r["rel_dkv_vs_xla"] = rel(grads[impl][1], grads[base][1])
        if "failed" in r:
            print(f"| {impl} | failed: {r['failed'][:200]} |")
            continue
        print(f"| {impl} | {r['fwd_ms']:.2f} | {r['grad_ms']:.2f} | {r['bwd_ms']:.2f} | "
              f"{r['bwd_tflops']:.0f} | {r['bwd_pct_matmul']:.1f}% | "
              f"{r.get('max_abs_dq_vs_xla', float('nan')):.3g} | "
              f"{r.get('max_abs_dkv_vs_xla', float('nan')):.3g} | {r['bitwise_repeatable']} |")
    grads.clear()

    # the new backward's parts: the transposed index (once per IndexShare group) and the kernels
    chunk = tr.default_chunk_rows(S, K, DK, 2, bwd_cfg.get("budget", gpu_tiles.DEFAULT_BUDGET))
    build = jax.jit(functools.partial(tr.transpose_index, num_keys=T, chunk_rows=chunk))
    t_idx = bench(build, idx, reps=reps, inner=1) * 1e3
    tindex = build(idx)
    out, lse = jax.jit(fns["new"])(q, kv, idx)
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
    kcfg = {k: v for k, v in bwd_cfg.items() if k != "budget"}
    bwd = jax.jit(lambda q, kv, i, d, l, de, t: gb.backward(q, kv, i, d, l, de, sm_scale=SCALE,
                                                              v_dim=DV, tindex=t, interpret=interpret,
                                                              **kcfg))
    t_bwd = bench(bwd, q, kv, idx, dout, lse, delta, tindex, reps=reps, inner=1) * 1e3
    row["new_index_ms"] = t_idx
    row["new_kernels_ms"] = t_bwd
    row["new_chunks"] = tindex.num_chunks
    print(f"new backward alone: kernels {t_bwd:.2f} ms ({bwd_flops / t_bwd / 1e9:.0f} TFLOP/s, "
          f"{100 * bwd_flops / (t_bwd * 1e-3) / mm:.1f}% of matmul; {ours / (t_bwd * 1e-3) / 1e12:.2f} TB/s "
          f"on this design's bytes = {100 * ours / (t_bwd * 1e-3) / bw:.0f}% of copy bandwidth) + "
          f"transposed index {t_idx:.2f} ms (once per IndexShare group; {tindex.num_chunks} query chunks)")
    report["shapes"].append(row)


def sweep(bw, mm, interpret, configs, shapes):
    """Times the new backward's kernels alone for several settings."""
    for name, S, T, K, heads in shapes:
        q, kv, idx, dout = inputs(jax.random.key(1), S, T, K, heads)
        lse = jnp.zeros((1, S, heads), jnp.float32) + 9.0
        delta = jnp.zeros((1, S, heads), jnp.float32)
        chunk = tr.default_chunk_rows(S, K, DK, 2, gpu_tiles.DEFAULT_BUDGET)
        tindex = jax.jit(functools.partial(tr.transpose_index, num_keys=T, chunk_rows=chunk))(idx)
        flops = 2 * S * heads * K * (3 * DK + 2 * DV)
        for cfg in configs:
            fn = jax.jit(lambda q, kv, i, d, l, de, t, cfg=cfg: gb.backward(
                q, kv, i, d, l, de, sm_scale=SCALE, v_dim=DV, tindex=t, interpret=interpret, **cfg))
            try:
                t = bench(fn, q, kv, idx, dout, lse, delta, tindex, reps=3, inner=1)
                print(f"sweep ({name}) {cfg}: {t * 1e3:.2f} ms, {100 * flops / t / mm:.1f}% of matmul",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"sweep ({name}) {cfg}: failed {failure(e)}", flush=True)


def parts(bw, mm, interpret, cfg, shape):
    """Times the new backward's kernels one by one on its first query chunk."""
    name, S, T, K, heads = shape
    q, kv, idx, dout = inputs(jax.random.key(1), S, T, K, heads)
    cfg = dict(cfg)
    chunk = tr.default_chunk_rows(S, K, DK, 2, cfg.pop("budget", gpu_tiles.DEFAULT_BUDGET))
    tindex = jax.jit(functools.partial(tr.transpose_index, num_keys=T, chunk_rows=chunk))(idx)
    fuse = cfg.get("fuse_dq", gpu_tiles.head_rows(heads) <= gpu_tiles.FUSED_DQ_MAX_HEADS)
    bk = cfg.get("block_k", gpu_tiles.DEFAULT_BLOCK_K)
    col_block = cfg.get("col_block", gpu_tiles.DEFAULT_COL_BLOCK)
    lse = jnp.zeros((1, S, heads), jnp.float32) + 9.0
    q2, do2, lse2, delta2, kv2, idx2 = gb.query_major(q, kv, idx, dout, lse, lse * 0)
    first_chunk = (jnp.zeros((1,), jnp.int32), chunk)
    dq0 = jnp.zeros(q2.shape, q.dtype)
    pairs = jax.jit(lambda *a: gpu_pairs.pairs_call(
        *a[:6], seq_len=S, sm_scale=SCALE, block_k=bk, col_block=col_block, fuse_dq=fuse,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2 if fuse else 1), interpret=interpret,
        pos=a[6], chunk=first_chunk, dq=a[7] if fuse else None, contrib_dtype=jnp.bfloat16,
        evict=cfg.get("evict", False)))
    args = (q2, do2, lse2, delta2, kv2, idx2, tindex.position, dq0)
    t_pairs = bench(pairs, *args, reps=5, inner=1)
    first, contrib = pairs(*args)
    n = tindex.num_chunks
    out = {"chunk_rows": chunk, "chunks": n, "pairs_ms": t_pairs * 1e3}
    pair_bytes = chunk * K * DK * 2 * 2
    line = (f"parts ({name}) {cfg}: chunk {chunk} rows x {n}: pairs kernel {t_pairs * 1e3:.2f} ms/chunk "
            f"({pair_bytes / t_pairs / 1e12:.2f} TB/s gathered + written)")
    if not fuse:
        dq = jax.jit(lambda *a: gpu_pairs.dq_call(*a, first_chunk, seq_len=S, block_k=bk, col_block=col_block,
                                           num_warps=cfg.get("dq_warps", 8), num_stages=cfg.get("dq_stages", 2),
                                           interpret=interpret))
        t_dq = bench(dq, first, kv2, idx2, dq0, reps=5, inner=1)
        out["dq_ms"] = t_dq * 1e3
        line += f"; dq kernel {t_dq * 1e3:.2f} ms ({chunk * K * DK * 2 / t_dq / 1e12:.2f} TB/s gathered)"
    red = jax.jit(lambda c, f, d: gpu_pairs.reduce_call(c, f, d, block=cfg.get("reduce_block", 32),
                                                 num_warps=cfg.get("reduce_warps", 4),
                                                 interpret=interpret, evict=cfg.get("evict", False)))
    dkv0 = jnp.zeros((T, DK), jnp.float32)
    t_red = bench(red, contrib, tindex.offsets[0], dkv0, reps=5, inner=1)
    out["reduce_ms"] = t_red * 1e3
    rb = chunk * K * DK * 2 + T * DK * 8
    line += f"; reduce kernel {t_red * 1e3:.2f} ms ({rb / t_red / 1e12:.2f} TB/s)"
    print(line, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="ab", help="which of (a), (b) to run")
    ap.add_argument("--sweep", action="store_true", help="only time the new kernels' settings")
    ap.add_argument("--cfg", default="{}", help="the new backward's settings (a Python dict of gpu_backward.backward's "
                    "keywords, e.g. \"{'fuse_dq': False}\": SparseMLAGpuConfig's fields bwd_<name>)")
    ap.add_argument("--cfg16", default=None, help="settings at 16 heads (default --cfg)")
    ap.add_argument("--cfg64", default=None, help="settings at 64 heads (default --cfg)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--parts", action="store_true", help="with --sweep: time each kernel alone too")
    ap.add_argument("--shape", default=None, choices=["default-py"],
                    help="time one layer of the default training recipe instead (module docstring)")
    default_py.add_arguments(ap)
    args = ap.parse_args()
    if args.shape == "default-py":
        default_py.main(args)
        return
    interpret = args.smoke
    cfg = {} if args.sweep else eval(args.cfg)  # noqa: S307 - a command-line dict of kernel settings
    cfgs = {16: eval(args.cfg16) if args.cfg16 else cfg, 64: eval(args.cfg64) if args.cfg64 else cfg}
    dev = jax.devices()[0]
    report = {"device": str(dev.device_kind), "jax": jax.__version__, "shapes": [], "cfg": {str(k): v for k, v in cfgs.items()}}
    print(f"# sparse MLA backward on {report['device']}, jax {jax.__version__}"
          f"{' (interpret, smoke)' if interpret else ''}")
    bw, mm = ceilings(args.smoke)
    report["copy_bw"], report["matmul"] = bw, mm
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); bf16 matmul {mm / 1e12:.0f} TFLOP/s; "
          f"ratio {mm / bw:.0f} FLOP/byte")
    if args.smoke:
        shapes = [("a", 64, 256, 64, 16), ("b", 32, 512, 64, 64)]
    else:
        shapes = [("a", 65536, 65536, 2048, 16), ("b", 8192, 131072, 2048, 64)]
    shapes = [s for s in shapes if s[0] in args.shapes]
    if not args.no_check:
        t = time.time()
        chk = check(interpret, jax.random.key(3), {} if args.sweep else cfgs[16])
        report["check"] = chk
        for k, v in chk.items():
            print(f"check {k} vs xla (f32): dq {v['dq']:.1e}  dkv {v['dkv']:.1e}")
        print(f"(check took {time.time() - t:.0f} s)", flush=True)
    if args.sweep:
        configs = eval(args.cfg)  # noqa: S307
        for s in shapes:
            mine = [{k: v for k, v in c.items() if k != "heads"} for c in configs
                    if c.get("heads", s[4]) == s[4]]
            if args.parts:
                for c in mine:
                    try:
                        parts(bw, mm, interpret, c, s)
                    except Exception as e:  # noqa: BLE001
                        print(f"parts ({s[0]}) {c}: failed {failure(e)}")
            else:
                sweep(bw, mm, interpret, mine, [s])
        return
    for name, S, T, K, heads in shapes:
        which = ["new", "pallas_gpu by_key", "xla"]
        run_shape(name, S, T, K, heads, bw, mm, interpret, cfgs[16 if heads <= 32 else 64], which,
                  report, reps=3)
        write_json(args.json, report)


if __name__ == "__main__":
    main()
