"""The CUDA sparse MLA kernels (impl="cuda", pallas_kernels/sparse_mla/cuda.py): check and benchmark
on one GPU, in one run.

    scripts/build_cuda_kernels.sh        # once: build/cuda/libglm_sparse_mla.so
    JAX_PLATFORMS=cuda PYTHONPATH=. python3 benchmarks/sparse_mla_cuda.py --json OUT.json

Stages, each catching and printing its whole exception so that the others still run:
  load      the library loaded and its FFI targets registered;
  forward   the forward (every (block_k, stages) compiled of the mma.sync kernel, `CONFIGS`; one
            split and several; the wgmma kernel's the same checks in stages forward_wgmma and
            paged_wgmma after grad, and its indexer target against a float64 oracle of the target
            in target_wgmma) against a float64
            numpy oracle on fresh random inputs: K = 64, 2048 and 100 (padded in the kernel), H 64
            and 128, -1, out-of-range and duplicate indices (counted each, as the kernel does),
            one query with no valid index (out exactly 0, lse -inf); ||out - ref|| / ||ref|| and
            the largest lse error; outputs poisoned with NaN first (best effort: a NaN buffer of
            the same size freed just before, which the allocator tends to hand out again); a NaN
            never passes;
  paged     the paged decode form against the same oracle over a store of shuffled pages;
  paged_fp8 the paged decode over the same store quantized to FP8 pages (`fp8.Fp8Latent`, the FP8
            kernel's (block_k, stages) pairs) against the oracle on the dequantized float32 rows
            (the kernel rounds them to bf16, as the bf16 store is);
  bitwise   the same inputs twice (one split, several, paged): bitwise equal outputs;
  backward  the CUDA backward kernels alone (`cuda.backward`: dq kernel, dkv kernel over the key
            index) against a float64 numpy oracle of the contract (dq, dkv from lse, delta and
            dout; duplicates counted each): H 64 and 128, K = 64, 2048 and 100, -1, out-of-range
            and duplicate indices, a query with no valid index, T not a multiple of 32; outputs
            poisoned with NaN first; relative errors of dq and dkv;
  bwd_bitwise  the CUDA backward twice on the same inputs: bitwise equal dq and dkv;
  grad      gradients through the VJP (CUDA forward with the CUDA backward, and with the Pallas
            GPU backward) against the float32 reference's at a small shape;
  timing    a bf16 8192^3 matmul and a device copy (the ceilings), the forward at GLM-5.2's shape
            (B 1, S 4096, H 64, Dk 576, v 512, K 2048, T 4096) against pallas_gpu in TFLOP/s
            (2 B S H K (Dk + v) FLOPs) and % of the matmul rate; paged decode (batch 64 and 128,
            128K context, pages of 64 rows shuffled) against pallas_gpu in GB/s of the bytes
            moved (selected rows, q, out) and % of the copy bandwidth, with bf16 pages and with
            the same rows as FP8 pages (656 bytes a row against 1,152, GB/s counted in those). Medians over repeats of
            loops of calls on 3 rotated input sets, after a warm-up, each repeat ended by
            block_until_ready;
  bwd_timing  the backward at GLM-5.2's shape (B 1, S 4096, T 4096, K 2048, H 64): the CUDA
            backward (dq and dkv kernels, key index prebuilt) against the Pallas GPU backward
            (its index prebuilt), each from the same out / lse / delta, in ms, TFLOP/s (FLOPs
            2 B S H K (3 x 576 + 2 x 512): S recomputed, dP, dq, dkv's key and value parts) and %
            of the bf16 matmul rate of the same run; the dq and dkv kernels alone; the key
            index's build; forward + backward (jax.grad) of both.
Then a short markdown table; --json writes everything (after each stage).

    --paged-only  the paged stages alone (load, paged, paged_fp8, then the paged decode timing).
    --splits N..  cuda's paged decode timed with each of these K splits per query (default: the
                 kernel's choice, enough CTAs for two waves of the GPU).
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
from pallas_kernels import fp8
from pallas_kernels.sparse_mla import cuda, cuda_fp8

H, DK, DV = 64, 576, 512
SCALE = DK ** -0.5
#: Pass thresholds of the forward checks (bf16 operands and output, float32 accumulation).
OUT_TOL, LSE_TOL = 1e-2, 1e-3
#: The bf16 kernels: every (block_k, stages) of the mma.sync forward; the wgmma forward apart
#: (its checks run as stages of their own after the others, so that a fault there, a new
#: kernel's, costs no other result; the timing tables hold both).
CONFIGS = [dict(forward="mma", block_k=b, stages=s) for b, s in cuda.BLOCK_STAGES]
WGMMA_CONFIGS = [dict(forward="wgmma", block_k=64, stages=2)]
FP8_CONFIGS = [dict(forward="mma", block_k=b, stages=s) for b, s in cuda_fp8.BLOCK_STAGES]


def config_of(cfg: dict, splits=None) -> cuda.SparseMLACudaConfig:
    """The SparseMLACudaConfig of a CONFIGS entry and a split count (None: the default)."""
    return cuda.SparseMLACudaConfig(forward=cfg["forward"], block_k=cfg["block_k"], num_stages=cfg["stages"],
                                    num_splits=splits)


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


def target_oracle(q, kv, idx, lse):
    """float64 numpy: the indexer target [B, S, K] of the given lse: mean over heads of
    exp(logit - lse) at each valid slot (duplicates each), 0 elsewhere."""
    qf = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    kf = np.asarray(jnp.asarray(kv, jnp.float32), np.float64)
    T = kf.shape[1]
    out = np.zeros(idx.shape)
    for b in range(idx.shape[0]):
        for s in range(idx.shape[1]):
            valid = (idx[b, s] >= 0) & (idx[b, s] < T)
            if valid.any():
                logits = qf[b, s] @ kf[b, idx[b, s][valid]].T * SCALE            # [H, n]
                out[b, s, valid] = np.exp(logits - lse[b, s][:, None]).mean(0)
    return out


def target_checks(cases):
    """The wgmma kernel's indexer target (`cuda.target`) from the oracle's lse against
    `target_oracle`: relative L1 error, rows summing to 1 where a query has a valid slot."""
    rows = []
    print("| B | S | T | K | H | rel L1 err | row sums within 1e-3 | pass |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for seed, (B, S, T, K, heads) in enumerate(cases):
        q, kv, idx = make_inputs(300 + seed, B, S, T, K, heads)
        _, ref_lse = oracle(q, kv, idx)
        want = target_oracle(q, kv, idx, ref_lse)
        row = dict(B=B, S=S, T=T, K=K, H=heads)
        try:
            got = np.asarray(jax.jit(lambda q, kv, i, l: cuda.target(q, kv, i, l, sm_scale=SCALE))(
                q, kv, jnp.asarray(idx), jnp.asarray(ref_lse, jnp.float32)), np.float64)
            rel = float(np.abs(got - want).sum() / max(np.abs(want).sum(), 1e-30))
            sums = got.sum(-1)[np.isfinite(ref_lse).all(-1)]
            row.update(rel_err=rel, sums_ok=bool(np.all(np.abs(sums - 1) < 1e-3)),
                       passed=bool(np.isfinite(got).all() and rel <= 1e-3 and np.all(np.abs(sums - 1) < 1e-3)))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row.update(error=f"{type(e).__name__}: {e}", passed=False)
        rows.append(row)
        print(f"| {B} | {S} | {T} | {K} | {heads} | {row.get('rel_err', float('nan')):.2e} | "
              f"{row.get('sums_ok', '-')} | {'PASS' if row['passed'] else 'FAIL'} |", flush=True)
    return dict(rows=rows, passed=all(r["passed"] for r in rows))


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
    print("| B | S | T | K | H | kernel | block_k | stages | splits | rel err | lse err | empty ok | pass |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for seed, (B, S, T, K, heads) in enumerate(cases):
        q, kv, idx = make_inputs(seed, B, S, T, K, heads)
        ref_out, ref_lse = oracle(q, kv, idx)
        idx_j = jnp.asarray(idx)
        for cfg in configs:
            for splits in splits_list:
                row = dict(B=B, S=S, T=T, K=K, H=heads, splits=splits, **cfg)
                try:
                    fn = jax.jit(lambda q, kv, i, config=config_of(cfg, splits): cuda.forward(
                        q, kv, i, sm_scale=SCALE, config=config))
                    out, lse = poisoned(lambda: fn(q, kv, idx_j), [((B, S, heads, DV), jnp.bfloat16),
                                                                   ((B, S, heads), jnp.float32)])
                    row.update(compare(out, lse, ref_out, ref_lse))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row.update(error=f"{type(e).__name__}: {e}", passed=False)
                rows.append(row)
                print(f"| {B} | {S} | {T} | {K} | {heads} | {cfg['forward']} | {cfg['block_k']} | {cfg['stages']} | "
                      f"{splits} | "
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


def paged_checks(configs, cases=((3, 1000, 300), (2, 4096, 2048)), *, fp8_pages=False):
    """The paged form against the oracle; with fp8_pages the store quantized (`fp8.quantize_latent`)
    and the oracle on its dequantized rows."""
    rows = []
    for B, T, K in cases:
        q, store, table, idx, kv = paged_store(B + T, B, T, K)
        if fp8_pages:
            store = fp8.quantize_latent(store, DV)
            kv = fp8.dequantize(store)[1][table].reshape(kv.shape)
        ref_out, ref_lse = oracle(q, kv, idx)
        for cfg in configs:
            for splits in (None, 1):
                row = dict(B=B, T=T, K=K, splits=splits, **cfg)
                try:
                    config = config_of(cfg, splits)
                    fn = jax.jit(lambda q, st, t, i, config=config: pk.paged_sparse_mla(
                        q, st, t, i, slot=1, sm_scale=SCALE, v_dim=DV, impl="cuda", config=config))
                    out, lse = poisoned(lambda: fn(q, store, table, jnp.asarray(idx)),
                                        [((B, 1, H, DV), jnp.bfloat16), ((B, 1, H), jnp.float32)])
                    row.update(compare(out, lse, ref_out, ref_lse))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row.update(error=f"{type(e).__name__}: {e}", passed=False)
                rows.append(row)
                print(f"paged{' fp8' if fp8_pages else ''} B={B} T={T} K={K} {cfg} splits={splits}: "
                      f"rel {row.get('rel_err', float('nan')):.2e}, "
                      f"lse {row.get('lse_max_err', float('nan')):.2e} -> {'PASS' if row['passed'] else 'FAIL'}",
                      flush=True)
    return dict(rows=rows, passed=all(r["passed"] for r in rows))


def bitwise():
    q, kv, idx = make_inputs(7, 2, 8, 4096, 2048)
    idx = jnp.asarray(idx)
    rows = []
    for splits in (1, 4):
        fn = jax.jit(lambda q, kv, i, splits=splits: cuda.forward(
            q, kv, i, sm_scale=SCALE, config=cuda.SparseMLACudaConfig(num_splits=splits)))
        a = jax.block_until_ready(fn(q, kv, idx))
        b = jax.block_until_ready(fn(q, kv, idx))
        same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(a, b))
        rows.append(dict(form="forward", splits=splits, bitwise_equal=same))
    qp, store, table, pidx, _ = paged_store(11, 4, 4096, 2048)
    fn = jax.jit(lambda q, st, t, i: pk.paged_sparse_mla(q, st, t, i, slot=1, sm_scale=SCALE, v_dim=DV, impl="cuda"))
    for form, pages in (("paged", store), ("paged fp8", fp8.quantize_latent(store, DV))):
        a = jax.block_until_ready(fn(qp, pages, table, jnp.asarray(pidx)))
        b = jax.block_until_ready(fn(qp, pages, table, jnp.asarray(pidx)))
        same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(a, b))
        rows.append(dict(form=form, splits="default", bitwise_equal=same))
    for r in rows:
        print(r, flush=True)
    return dict(rows=rows, passed=all(r["bitwise_equal"] for r in rows))


def grad_check():
    """d/dq, d/dkv of sum(out * w) + sum(lse * w2) (lse of queries with a valid row) through impl
    "cuda" (the CUDA backward, then the Pallas GPU one) against the float32 reference on the same
    bf16 inputs (indices without duplicates, on which the reference counts once)."""
    B, S, T, K = 1, 4, 512, 128
    q, kv, idx = make_inputs(21, B, S, T, K, dup=False)
    rng = np.random.default_rng(22)
    w = jnp.asarray(rng.standard_normal((B, S, H, DV)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32)
    idx = jnp.asarray(idx)

    def loss(impl, q, kv, config):
        out, lse = pk.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=DV, impl=impl, config=config)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(lse * w2)

    qf, kf = q.astype(jnp.float32), kv.astype(jnp.float32)
    want = jax.jit(jax.grad(lambda q, kv: loss("reference", q, kv, None), argnums=(0, 1)))(qf, kf)
    res = {}
    for bwd in cuda.BACKWARDS:
        config = cuda.SparseMLACudaConfig(backward=bwd)
        try:
            got = jax.jit(jax.grad(lambda q, kv: loss("cuda", q, kv, config), argnums=(0, 1)))(q, kv)
            for name, g, r in zip(("dq", "dkv"), got, want):
                g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
                r = np.asarray(r, np.float64)
                res[f"{bwd}_{name}"] = dict(rel_err=float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)),
                                            nan=bool(np.isnan(g).any()))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res[f"{bwd}_error"] = dict(error=f"{type(e).__name__}: {e}", nan=True, rel_err=float("inf"))
    res["passed"] = all(not v["nan"] and v["rel_err"] < 2e-2 for v in res.values() if isinstance(v, dict))
    print(res, flush=True)
    return res



# ----------------------------------------------------------------------------- backward

#: Pass threshold of the backward checks (bf16 operands, P and dS rounded to bf16 for the MMAs).
GRAD_TOL = 2e-2
#: Backward FLOPs per (query, head, selected row): S recomputed (576), dP (512), dq (576), dkv's
#: key part (576) and value part (512), 2 FLOPs a multiply-add.
BWD_FLOPS_PER_PAIR_HEAD = 2 * (3 * DK + 2 * DV)


def backward_inputs(seed, B, S, T, K, heads=H):
    """q, kv, idx (make_inputs), dout bf16, and lse f32 from the float64 oracle, delta f32 =
    rowsum(out * dout) - dlse (dlse random; 0 where lse is -inf), as the rule computes it."""
    q, kv, idx = make_inputs(seed, B, S, T, K, heads)
    out, lse = oracle(q, kv, idx)
    rng = np.random.default_rng(seed + 1000)
    dout = jnp.asarray(rng.standard_normal((B, S, heads, DV), np.float32), jnp.bfloat16)
    dlse = rng.standard_normal((B, S, heads))
    dof = np.asarray(jnp.asarray(dout, jnp.float32), np.float64)
    delta = np.sum(out * dof, -1) - np.where(np.isfinite(lse), dlse, 0.0)
    return q, kv, idx, dout, jnp.asarray(lse, jnp.float32), jnp.asarray(delta, jnp.float32)


def backward_oracle(q, kv, idx, dout, lse, delta):
    """float64 numpy of the contract: (dq [B, S, H, Dk], dkv [B, T, Dk]); every valid slot counts
    (duplicates each time)."""
    qf = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    kf = np.asarray(jnp.asarray(kv, jnp.float32), np.float64)
    dof = np.asarray(jnp.asarray(dout, jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    delta = np.asarray(delta, np.float64)
    B, S, heads, _ = qf.shape
    T = kf.shape[1]
    dq = np.zeros_like(qf)
    dkv = np.zeros_like(kf)
    for b in range(B):
        for s in range(S):
            sel = idx[b, s][(idx[b, s] >= 0) & (idx[b, s] < T)]
            if sel.size == 0:
                continue
            rows = kf[b, sel]
            p = np.exp(qf[b, s] @ rows.T * SCALE - lse[b, s][:, None])           # [H, n]
            ds = p * (dof[b, s] @ rows[:, :DV].T - delta[b, s][:, None])
            dq[b, s] = SCALE * ds @ rows
            g = SCALE * ds.T @ qf[b, s]                                           # [n, Dk]
            g[:, :DV] += p.T @ dof[b, s]
            np.add.at(dkv[b], sel, g)
    return dq, dkv


def _rel(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    nan = bool(np.isnan(got).any())
    rel = float(np.linalg.norm(np.where(np.isnan(got), np.inf, got) - want) / max(np.linalg.norm(want), 1e-30))
    return rel, nan


def backward_checks(cases):
    rows = []
    print("| B | S | T | K | H | dq rel err | dkv rel err | pass |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for seed, (B, S, T, K, heads) in enumerate(cases):
        row = dict(B=B, S=S, T=T, K=K, H=heads)
        try:
            q, kv, idx, dout, lse, delta = backward_inputs(300 + seed, B, S, T, K, heads)
            want_dq, want_dkv = backward_oracle(q, kv, idx, dout, lse, delta)
            fn = jax.jit(lambda q, kv, i, do, l, d: cuda.backward(q, kv, i, do, l, d, sm_scale=SCALE,
                                                                  dq_dtype=jnp.float32))
            dq, dkv = poisoned(lambda: fn(q, kv, jnp.asarray(idx), dout, lse, delta),
                               [((B, S, heads, DK), jnp.float32), ((B, T, DK), jnp.float32)])
            dq_rel, dq_nan = _rel(dq, want_dq)
            dkv_rel, dkv_nan = _rel(dkv, want_dkv)
            row.update(dq_rel_err=dq_rel, dkv_rel_err=dkv_rel, nan=dq_nan or dkv_nan,
                       passed=bool(not (dq_nan or dkv_nan) and dq_rel <= GRAD_TOL and dkv_rel <= GRAD_TOL))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row.update(error=f"{type(e).__name__}: {e}", passed=False)
        rows.append(row)
        print(f"| {B} | {S} | {T} | {K} | {heads} | {row.get('dq_rel_err', float('nan')):.2e} | "
              f"{row.get('dkv_rel_err', float('nan')):.2e} | {'PASS' if row['passed'] else 'FAIL'} |", flush=True)
    return dict(rows=rows, passed=all(r["passed"] for r in rows))


def backward_bitwise():
    q, kv, idx, dout, lse, delta = backward_inputs(17, 2, 8, 4096, 2048)
    ki = cuda.key_index(jnp.asarray(idx), 4096)
    fn = jax.jit(lambda q, kv, i, do, l, d, ki: cuda.backward(q, kv, i, do, l, d, sm_scale=SCALE, tindex=ki))
    a = jax.block_until_ready(fn(q, kv, jnp.asarray(idx), dout, lse, delta, ki))
    b = jax.block_until_ready(fn(q, kv, jnp.asarray(idx), dout, lse, delta, ki))
    same = {name: bool(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)))
            for name, x, y in zip(("dq", "dkv"), a, b)}
    print(same, flush=True)
    return dict(**same, passed=all(same.values()))


def bwd_timing(report, json_path, smoke):
    """The backward at GLM-5.2's shape: CUDA against Pallas GPU (module docstring)."""
    from pallas_kernels.sparse_mla import gpu, gpu_backward

    res = {}
    mm = (report.get("timing") or {}).get("matmul_tflops")
    if mm is None:
        mm = ceilings(smoke)[1] / 1e12
    mm *= 1e12
    res["matmul_tflops"] = mm / 1e12
    report["bwd_timing"] = res
    B, S, T, K = (1, 256, 512, 256) if smoke else (1, 4096, 4096, 2048)
    flops = B * S * H * K * BWD_FLOPS_PER_PAIR_HEAD
    print(f"backward B={B} S={S} T={T} K={K} H={H}: {flops / 1e12:.2f} TFLOP a call; bf16 matmul "
          f"{mm / 1e12:.0f} TFLOP/s", flush=True)
    fwd = jax.jit(lambda q, kv, i: cuda.forward(q, kv, i, sm_scale=SCALE))
    sets = []
    for i in range(3):
        q, kv, idx = make_inputs(200 + i, B, S, T, K, invalid=False)
        idx = jnp.asarray(idx)
        out, lse = fwd(q, kv, idx)
        dout = jax.random.normal(jax.random.key(i), out.shape, jnp.bfloat16)
        delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), -1)
        sets.append((q, kv, idx, dout, lse, delta))
    del out

    build = jax.jit(lambda i: cuda.key_index(i, T))
    kidx = [jax.block_until_ready(build(s[2])) for s in sets]
    c = gpu.SparseMLAGpuConfig()
    mode = cuda._dkv_mode(c, sets[0][0], sets[0][1], sets[0][2], DV)
    pidx = [jax.block_until_ready(gpu._indexed_index(s[2], T, mode, dk=DK, dtype=jnp.bfloat16, c=c)) for s in sets]
    pallas_fn = {"sorted": gpu_backward.backward, "by_key": gpu_backward.backward_by_key}[mode]
    settings = dict(gpu._backward_settings(c, mode))
    res.update(pallas_dkv_mode=mode)

    def cuda_bwd(q, kv, i, do, l, d, ki):
        return cuda.backward(q, kv, i, do, l, d, sm_scale=SCALE, tindex=ki)

    def dq_only(q, kv, i, do, l, d, ki):
        return jax.ffi.ffi_call("glm_sparse_mla_dq", jax.ShapeDtypeStruct(q.shape, q.dtype))(
            q, kv, i, do, l, d, sm_scale=np.float32(SCALE))

    def dkv_only(q, kv, i, do, l, d, ki):
        return jax.ffi.ffi_call("glm_sparse_mla_dkv", jax.ShapeDtypeStruct(kv.shape, jnp.float32))(
            q, kv, do, l, d, ki.pair_row, ki.unit_query, ki.unit_start, ki.block_units, sm_scale=np.float32(SCALE))

    def pallas_bwd(q, kv, i, do, l, d, ti):
        return pallas_fn(q, kv, i, do, l, d, sm_scale=SCALE, v_dim=DV, tindex=ti, interpret=False, **settings)

    dq_flops = B * S * H * K * 2 * (2 * DK + DV)          # S, dP, dq
    dkv_flops = B * S * H * K * 2 * (2 * DK + 2 * DV)     # S, dP (recomputed), dkv key and value parts
    rows = res["rows"] = []
    print("| what | ms | TFLOP/s | % of matmul |")
    print("|---|---|---|---|", flush=True)
    cases = [("cuda backward (dq + dkv)", cuda_bwd, kidx, flops), ("cuda dq kernel", dq_only, kidx, dq_flops),
             ("cuda dkv kernel", dkv_only, kidx, dkv_flops), (f"pallas_gpu backward ({mode})", pallas_bwd, pidx, flops)]
    for name, fn, index, fl in cases:
        row = dict(what=name)
        try:
            fn = jax.jit(fn)
            t = timed(fn, [s + (ix,) for s, ix in zip(sets, index)])
            row.update(ms=t * 1e3, tflops=fl / t / 1e12, pct_matmul=100 * fl / t / mm)
            print(f"| {name} | {t * 1e3:.2f} | {fl / t / 1e12:.0f} | {100 * fl / t / mm:.1f}% |", flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"| {name} | failed: {type(e).__name__} | | |", flush=True)
        rows.append(row)
        write_json(json_path, report)
    try:
        t = timed(build, [(s[2],) for s in sets])
        res["key_index_ms"] = t * 1e3
        print(f"| key index build (once per index set) | {t * 1e3:.2f} | | |", flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["key_index_error"] = f"{type(e).__name__}: {e}"
    # forward + backward through the rule (index prebuilt), both backwards
    for bwd, index in (("cuda", kidx), ("pallas_gpu", pidx)):
        row = dict(what=f"forward + backward, backward={bwd}")
        try:
            config = cuda.SparseMLACudaConfig(backward=bwd)

            def step(q, kv, i, do, ti, config=config):
                f = lambda q, kv: cuda.sparse_mla(q, kv, i, sm_scale=SCALE, v_dim=DV, config=config, tindex=ti)[0]
                out, vjp_fn = jax.vjp(f, q, kv)
                return vjp_fn(do)

            fn = jax.jit(step)
            t = timed(fn, [(s[0], s[1], s[2], s[3], ix) for s, ix in zip(sets, index)])
            fl = flops + B * S * H * K * 2 * (DK + DV)
            row.update(ms=t * 1e3, tflops=fl / t / 1e12, pct_matmul=100 * fl / t / mm)
            print(f"| {row['what']} | {t * 1e3:.2f} | {fl / t / 1e12:.0f} | {100 * fl / t / mm:.1f}% |", flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"| {row['what']} | failed: {type(e).__name__} | | |", flush=True)
        rows.append(row)
        write_json(json_path, report)
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


def timing(report, json_path, smoke, prefill=True, splits=(None,)):
    """The ceilings, the prefill forward (prefill=True) and the paged decode (bf16 and FP8 pages;
    cuda with each of `splits`, None: the kernel's own choice)."""
    res = {}
    bw, mm = ceilings(smoke)
    res.update(copy_bw_gbs=bw / 1e9, matmul_tflops=mm / 1e12)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    report["timing"] = res
    write_json(json_path, report)

    if prefill:
        prefill_timing(res, report, json_path, smoke, mm)
    decode_timing(res, report, json_path, smoke, bw, splits)
    return res


def prefill_timing(res, report, json_path, smoke, mm):
    """The forward at GLM-5.2's shape, cuda's configs and pallas_gpu -> res["forward"]."""
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
    impls = [("cuda", cfg, jax.jit(lambda q, kv, i, config=config_of(cfg): cuda.forward(q, kv, i, sm_scale=SCALE,
                                                                                      config=config)))
             for cfg in CONFIGS + WGMMA_CONFIGS]
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


def decode_timing(res, report, json_path, smoke, bw, splits=(None,)):
    """Paged decode, bf16 and FP8 pages, cuda's configs (each with every K split count of
    `splits`, None: the kernel's default) and pallas_gpu -> res["paged_decode"]."""
    dec = res["paged_decode"] = []
    T, K, page = (4096, 256, 64) if smoke else (131072, 2048, 64)
    print(f"\npaged decode: H={H}, K={K}, context {T}, pages of {page} rows (shuffled), 1 query a sequence")
    print("| batch | pages | impl | config | us | GB/s | % of copy BW |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for batch in ((4, 8) if smoke else (64, 128)):
        n = T // page
        rng = np.random.default_rng(batch)
        # distinct pages (every row read is its own address), their values a tiled random block: the
        # random generation of the whole store would need its size again in uint32 temporaries
        base = jax.random.normal(jax.random.key(batch), (1024, page, DK), jnp.bfloat16)
        pages = batch * n + 1
        queries = []
        for i in range(3):
            q = jax.random.normal(jax.random.key(1000 * batch + i), (batch, 1, H, DK), jnp.bfloat16)
            table = jnp.asarray((1 + rng.permutation(batch * n)).reshape(batch, n), jnp.int32)
            idx = jnp.asarray(rng.integers(0, T, (batch, 1, K)), jnp.int32)
            queries.append((q, table, idx))
        for layout in ("bf16", "fp8"):
            rows = base if layout == "bf16" else fp8.quantize_latent(base, DV)
            # one buffer a field
            store = jax.jit(lambda b: jax.tree.map(lambda x: jnp.tile(x, (-(-pages // 1024), 1, 1))[None, :pages],
                                                   b))(rows)
            row_bytes = DK * 2 if layout == "bf16" else fp8.latent_row_bytes(DV, DK - DV)
            moved = batch * K * row_bytes + batch * H * DK * 2 + batch * H * DV * 2
            configs = CONFIGS + WGMMA_CONFIGS if layout == "bf16" else FP8_CONFIGS
            impls = [("cuda", {**cfg, "splits": n} if n else cfg,
                      config_of(cfg, n))
                     for cfg in configs for n in splits] + [("pallas_gpu", {}, None)]
            for name, cfg, config in impls:
                row = dict(batch=batch, layout=layout, impl=name, config=cfg)
                try:
                    fn = jax.jit(lambda q, st, t, i, name=name, config=config: pk.paged_sparse_mla(
                        q, st, t, i, sm_scale=SCALE, v_dim=DV, impl=name, config=config))
                    t = timed(fn, [(q, store, table, idx) for q, table, idx in queries])
                    row.update(us=t * 1e6, gbs=moved / t / 1e9, pct_copy=100 * moved / t / bw)
                    print(f"| {batch} | {layout} | {name} | {cfg} | {t * 1e6:.0f} | {moved / t / 1e9:.0f} | "
                          f"{100 * moved / t / bw:.1f}% |", flush=True)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"
                    print(f"| {batch} | {layout} | {name} | {cfg} | failed: {type(e).__name__} | | |", flush=True)
                dec.append(row)
                write_json(json_path, report)
            del store
        del base


def summary(report):
    print("\n## summary")
    print("| check / measurement | result |")
    print("|---|---|")
    for name in ("load", "forward", "paged", "paged_fp8", "bitwise", "backward", "bwd_bitwise", "grad",
                 "forward_wgmma", "paged_wgmma", "target_wgmma"):
        part = report.get(name)
        if part is None:
            continue
        if "error" in part:
            print(f"| {name} | ERROR {part['error'].splitlines()[0][:120]} |")
        elif name == "load":
            print(f"| load | {part['device']}, jax {part['jax']} |")
        else:
            worst = ""
            if name in ("forward", "paged", "paged_fp8", "forward_wgmma", "paged_wgmma", "target_wgmma"):
                errs = [r.get("rel_err", float("inf")) for r in part["rows"]]
                worst = f" (worst rel err {max(errs):.2e}, {len(errs)} runs)"
            if name == "backward":
                errs = [max(r.get("dq_rel_err", float("inf")), r.get("dkv_rel_err", float("inf"))) for r in part["rows"]]
                worst = f" (worst rel err {max(errs):.2e}, {len(errs)} runs)"
            print(f"| {name} | {'PASS' if part.get('passed') else 'FAIL'}{worst} |")
    t = report.get("timing") or {}
    if "error" in t:
        print(f"| timing | ERROR {t['error'].splitlines()[0][:120]} |")
    for r in t.get("forward", []):
        if "ms" in r:
            print(f"| forward {r['impl']} {r['config']} | {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s, "
                  f"{r['pct_matmul']:.1f}% of matmul |")
    bt = report.get("bwd_timing") or {}
    if "error" in bt:
        print(f"| bwd_timing | ERROR {bt['error'].splitlines()[0][:120]} |")
    for r in bt.get("rows", []):
        if "ms" in r:
            print(f"| {r['what']} | {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s, {r['pct_matmul']:.1f}% of matmul |")
    if "key_index_ms" in bt:
        print(f"| key index build | {bt['key_index_ms']:.2f} ms |")
    for r in t.get("paged_decode", []):
        if "us" in r:
            print(f"| decode b{r['batch']} {r['layout']} {r['impl']} {r['config']} | {r['us']:.0f} us, "
                  f"{r['gbs']:.0f} GB/s, "
                  f"{r['pct_copy']:.1f}% of copy BW |")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sanitize", action="store_true", help="tiny shapes, CUDA kernels only (compute-sanitizer)")
    ap.add_argument("--smoke", action="store_true", help="small timing shapes (a quick look)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--paged-only", action="store_true",
                    help="only the paged stages (load, paged, paged_fp8, the paged decode timing)")
    ap.add_argument("--backward-only", action="store_true",
                    help="only the backward's stages (load, backward, bwd_bitwise, grad, bwd_timing)")
    ap.add_argument("--splits", type=int, nargs="+", default=[None], metavar="N",
                    help="K splits per query of cuda's paged decode timing (default: the kernel's choice)")
    args = ap.parse_args()
    report = {"mode": "sanitize" if args.sanitize else "full"}
    stage(report, "load", load, args.json)
    if args.paged_only and not args.sanitize:
        stage(report, "paged", lambda: paged_checks(CONFIGS), args.json)
        stage(report, "paged_fp8", lambda: paged_checks(FP8_CONFIGS, fp8_pages=True), args.json)
        stage(report, "paged_wgmma", lambda: paged_checks(WGMMA_CONFIGS), args.json)
        if not args.skip_timing:
            stage(report, "timing", lambda: timing(report, args.json, args.smoke, prefill=False, splits=args.splits),
                  args.json)
    elif args.backward_only and not args.sanitize:
        bcases = [(2, 4, 256, 64, 64), (1, 3, 4096, 2048, 64), (2, 5, 300, 100, 64), (1, 3, 512, 128, 128),
                  (1, 4, 4096, 2048, 128)]
        stage(report, "backward", lambda: backward_checks(bcases), args.json)
        stage(report, "bwd_bitwise", backward_bitwise, args.json)
        stage(report, "grad", grad_check, args.json)
        if not args.skip_timing:
            stage(report, "bwd_timing", lambda: bwd_timing(report, args.json, args.smoke), args.json)
    elif args.sanitize:
        stage(report, "forward", lambda: forward_checks([(1, 3, 200, 100, 64)], CONFIGS, (1, 2)), args.json)
        stage(report, "paged", lambda: paged_checks(CONFIGS[:1], ((2, 300, 100),)), args.json)
        stage(report, "paged_fp8", lambda: paged_checks(FP8_CONFIGS[:1], ((2, 300, 100),), fp8_pages=True), args.json)
        stage(report, "backward", lambda: backward_checks([(1, 3, 200, 100, 64), (1, 2, 64, 40, 128)]), args.json)
        stage(report, "forward_wgmma", lambda: forward_checks([(1, 3, 200, 100, 64)], WGMMA_CONFIGS, (1, 2)),
              args.json)
        stage(report, "paged_wgmma", lambda: paged_checks(WGMMA_CONFIGS, ((2, 300, 100),)), args.json)
        stage(report, "target_wgmma", lambda: target_checks([(1, 3, 200, 100, 64)]), args.json)
    else:
        cases = [(2, 4, 256, 64, 64), (2, 3, 4096, 2048, 64), (1, 5, 300, 100, 64), (1, 3, 512, 128, 128)]
        stage(report, "forward", lambda: forward_checks(cases, CONFIGS, (1, 3)), args.json)
        stage(report, "paged", lambda: paged_checks(CONFIGS), args.json)
        stage(report, "paged_fp8", lambda: paged_checks(FP8_CONFIGS, fp8_pages=True), args.json)
        stage(report, "bitwise", bitwise, args.json)
        bcases = [(2, 4, 256, 64, 64), (1, 3, 4096, 2048, 64), (2, 5, 300, 100, 64), (1, 3, 512, 128, 128),
                  (1, 4, 4096, 2048, 128)]
        stage(report, "backward", lambda: backward_checks(bcases), args.json)
        stage(report, "bwd_bitwise", backward_bitwise, args.json)
        stage(report, "grad", grad_check, args.json)
        stage(report, "forward_wgmma", lambda: forward_checks(cases, WGMMA_CONFIGS, (1, 3)), args.json)
        stage(report, "paged_wgmma", lambda: paged_checks(WGMMA_CONFIGS), args.json)
        stage(report, "target_wgmma", lambda: target_checks(cases), args.json)
        if not args.skip_timing:
            stage(report, "timing", lambda: timing(report, args.json, args.smoke), args.json)
            stage(report, "bwd_timing", lambda: bwd_timing(report, args.json, args.smoke), args.json)
    summary(report)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
