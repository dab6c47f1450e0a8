"""Sparse MLA at the default training recipe's shape, per dkv mode, old beside new: the
`--shape default-py` entry of benchmarks/sparse_mla_backward.py (its docstring says what is
printed).

    PYTHONPATH=. python3 benchmarks/sparse_mla_backward.py --shape default-py --json out.json
    PYTHONPATH=. python3 benchmarks/sparse_mla_backward.py --shape default-py --smoke   # CPU

One call = one layer: q [16, 4096, 8, 160], kv [16, 4096, 160], top-256 indices, bf16.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk
from benchmarks._measure import bench, ceilings
from benchmarks._report import failure, write_json
from pallas_kernels.sparse_mla import gpu, gpu_backward as gb, gpu_keys, gpu_pairs, gpu_tiles, transpose as tr

#: configs/default-py.yaml's attention: batch, sequence, heads, kv_lora + rope, kv_lora, top-k, layers.
SHAPE = dict(batch=16, seq_len=4096, heads=8, dk=160, v_dim=128, topk=256, layers=12)
SMOKE = dict(batch=1, seq_len=64, heads=8, dk=160, v_dim=128, topk=16, layers=12)
#: qk_head_dim ** -0.5 (nope 64 + rope 32).
SCALE = 96 ** -0.5
#: The HBM bandwidth the copy floor is counted at, by device kind (datasheet figures).
NOMINAL_BW = {"H200": 4.8e12, "H100": 3.35e12}
MODES = ("by_key", "sorted")
#: Settings of the keys kernel timed by --sweep (gpu_keys.keys_call's).
SWEEP = [dict(block_rows=64, tile_cols=64, num_warps=4, num_stages=2, paired=True),
         dict(block_rows=64, tile_cols=64, num_warps=4, num_stages=3, paired=True),
         dict(block_rows=64, tile_cols=32, num_warps=4, num_stages=3, paired=True),
         dict(block_rows=128, tile_cols=64, num_warps=4, num_stages=2, paired=True),
         dict(block_rows=128, tile_cols=32, num_warps=4, num_stages=2, paired=True),
         dict(block_rows=64, tile_cols=64, num_warps=2, num_stages=2, paired=True)]


def add_arguments(ap) -> None:
    ap.add_argument("--modes", default=",".join(MODES + ("xla",)),
                    help="default-py: comma-separated dkv modes of pallas_gpu (and 'xla') to time")
    ap.add_argument("--indices", default=None, help="default-py: int32 [B, S, K] .npy of a real indexer's top-k")
    ap.add_argument("--reps", type=int, default=5, help="default-py: timed repeats (median)")


def causal_indices(key, batch: int, seq_len: int, topk: int) -> jax.Array:
    """int32 [B, S, K]: query s selects min(K, s + 1) distinct keys of [0, s] uniformly, then -1."""
    causal = jnp.tril(jnp.ones((seq_len, seq_len), jnp.bool_))

    def one(k):
        u = jnp.where(causal, jax.random.uniform(k, (seq_len, seq_len)), -1.0)
        val, idx = lax.top_k(u, topk)
        return jnp.where(val >= 0, idx, -1).astype(jnp.int32)

    return lax.map(one, jax.random.split(key, batch))


def inputs(shape, key, indices_file=None):
    b, s, h, dk, k = shape["batch"], shape["seq_len"], shape["heads"], shape["dk"], shape["topk"]
    kq, kk, ki, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s, h, dk), jnp.bfloat16)
    kv = jax.random.normal(kk, (b, s, dk), jnp.bfloat16)
    dout = jax.random.normal(kd, (b, s, h, shape["v_dim"]), jnp.bfloat16)
    if indices_file:
        idx = jnp.asarray(np.load(indices_file), jnp.int32)
        if idx.shape != (b, s, k):
            raise SystemExit(f"--indices: want int32 [{b}, {s}, {k}], got {idx.shape}")
    else:
        idx = jax.jit(causal_indices, static_argnums=(1, 2, 3))(ki, b, s, k)
    return q, kv, idx, dout


def attention(mode: str, v_dim: int, *, pad_heads: bool, interpret: bool):
    """sparse_mla(q, kv, idx) -> (out, lse) of `mode` (a dkv mode of pallas_gpu, or "xla"); with
    pad_heads the queries are padded to 16 heads in memory first and the outputs sliced back
    (the data movement of the kernels before they read unpadded heads)."""
    def fn(q, kv, idx):
        heads = q.shape[2]
        if pad_heads:
            q = jnp.pad(q, ((0, 0), (0, 0), (0, gpu_tiles.head_rows(heads) - heads), (0, 0)))
        if mode == "xla":
            out, lse = pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=v_dim, impl="xla")
        else:
            out, lse = pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=v_dim, impl="pallas_gpu",
                                     config=pk.SparseMLAGpuConfig(dkv_mode=mode), interpret=interpret)
        return out[:, :, :heads], lse[:, :, :heads]
    return fn


def grad_fn(fn, dout):
    def loss(q, kv, idx):
        out, lse = fn(q, kv, idx)
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) * 0.1
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + lse_term
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(modes, interpret: bool) -> dict:
    """bf16 gradients of each mode (unpadded heads) against the XLA impl in float32, at 8 and 3
    heads, causal random indices with 20% holes and an empty row: relative L2 of out, dq, dkv."""
    b, s, k = (1, 48, 16) if interpret else (2, 512, 64)
    res = {}
    for heads in (8, 3):
        shape = dict(SHAPE, batch=b, seq_len=s, topk=k, heads=heads)
        q, kv, idx, dout = inputs(shape, jax.random.key(heads))
        idx = jnp.where(jax.random.uniform(jax.random.key(9), idx.shape) < 0.2, -1, idx).at[0, 5].set(-1)
        ref = attention("xla", shape["v_dim"], pad_heads=False, interpret=False)
        want_out = jax.jit(ref)(q.astype(jnp.float32), kv.astype(jnp.float32), idx)[0]
        want = grad_fn(ref, dout)(q.astype(jnp.float32), kv.astype(jnp.float32), idx)
        for mode in modes:
            fn = attention(mode, shape["v_dim"], pad_heads=False, interpret=interpret)
            try:
                out = jax.jit(fn)(q, kv, idx)[0]
                dq, dkv = grad_fn(fn, dout)(q, kv, idx)
                res[f"{mode} H={heads}"] = {"out": rel(out, want_out), "dq": rel(dq, want[0]),
                                            "dkv": rel(dkv, want[1])}
            except Exception as e:  # noqa: BLE001 - a kernel that does not compile: report it, go on
                res[f"{mode} H={heads}"] = {"failed": failure(e)}
    return res


def floors(shape, idx, bw) -> dict:
    """Copy floors in ms: the valid selected rows' bytes at `bw` (forward: once; forward +
    backward: twice, the backward gathering them again for dq)."""
    pairs = int(jnp.sum((idx >= 0) & (idx < shape["seq_len"])))
    rows = pairs * shape["dk"] * 2
    return {"pairs": pairs, "row_bytes": rows, "fwd_ms": rows / bw * 1e3, "fwd_bwd_ms": 2 * rows / bw * 1e3}


def time_modes(shape, modes, q, kv, idx, dout, *, reps, interpret) -> dict:
    """Per mode: fwd+bwd ms, old (heads padded in memory) and new, and whether two runs of the new
    gradient are bitwise equal; the forward (the same kernel in every dkv mode) once, as mode
    "forward" (and "xla"'s own)."""
    rows = {}

    def timed(r, key, fn):
        try:
            r[key] = bench(fn, q, kv, idx, reps=reps, inner=1) * 1e3
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it, go on
            r[key.replace("_ms", "_failed")] = failure(e)

    fwd = {}
    for label, pad in (("new", False), ("old", True)):
        timed(fwd, f"fwd_{label}_ms", jax.jit(attention("by_key", shape["v_dim"], pad_heads=pad, interpret=interpret)))
    rows["forward"] = fwd
    for mode in modes:
        r = {}
        for label, pad in (("new", False), ("old", True)):
            if mode == "xla" and pad:
                continue
            fn = attention(mode, shape["v_dim"], pad_heads=pad, interpret=interpret)
            if mode == "xla":
                timed(r, "fwd_new_ms", jax.jit(fn))
            g = grad_fn(fn, dout)
            timed(r, f"fwd_bwd_{label}_ms", g)
            if label == "new" and f"fwd_bwd_{label}_ms" in r:
                a, b2 = g(q, kv, idx), g(q, kv, idx)
                r["repeatable"] = bool(all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b2)))
                del a, b2
        rows[mode] = r
        print(f"  timed {mode}: {json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})}",
              flush=True)
    return rows


