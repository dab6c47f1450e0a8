"""The CUDA sparse MLA kernels (impl="cuda", pallas_kernels/attention/cuda.py): check and benchmark
on one GPU, in one run.

    scripts/build_cuda_kernels.sh        # once: build/cuda/libglm_sparse_mla.so
    JAX_PLATFORMS=cuda PYTHONPATH=. python3 benchmarks/sparse_mla_cuda.py --json OUT.json

Stages, each catching and printing its whole exception so that the others still run:
  load      the library loaded and its FFI targets registered;
  forward   the forward (every (block_k, stages) compiled, one split and several) against a float64
            numpy oracle on fresh random inputs: K = 64, 2048 and 100 (padded in the kernel), H 64
            and 128, -1, out-of-range and duplicate indices (counted each, as the kernel does),
            one query with no valid index (out exactly 0, lse -inf); ||out - ref|| / ||ref|| and
            the largest lse error; outputs poisoned with NaN first (best effort: a NaN buffer of
            the same size freed just before, which the allocator tends to hand out again); a NaN
            never passes;
  paged     the paged decode form against the same oracle over a store of shuffled pages;
  bitwise   the same inputs twice (one split, several, paged): bitwise equal outputs;
  grad      gradients through the VJP (CUDA forward, Pallas GPU backward) against the float32
            reference's at a small shape;
  timing    a bf16 8192^3 matmul and a device copy (the ceilings), the forward at GLM-5.2's shape
            (B 1, S 4096, H 64, Dk 576, v 512, K 2048, T 4096) against pallas_gpu in TFLOP/s
            (2 B S H K (Dk + v) FLOPs) and % of the matmul rate; paged decode (batch 64 and 128,
            128K context, pages of 64 rows shuffled) against pallas_gpu in GB/s of the bytes
            moved (selected rows, q, out) and % of the copy bandwidth. Medians over repeats of
            loops of calls on 3 rotated input sets, after a warm-up, each repeat ended by
            block_until_ready.
Then a short markdown table; --json writes everything (after each stage).

    --sanitize   tiny shapes, the CUDA kernels alone (no timing, no Pallas): for
                 XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \\
                     python3 benchmarks/sparse_mla_cuda.py --sanitize
                 (and --tool racecheck, --tool synccheck); the platform allocator gives every
                 buffer its own allocation, so memcheck sees an access past one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks._measure import ceilings
from benchmarks._report import device_kind, write_json
from pallas_kernels.attention import cuda

H, DK, DV = 64, 576, 512
SCALE = DK ** -0.5
#: Pass thresholds of the forward checks (bf16 operands and output, float32 accumulation).
OUT_TOL, LSE_TOL = 1e-2, 1e-3
CONFIGS = [dict(block_k=b, stages=s) for b, s in cuda.BLOCK_STAGES]


def stage(report: dict, name: str, fn, json_path):
    """Runs fn() -> its result into report[name]; an exception is printed whole and recorded."""
    print(f"\n## {name}", flush=True)
    t = time.perf_counter()
    try:
        report[name] = fn()
    except BaseException as e:  # noqa: BLE001 - every stage must run
        if isinstance(e, KeyboardInterrupt):
            raise
        traceback.print_exc()
        sys.stdout.flush()
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    print(f"({name}: {time.perf_counter() - t:.1f} s)", flush=True)
    write_json(json_path, report)


# ----------------------------------------------------------------------------- inputs, oracle


def make_inputs(seed, B, S, T, K, heads=H, *, dup=True, invalid=True):
    """Random bf16 q [B, S, heads, Dk], kv [B, T, Dk], indices int32 [B, S, K] (numpy): rows drawn
    with replacement (duplicates) or without, some -1 and some >= T, and with invalid=True the
    last query of the first sequence with no valid index."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, S, heads, DK), np.float32), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((B, T, DK), np.float32), jnp.bfloat16)
    if dup:
        idx = rng.integers(0, T, (B, S, K))
    else:
        idx = np.stack([np.stack([rng.permutation(T)[:K] for _ in range(S)]) for _ in range(B)])
    if invalid:
        idx = np.where(rng.random((B, S, K)) < 0.1, -1, idx)
        idx = np.where(rng.random((B, S, K)) < 0.03, T + rng.integers(0, 5, (B, S, K)), idx)
        idx[0, -1, :] = -1
    return q, kv, np.asarray(idx, np.int32)