def parts(shape, q, kv, idx, dout, *, reps, interpret) -> dict:
    """The deterministic backwards' pieces alone, given the forward's lse: index builds, the dq
    kernel and the keys kernel (by_key), pairs + reduce (sorted)."""
    v, dk = shape["v_dim"], shape["dk"]
    num_keys = kv.shape[1]
    out, lse = jax.jit(attention("by_key", v, pad_heads=False, interpret=interpret))(q, kv, idx)
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
    key_index = jax.jit(functools.partial(gb.key_index, num_keys=num_keys, dk=dk))
    sorted_index = jax.jit(functools.partial(gb.backward_index, num_keys=num_keys, dk=dk, dtype=kv.dtype))
    res = {}

    def timed(name, fn, *args):
        try:
            res[name] = bench(fn, *args, reps=reps, inner=1) * 1e3
        except Exception as e:  # noqa: BLE001 - report it, go on
            res[name] = float("nan")
            res[name.replace("_ms", "_failed")] = failure(e)

    timed("key_index_ms", key_index, idx)
    timed("sorted_index_ms", sorted_index, idx)
    kmap, tindex = key_index(idx), sorted_index(idx)
    q2, do2, lse2, delta2, kv2, idx2 = gb.query_major(q, kv, idx, dout, lse, delta)
    dq_rows = jax.jit(lambda *a: gpu_pairs.pairs_call(*a, seq_len=shape["seq_len"], sm_scale=SCALE, block_k=64,
                                               col_block=gpu_tiles.DEFAULT_COL_BLOCK, fuse_dq=True, num_warps=4,
                                               num_stages=2, interpret=interpret))
    timed("dq_kernel_ms", dq_rows, q2, do2, lse2, delta2, kv2, idx2)
    keys = jax.jit(lambda kv, q, do, lse, delta, km: gpu_keys.keys_call(
        kv, q, do, lse, delta, km, sm_scale=SCALE, v_dim=v, col_block=gpu_tiles.DEFAULT_COL_BLOCK,
        tile_cols=gpu_tiles.KEYS_TILE_COLS, num_warps=4, num_stages=2, interpret=interpret))
    timed("keys_kernel_ms", keys, kv, q, dout, lse, delta, kmap)
    by_key = jax.jit(lambda *a: gb.backward_by_key(*a[:6], sm_scale=SCALE, v_dim=v, tindex=a[6], interpret=interpret))
    timed("by_key_backward_ms", by_key, q, kv, idx, dout, lse, delta, kmap)
    srt = jax.jit(lambda *a: gb.backward(*a[:6], sm_scale=SCALE, v_dim=v, tindex=a[6], interpret=interpret))
    timed("sorted_backward_ms", srt, q, kv, idx, dout, lse, delta, tindex)
    res["sorted_chunks"] = tindex.num_chunks
    return res