def oracle(q, kv, idx):
    """float64 numpy: softmax over the valid selected rows (duplicates counted each) -> (out
    [B, S, H, DV], lse [B, S, H]); 0 / -inf for a query without a valid row."""
    qf = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    kf = np.asarray(jnp.asarray(kv, jnp.float32), np.float64)
    B, S, heads, _ = qf.shape
    T = kf.shape[1]
    out = np.zeros((B, S, heads, DV))
    lse = np.full((B, S, heads), -np.inf)
    for b in range(B):
        for s in range(S):
            sel = idx[b, s][(idx[b, s] >= 0) & (idx[b, s] < T)]
            if sel.size == 0:
                continue
            rows = kf[b, sel]
            logits = qf[b, s] @ rows.T * SCALE
            m = logits.max(-1, keepdims=True)
            p = np.exp(logits - m)
            l = p.sum(-1, keepdims=True)
            out[b, s] = p @ rows[:, :DV] / l
            lse[b, s] = (m + np.log(l))[:, 0]
    return out, lse


def compare(out, lse, ref_out, ref_lse) -> dict:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    empty = ~np.isfinite(ref_lse)
    nan = bool(np.isnan(out).any() or np.isnan(lse).any())
    rel = float(np.linalg.norm(np.where(np.isnan(out), np.inf, out) - ref_out) / max(np.linalg.norm(ref_out), 1e-30))
    finite = ~empty
    lse_err = float(np.max(np.abs(lse[finite] - ref_lse[finite]))) if finite.any() else 0.0
    empty_ok = bool(np.all(out[empty] == 0) and np.all(lse[empty] == -np.inf))
    ok = (not nan) and rel <= OUT_TOL and lse_err <= LSE_TOL and empty_ok and np.isfinite(rel)
    return dict(rel_err=rel, lse_max_err=lse_err, nan=nan, empty_ok=empty_ok, empty_queries=int(empty.sum()),
                passed=bool(ok))


def poisoned(fn, shapes):
    """fn() after NaN buffers of the output sizes were made and freed (best effort: the allocator
    tends to give the freed blocks to the next outputs of those sizes)."""
    junk = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in shapes]
    jax.block_until_ready(junk)
    del junk
    return jax.block_until_ready(fn())


# ----------------------------------------------------------------------------- stages


def load():
    cuda.ensure_registered()
    return dict(library=str(cuda.library_path()), device=device_kind(), jax=jax.__version__)