#: Settings of the dq kernel (the pairs kernel without pair gradients) timed by --sweep.
DQ_SWEEP = [dict(block_k=64, num_warps=4, num_stages=2), dict(block_k=64, num_warps=4, num_stages=3),
            dict(block_k=128, num_warps=4, num_stages=2)]


def keys_flops(shape, kmap: tr.KeyBitmap, tile_cols: int) -> float:
    """Matmul FLOPs of the keys kernel: its visited tiles (spans) x 2 x slots x (2 Dk + 2 v)."""
    slots = gpu_tiles.query_slots(shape["heads"])
    tq = max(1, min(tr.WORD_BITS, tile_cols // slots))
    spans = np.asarray(kmap.spans)
    per_word = tr.WORD_BITS // tq
    tiles = np.minimum(spans[:, 1] * per_word, -(-shape["seq_len"] // tq)) - spans[:, 0] * per_word
    cand = float(np.maximum(tiles, 0).sum()) * tq * slots * kmap.block_rows
    return cand * 2 * (2 * shape["dk"] + 2 * shape["v_dim"])


def sweep(shape, q, kv, idx, dout, *, interpret) -> None:
    """The keys kernel (given lse and delta) for each setting of SWEEP, and the dq kernel for
    each of DQ_SWEEP."""
    v = shape["v_dim"]
    out, lse = jax.jit(attention("by_key", v, pad_heads=False, interpret=interpret))(q, kv, idx)
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
    for cfg in SWEEP:
        kmap = gb.key_index(idx, kv.shape[1], dk=shape["dk"], block_rows=cfg["block_rows"])
        fn = jax.jit(lambda kv, q, do, lse, delta, km, cfg=cfg: gpu_keys.keys_call(
            kv, q, do, lse, delta, km, sm_scale=SCALE, v_dim=v, col_block=gpu_tiles.DEFAULT_COL_BLOCK,
            tile_cols=cfg["tile_cols"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            interpret=interpret, paired=cfg["paired"]))
        try:
            t = bench(fn, kv, q, dout, lse, delta, kmap, reps=5, inner=1)
            rate = keys_flops(shape, kmap, cfg["tile_cols"]) / t / 1e12
            print(f"sweep keys kernel {cfg}: {t * 1e3:.3f} ms, {rate:.0f} TFLOP/s on its tiles", flush=True)
        except Exception as e:  # noqa: BLE001 - a setting that does not fit: report it, go on
            print(f"sweep keys kernel {cfg}: failed {failure(e)}", flush=True)
    args = gb.query_major(q, kv, idx, dout, lse, delta)
    for cfg in DQ_SWEEP:
        fn = jax.jit(lambda *a, cfg=cfg: gpu_pairs.pairs_call(*a, seq_len=shape["seq_len"], sm_scale=SCALE,
                                                       col_block=gpu_tiles.DEFAULT_COL_BLOCK, fuse_dq=True,
                                                       interpret=interpret, **cfg))
        try:
            print(f"sweep dq kernel {cfg}: {bench(fn, *args, reps=5, inner=1) * 1e3:.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"sweep dq kernel {cfg}: failed {failure(e)}", flush=True)


def _fmt(r, key):
    v = r.get(key)
    return f"{v:.2f}" if isinstance(v, float) else "-"


def main(args) -> None:
    interpret = args.smoke
    shape = SMOKE if args.smoke else SHAPE
    modes = [m for m in args.modes.split(",") if m]
    dev = jax.devices()[0]
    kind = str(dev.device_kind)
    report = {"device": kind, "jax": jax.__version__, "shape": shape}
    print(f"# sparse MLA, one layer of configs/default-py.yaml on {kind}, jax {jax.__version__}"
          f"{' (interpret, smoke)' if interpret else ''}")
    bw_copy, mm = ceilings(args.smoke)
    nominal = next((v for k, v in NOMINAL_BW.items() if k in kind), bw_copy)
    report.update(copy_bw=bw_copy, matmul=mm, nominal_bw=nominal)
    print(f"copy bandwidth {bw_copy / 1e12:.2f} TB/s measured (read + write), HBM {nominal / 1e12:.2f} TB/s "
          f"for the floor; bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    t0 = time.time()
    q, kv, idx, dout = inputs(shape, jax.random.key(0), args.indices)
    b, s, h, dk, k = (shape[n] for n in ("batch", "seq_len", "heads", "dk", "topk"))
    auto = gpu.resolve_dkv_mode(gpu.SparseMLAGpuConfig(), seq_len=s, num_keys=s, heads=h, dk=dk, v_dim=shape["v_dim"],
                         topk=k, itemsize=2)
    fl = floors(shape, idx, nominal)
    report.update(floors=fl, auto=auto, indices=args.indices or "causal random")
    print(f"q [{b}, {s}, {h}, {dk}], kv [{b}, {s}, {dk}], v {shape['v_dim']}, top-{k} "
          f"({args.indices or 'causal random'} indices, {fl['pairs']} valid pairs); 'auto' takes dkv_mode "
          f"{auto!r} here")
    if args.sweep:
        sweep(shape, q, kv, idx, dout, interpret=interpret)
        return
    if not args.no_check:
        report["check"] = check([m for m in modes if m != "xla"], interpret)
        for name, v in report["check"].items():
            print(f"check {name} vs xla (f32): " + (v["failed"] if "failed" in v else
                                                    f"out {v['out']:.1e}  dq {v['dq']:.1e}  dkv {v['dkv']:.1e}"))
    report["modes"] = time_modes(shape, modes, q, kv, idx, dout, reps=args.reps, interpret=interpret)
    report["parts"] = parts(shape, q, kv, idx, dout, reps=args.reps, interpret=interpret)
    print(f"(ran {time.time() - t0:.0f} s)\n")
    print(f"## one layer (x{shape['layers']} layers per step); ms; old = the queries padded to "
          f"{gpu_tiles.head_rows(h)} heads in memory before the kernels (their data movement before), new = read "
          "unpadded (both with this tree's chunk handling of 'sorted'; the code before, padded heads and "
          "sliced chunks, took 16.6 ms fwd+bwd on an H100)")
    print(f"copy floor (the {fl['row_bytes'] / 1e9:.2f} GB of selected rows at {nominal / 1e12:.2f} TB/s): "
          f"fwd {fl['fwd_ms']:.2f}, fwd+bwd {fl['fwd_bwd_ms']:.2f}")
    fwd = report["modes"].pop("forward")
    print(f"forward (the same kernel in every dkv mode): old {_fmt(fwd, 'fwd_old_ms')}, new "
          f"{_fmt(fwd, 'fwd_new_ms')}{' ' + str(fwd) if any('failed' in k for k in fwd) else ''}")
    print("| dkv mode | fwd+bwd old | fwd+bwd new | bwd new (- fwd new) | new / floor (fwd+bwd) | bitwise repeatable |")
    print("|---|---|---|---|---|---|")
    for mode, r in report["modes"].items():
        f_new = r.get("fwd_new_ms", fwd.get("fwd_new_ms"))
        bwd = (r["fwd_bwd_new_ms"] - f_new) if "fwd_bwd_new_ms" in r and f_new is not None else None
        ratio = r["fwd_bwd_new_ms"] / fl["fwd_bwd_ms"] if "fwd_bwd_new_ms" in r else None
        fails = "; ".join(v[:120] for key, v in r.items() if key.endswith("failed"))
        name = f"{mode}{' (auto)' if mode == auto else ''}" + (f" (fwd {f_new:.2f})" if mode == "xla" and f_new else "")
        print(f"| {name} | {_fmt(r, 'fwd_bwd_old_ms')} | {_fmt(r, 'fwd_bwd_new_ms')} | "
              f"{'-' if bwd is None else f'{bwd:.2f}'} | {'-' if ratio is None else f'{ratio:.1f}x'} | "
              f"{r.get('repeatable', '-')}{' ' + fails if fails else ''} |")
    report["modes"]["forward"] = fwd
    p = report["parts"]
    print(f"backward parts alone (given lse): by_key {p['by_key_backward_ms']:.2f} = dq kernel "
          f"{p['dq_kernel_ms']:.2f} + keys kernel {p['keys_kernel_ms']:.2f}; sorted {p['sorted_backward_ms']:.2f} "
          f"({p['sorted_chunks']} query chunks); index builds: key bitmap {p['key_index_ms']:.2f}, "
          f"sorted {p['sorted_index_ms']:.2f} (once per IndexShare group)")
    write_json(args.json, report)