def forward_checks(cases, configs, splits_list):
    rows = []
    print("| B | S | T | K | H | block_k | stages | splits | rel err | lse err | empty ok | pass |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for seed, (B, S, T, K, heads) in enumerate(cases):
        q, kv, idx = make_inputs(seed, B, S, T, K, heads)
        ref_out, ref_lse = oracle(q, kv, idx)
        idx_j = jnp.asarray(idx)
        for cfg in configs:
            for splits in splits_list:
                row = dict(B=B, S=S, T=T, K=K, H=heads, splits=splits, **cfg)
                try:
                    fn = jax.jit(lambda q, kv, i, cfg=cfg, splits=splits: cuda.forward(
                        q, kv, i, sm_scale=SCALE, splits=splits, **cfg))
                    out, lse = poisoned(lambda: fn(q, kv, idx_j), [((B, S, heads, DV), jnp.bfloat16),
                                                                   ((B, S, heads), jnp.float32)])
                    row.update(compare(out, lse, ref_out, ref_lse))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row.update(error=f"{type(e).__name__}: {e}", passed=False)
                rows.append(row)
                print(f"| {B} | {S} | {T} | {K} | {heads} | {cfg['block_k']} | {cfg['stages']} | {splits} | "
                      f"{row.get('rel_err', float('nan')):.2e} | {row.get('lse_max_err', float('nan')):.2e} | "
                      f"{row.get('empty_ok', '-')} | {'PASS' if row['passed'] else 'FAIL'} |", flush=True)
    return dict(rows=rows, passed=all(r["passed"] for r in rows))


def paged_store(seed, B, T, K, page=64, slots=2):
    """q [B, 1, H, Dk], a store [slots, B*n + 1, P, Dk] whose slot 1 holds the rows (pages shuffled,
    page 0 unused), page_table [B, n], indices [B, 1, K] (-1 and >= n*P mixed in), and the
    contiguous kv [B, n*P, Dk] they address."""
    rng = np.random.default_rng(seed)
    n = -(-T // page)
    q = jnp.asarray(rng.standard_normal((B, 1, H, DK), np.float32), jnp.bfloat16)
    store = jnp.asarray(rng.standard_normal((slots, B * n + 1, page, DK), np.float32), jnp.bfloat16)
    table = np.asarray(1 + rng.permutation(B * n), np.int32).reshape(B, n)
    idx = rng.integers(0, n * page, (B, 1, K))
    idx = np.where(rng.random((B, 1, K)) < 0.1, -1, idx)
    idx = np.where(rng.random((B, 1, K)) < 0.03, n * page + 3, idx).astype(np.int32)
    kv = store[1][jnp.asarray(table)].reshape(B, n * page, DK)
    return q, store, jnp.asarray(table), idx, kv


def paged_checks(configs, cases=((3, 1000, 300), (2, 4096, 2048))):
    rows = []
    for B, T, K in cases:
        q, store, table, idx, kv = paged_store(B + T, B, T, K)
        ref_out, ref_lse = oracle(q, kv, idx)
        for cfg in configs:
            for splits in (None, 1):
                row = dict(B=B, T=T, K=K, splits=splits, **cfg)
                try:
                    config = cuda.SparseMLACudaConfig(block_k=cfg["block_k"], num_stages=cfg["stages"],
                                                      num_splits=splits)
                    fn = jax.jit(lambda q, st, t, i, config=config: pk.paged_sparse_mla(
                        q, st, t, i, slot=1, sm_scale=SCALE, v_dim=DV, impl="cuda", config=config))
                    out, lse = poisoned(lambda: fn(q, store, table, jnp.asarray(idx)),
                                        [((B, 1, H, DV), jnp.bfloat16), ((B, 1, H), jnp.float32)])
                    row.update(compare(out, lse, ref_out, ref_lse))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row.update(error=f"{type(e).__name__}: {e}", passed=False)
                rows.append(row)
                print(f"paged B={B} T={T} K={K} {cfg} splits={splits}: rel {row.get('rel_err', float('nan')):.2e}, "
                      f"lse {row.get('lse_max_err', float('nan')):.2e} -> {'PASS' if row['passed'] else 'FAIL'}",
                      flush=True)
    return dict(rows=rows, passed=all(r["passed"] for r in rows))


def bitwise():
    q, kv, idx = make_inputs(7, 2, 8, 4096, 2048)
    idx = jnp.asarray(idx)
    rows = []
    for splits in (1, 4):
        fn = jax.jit(lambda q, kv, i, splits=splits: cuda.forward(q, kv, i, sm_scale=SCALE, splits=splits))
        a = jax.block_until_ready(fn(q, kv, idx))
        b = jax.block_until_ready(fn(q, kv, idx))
        same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(a, b))
        rows.append(dict(form="forward", splits=splits, bitwise_equal=same))
    qp, store, table, pidx, _ = paged_store(11, 4, 4096, 2048)
    fn = jax.jit(lambda q, st, t, i: pk.paged_sparse_mla(q, st, t, i, slot=1, sm_scale=SCALE, v_dim=DV, impl="cuda"))
    a = jax.block_until_ready(fn(qp, store, table, jnp.asarray(pidx)))
    b = jax.block_until_ready(fn(qp, store, table, jnp.asarray(pidx)))
    same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(a, b))
    rows.append(dict(form="paged", splits="default", bitwise_equal=same))
    for r in rows:
        print(r, flush=True)
    return dict(rows=rows, passed=all(r["bitwise_equal"] for r in rows))


def grad_check():
    """d/dq, d/dkv of sum(out * w) + sum(lse * w2) (lse of queries with a valid row) through impl
    "cuda" against the float32 reference on the same bf16 inputs (indices without duplicates,
    on which the reference counts once)."""
    B, S, T, K = 1, 4, 512, 128
    q, kv, idx = make_inputs(21, B, S, T, K, dup=False)
    rng = np.random.default_rng(22)
    w = jnp.asarray(rng.standard_normal((B, S, H, DV)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32)
    idx = jnp.asarray(idx)

    def loss(impl, q, kv):
        out, lse = pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, impl=impl)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * w2)

    got = jax.jit(jax.grad(lambda q, kv: loss("cuda", q, kv), argnums=(0, 1)))(q, kv)
    qf, kf = q.astype(jnp.float32), kv.astype(jnp.float32)
    want = jax.jit(jax.grad(lambda q, kv: loss("reference", q, kv), argnums=(0, 1)))(qf, kf)
    res = {}
    for name, g, r in zip(("dq", "dkv"), got, want):
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        r = np.asarray(r, np.float64)
        res[name] = dict(rel_err=float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)),
                         nan=bool(np.isnan(g).any()))
    res["passed"] = all(not v["nan"] and v["rel_err"] < 2e-2 for v in res.values() if isinstance(v, dict))
    print(res, flush=True)
    return res


def timed(fn, arg_sets, reps=7, min_time=0.05):
    """Median seconds per call of fn over arg_sets in rotation (warm-up first)."""
    jax.block_until_ready([fn(*a) for a in arg_sets])
    t = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    once = max(time.perf_counter() - t, 1e-6)
    inner = max(len(arg_sets), min(300, int(min_time / once)))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def timing(report, json_path, smoke):
    res = {}
    bw, mm = ceilings(smoke)
    res.update(copy_bw_gbs=bw / 1e9, matmul_tflops=mm / 1e12)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    report["timing"] = res
    write_json(json_path, report)

    # prefill forward at GLM-5.2's shape
    B, S, T, K = (1, 256, 512, 256) if smoke else (1, 4096, 4096, 2048)
    sets = []
    for i in range(3):
        q, kv, idx = make_inputs(100 + i, B, S, T, K, invalid=False)
        sets.append((q, kv, jnp.asarray(idx)))
    flops = 2 * B * S * H * K * (DK + DV)
    fwd = res["forward"] = []
    print(f"\nforward B={B} S={S} T={T} K={K} H={H}: {flops / 1e12:.2f} TFLOP a call")
    print("| impl | config | ms | TFLOP/s | % of matmul |")
    print("|---|---|---|---|---|", flush=True)
    impls = [("cuda", cfg, jax.jit(lambda q, kv, i, cfg=cfg: cuda.forward(q, kv, i, sm_scale=SCALE, **cfg)))
             for cfg in CONFIGS]
    impls.append(("pallas_gpu", {}, jax.jit(lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV,
                                                                           impl="pallas_gpu"))))
    for name, cfg, fn in impls:
        row = dict(impl=name, config=cfg)
        try:
            t = timed(fn, sets)
            row.update(ms=t * 1e3, tflops=flops / t / 1e12, pct_matmul=100 * flops / t / mm)
            print(f"| {name} | {cfg} | {t * 1e3:.2f} | {flops / t / 1e12:.0f} | {100 * flops / t / mm:.1f}% |",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"| {name} | {cfg} | failed: {type(e).__name__} | | |", flush=True)
        fwd.append(row)
        write_json(json_path, report)
    del sets

    # paged decode
    dec = res["paged_decode"] = []
    T, K, page = (4096, 256, 64) if smoke else (131072, 2048, 64)
    print(f"\npaged decode: H={H}, K={K}, context {T}, pages of {page} rows (shuffled), 1 query a sequence")
    print("| batch | impl | config | us | GB/s | % of copy BW |")
    print("|---|---|---|---|---|---|", flush=True)
    for batch in ((4, 8) if smoke else (64, 128)):
        n = T // page
        sets = []
        rng = np.random.default_rng(batch)
        # distinct pages (every row read is its own address), their values a tiled random block: the
        # random generation of the whole store would need its size again in uint32 temporaries
        base = jax.random.normal(jax.random.key(batch), (1024, page, DK), jnp.bfloat16)
        pages = batch * n + 1
        store = jax.jit(lambda b: jnp.tile(b, (-(-pages // 1024), 1, 1))[None, :pages])(base)   # one buffer
        del base
        for i in range(3):
            q = jax.random.normal(jax.random.key(1000 * batch + i), (batch, 1, H, DK), jnp.bfloat16)
            table = jnp.asarray((1 + rng.permutation(batch * n)).reshape(batch, n), jnp.int32)
            idx = jnp.asarray(rng.integers(0, T, (batch, 1, K)), jnp.int32)
            sets.append((q, store, table, idx))
        moved = batch * K * DK * 2 + batch * H * DK * 2 + batch * H * DV * 2
        impls = [("cuda", cfg, cuda.SparseMLACudaConfig(block_k=cfg["block_k"], num_stages=cfg["stages"]))
                 for cfg in CONFIGS]
        impls.append(("pallas_gpu", {}, None))
        for name, cfg, config in impls:
            row = dict(batch=batch, impl=name, config=cfg)
            try:
                fn = jax.jit(lambda q, st, t, i, name=name, config=config: pk.paged_sparse_mla(
                    q, st, t, i, sm_scale=SCALE, v_dim=DV, impl=name, config=config))
                t = timed(fn, sets)
                row.update(us=t * 1e6, gbs=moved / t / 1e9, pct_copy=100 * moved / t / bw)
                print(f"| {batch} | {name} | {cfg} | {t * 1e6:.0f} | {moved / t / 1e9:.0f} | "
                      f"{100 * moved / t / bw:.1f}% |", flush=True)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"| {batch} | {name} | {cfg} | failed: {type(e).__name__} | | |", flush=True)
            dec.append(row)
            write_json(json_path, report)
        del sets, store
    return res


def summary(report):
    print("\n## summary")
    print("| check / measurement | result |")
    print("|---|---|")
    for name in ("load", "forward", "paged", "bitwise", "grad"):
        part = report.get(name)
        if part is None:
            continue
        if "error" in part:
            print(f"| {name} | ERROR {part['error'].splitlines()[0][:120]} |")
        elif name == "load":
            print(f"| load | {part['device']}, jax {part['jax']} |")
        else:
            worst = ""
            if name in ("forward", "paged"):
                errs = [r.get("rel_err", float("inf")) for r in part["rows"]]
                worst = f" (worst rel err {max(errs):.2e}, {len(errs)} runs)"
            print(f"| {name} | {'PASS' if part.get('passed') else 'FAIL'}{worst} |")
    t = report.get("timing") or {}
    if "error" in t:
        print(f"| timing | ERROR {t['error'].splitlines()[0][:120]} |")
    for r in t.get("forward", []):
        if "ms" in r:
            print(f"| forward {r['impl']} {r['config']} | {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s, "
                  f"{r['pct_matmul']:.1f}% of matmul |")
    for r in t.get("paged_decode", []):
        if "us" in r:
            print(f"| decode b{r['batch']} {r['impl']} {r['config']} | {r['us']:.0f} us, {r['gbs']:.0f} GB/s, "
                  f"{r['pct_copy']:.1f}% of copy BW |")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sanitize", action="store_true", help="tiny shapes, CUDA kernels only (compute-sanitizer)")
    ap.add_argument("--smoke", action="store_true", help="small timing shapes (a quick look)")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    report = {"mode": "sanitize" if args.sanitize else "full"}
    stage(report, "load", load, args.json)
    if args.sanitize:
        stage(report, "forward", lambda: forward_checks([(1, 3, 200, 100, 64)], CONFIGS, (1, 2)), args.json)
        stage(report, "paged", lambda: paged_checks(CONFIGS[:1], ((2, 300, 100),)), args.json)
    else:
        cases = [(2, 4, 256, 64, 64), (2, 3, 4096, 2048, 64), (1, 5, 300, 100, 64), (1, 3, 512, 128, 128)]
        stage(report, "forward", lambda: forward_checks(cases, CONFIGS, (1, 3)), args.json)
        stage(report, "paged", lambda: paged_checks(CONFIGS), args.json)
        stage(report, "bitwise", bitwise, args.json)
        stage(report, "grad", grad_check, args.json)
        if not args.skip_timing:
            stage(report, "timing", lambda: timing(report, args.json, args.smoke), args.json)
    summary(report)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
