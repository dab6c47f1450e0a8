"""Step-by-step probe of the Mosaic GPU paged sparse MLA kernel's data path
(`pallas_kernels/attention/gpu_mosaic.py`), for finding where the compiled kernel goes wrong.

Each step is a tiny Mosaic GPU kernel checked against numpy; it prints PASS / FAIL with the
largest error and goes on after a failure (or an exception: ERROR):

  1. gather: per-row TMAs of random distinct row ids into the untiled staging ring (the
     kernel's `issue`: one copy a row, all arriving on the slot's barrier of 32 arrivals), each
     slot copied back to GMEM (TMA from the untiled slot) before it is refilled;
  2. tiled: the same, then each slot moved staging -> tiled (8, 64)-tiled, 128-byte swizzled
     block through registers exactly as the kernel does it, each full block copied to GMEM by a
     TMA with the tiled + swizzle transforms (which un-tiles it);
  3. matmul: q K^T by wgmma from the tiled block (q by TMA), S written to GMEM directly from
     registers and through shared memory + TMA, then O = P V for the first value half (P =
     bf16 S, from registers as in the kernel), O written directly from registers;
  4. kernel: `gpu_mosaic.paged_sparse_mla` against `reference.paged_sparse_mla` with distinct
     indices (no -1), for the default config and each alternative knob.

Variants (where a suspect has a plausible alternative), so one GPU run tells which is right:
  * staging "rows" [stages, 32, Dk/64, 64] (the kernel's default: one [Dk/64, 64] TMA a row,
    each [32, 64] chunk a strided view, rows 2 Dk bytes apart) vs "chunks" [stages, Dk/64, 32,
    64] (one 128-byte TMA per row and chunk: the [32, 64] chunk contiguous);
  * register layout of the staging -> tiled copy: SMEM_GMEM_COPY((32, 64), dtype, 128) (the
    kernel's) vs WGMMA with 64-row slots (steps 2 and 3 only; the kernel has no such knob).
Step 4 runs the kernel with `SparseMLAMosaicConfig(stage_layout=...)` for both staging layouts.

Run on a GPU (about a minute; Dk = 576, v = 512, GLM's decode widths):
    PYTHONPATH=. python benchmarks/mosaic_paged_probe.py
On a CPU in GPU interpret mode (jax >= 0.12; tiny shapes, every step should PASS there,
since interpret mode ignores register layouts, swizzles and barrier phases):
    PYTHONPATH=. python benchmarks/mosaic_paged_probe.py --interpret
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.attention import gpu_mosaic as gm

plgpu = gm.plgpu
R = gm.STAGE_ROWS          # 32 rows a staging slot (the kernel's granule)
CHUNK = gm.CHUNK           # 64 columns of one swizzled tile
RESULTS: list[tuple[str, str, float]] = []


def _kernel_call(body, out_type, scratch, interpret):
    """plgpu.kernel over one block of one warpgroup; `body(*in_refs, *out_refs, *scratch)`."""
    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, *s), *scratch)

    kwargs = {} if not interpret else dict(interpret=plgpu.InterpretGPUParams())
    return plgpu.kernel(entry, out_type=out_type, grid=(1,), grid_names=("x",), **kwargs)


def _tiled_transforms():
    return (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128))


def _stage_shape(stage_layout, stages, rows, chunks):
    return (stages, rows, chunks, CHUNK) if stage_layout == "rows" else (stages, chunks, rows, CHUNK)


def _issue(kv_ref, ids_smem, stage, stage_bar, g, *, stages, rows, chunks, stage_layout):
    """The kernel's `issue`: granule g's `rows` row ids -> staging slot g % stages."""
    s = lax.rem(g, stages)

    @pl.loop(0, rows)
    def _row(i):
        rid = ids_smem[g * rows + i]
        if stage_layout == "rows":
            plgpu.copy_gmem_to_smem(kv_ref.at[rid], stage.at[s, i], stage_bar.at[s])
        else:
            for c in range(chunks):
                plgpu.copy_gmem_to_smem(kv_ref.at[rid, pl.ds(c, 1)], stage.at[s, c, pl.ds(i, 1)], stage_bar.at[s])


def _to_tiled(stage, tiled, s, k, *, rows, chunks, stage_layout, layout):
    """The kernel's staging -> tiled copy of slot s into rows [k rows, (k + 1) rows) of tiled."""
    if layout == "smem_gmem_copy":
        reg_layout = plgpu.Layout.SMEM_GMEM_COPY((rows, CHUNK), stage.dtype, 128)
    else:
        reg_layout = plgpu.Layout.WGMMA
    for c in range(chunks):
        src = stage.at[s, :, c, :] if stage_layout == "rows" else stage.at[s, c]
        part = plgpu.load(src, layout=reg_layout)
        tiled.at[pl.ds(k * rows, rows), pl.ds(c * CHUNK, CHUNK)][...] = part


def _barriers(rows, chunks, stages, stage_layout):
    return (plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=rows * (1 if stage_layout == "rows" else chunks), num_barriers=stages))


def _start(kv_ref, ids_ref, ids_smem, ids_bar, stage, stage_bar, *, granules, stages, rows, chunks,
           stage_layout):
    """The row ids to shared memory, the first `stages` granules' TMAs issued -> issue(g)."""
    plgpu.copy_gmem_to_smem(ids_ref, ids_smem, ids_bar)
    plgpu.barrier_wait(ids_bar)
    issue = functools.partial(_issue, kv_ref, ids_smem, stage, stage_bar, stages=stages, rows=rows, chunks=chunks,
                              stage_layout=stage_layout)
    for g in range(min(stages, granules)):
        issue(jnp.int32(g))
    return issue


# ---------------------------------------------------------------------------------------------
# Step 1: per-row TMA gather -> staging -> GMEM
# ---------------------------------------------------------------------------------------------

def gather(kv3, ids, *, granules, stages, stage_layout, interpret):
    """kv3 [N, chunks, 64], ids int32 [granules * R] -> the staging slots copied out, each
    granule [R, chunks, 64] ("rows") or [chunks, R, 64] ("chunks")."""
    chunks = kv3.shape[1]
    slot = _stage_shape(stage_layout, 1, R, chunks)[1:]

    def body(kv_ref, ids_ref, out_ref, stage, ids_smem, ids_bar, stage_bar):
        issue = _start(kv_ref, ids_ref, ids_smem, ids_bar, stage, stage_bar, granules=granules, stages=stages,
                       rows=R, chunks=chunks, stage_layout=stage_layout)

        @pl.loop(0, granules)
        def _g(g):
            s = lax.rem(g, stages)
            plgpu.barrier_wait(stage_bar.at[s])
            plgpu.copy_smem_to_gmem(stage.at[s], out_ref.at[g])
            plgpu.wait_smem_to_gmem(0)                     # the slot is read before it is refilled

            @pl.when(g + stages < granules)
            def _():
                issue(g + stages)

    scratch = [plgpu.SMEM(_stage_shape(stage_layout, stages, R, chunks), kv3.dtype),
               plgpu.SMEM(ids.shape, jnp.int32), *_barriers(R, chunks, stages, stage_layout)]
    return _kernel_call(body, jax.ShapeDtypeStruct((granules, *slot), kv3.dtype), scratch, interpret)(kv3, ids)


# ---------------------------------------------------------------------------------------------
# Step 2: ... -> staging -> tiled (registers) -> GMEM through a tiled + swizzled TMA
# ---------------------------------------------------------------------------------------------

def gather_tiled(kv3, ids, *, block_k, granules, stages, stage_layout, layout, rows, interpret):
    """-> [granules * rows // block_k, block_k, Dk]: each tiled block un-tiled by a TMA."""
    chunks = kv3.shape[1]
    dk = chunks * CHUNK
    per_block = block_k // rows
    blocks = granules // per_block

    def body(kv_ref, ids_ref, out_ref, stage, tiled, ids_smem, ids_bar, stage_bar):
        issue = _start(kv_ref, ids_ref, ids_smem, ids_bar, stage, stage_bar, granules=granules, stages=stages,
                       rows=rows, chunks=chunks, stage_layout=stage_layout)

        @pl.loop(0, granules)
        def _g(g):
            s = lax.rem(g, stages)
            j = lax.div(g, per_block)
            k = lax.rem(g, per_block)
            plgpu.barrier_wait(stage_bar.at[s])
            _to_tiled(stage, tiled, s, k, rows=rows, chunks=chunks, stage_layout=stage_layout, layout=layout)

            @pl.when(g + stages < granules)
            def _():
                issue(g + stages)

            @pl.when(k == per_block - 1)
            def _():
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(tiled, out_ref.at[j])
                plgpu.wait_smem_to_gmem(0)                 # tiled is read before the next block

    scratch = [plgpu.SMEM(_stage_shape(stage_layout, stages, rows, chunks), kv3.dtype),
               plgpu.SMEM((block_k, dk), kv3.dtype, transforms=_tiled_transforms()),
               plgpu.SMEM(ids.shape, jnp.int32), *_barriers(rows, chunks, stages, stage_layout)]
    out_type = jax.ShapeDtypeStruct((blocks, block_k, dk), kv3.dtype)
    return _kernel_call(body, out_type, scratch, interpret)(kv3, ids)


# ---------------------------------------------------------------------------------------------
# Step 3: q K^T and P V by wgmma from the tiled block
# ---------------------------------------------------------------------------------------------

def matmul(q, kv3, ids, *, block_k, v_half, stage_layout, layout, rows, interpret):
    """q [64, Dk], one block of block_k gathered rows -> (S direct, S through SMEM + TMA or None
    where that buffer does not fit (64-row slots at Dk = 576)) f32 [64, block_k], O [64, v_half]
    f32 = bf16(S) @ K[:, :v_half] (direct store)."""
    chunks = kv3.shape[1]
    dk = chunks * CHUNK
    granules = block_k // rows
    stages = 1
    item = jnp.dtype(q.dtype).itemsize
    s_via_smem = ((2 * gm.HEAD_TILE + rows) * dk * item + gm.HEAD_TILE * block_k * 4 + 4096
                  <= gm.SMEM_LIMIT - gm.SMEM_OVERHEAD)

    def body(q_ref, kv_ref, ids_ref, *rest):
        if s_via_smem:
            s_direct, s_tma, o_direct, q_smem, stage, tiled, ids_smem, s_smem, *rest = rest
        else:
            s_direct, o_direct, q_smem, stage, tiled, ids_smem, *rest = rest
        *p_smem, q_bar, ids_bar, stage_bar = rest
        plgpu.copy_gmem_to_smem(q_ref, q_smem, q_bar)
        plgpu.copy_gmem_to_smem(ids_ref, ids_smem, ids_bar)
        plgpu.barrier_wait(ids_bar)
        issue = functools.partial(_issue, kv_ref, ids_smem, stage, stage_bar, stages=stages, rows=rows,
                                  chunks=chunks, stage_layout=stage_layout)
        issue(jnp.int32(0))

        @pl.loop(0, granules)
        def _g(g):
            plgpu.barrier_wait(stage_bar.at[0])
            _to_tiled(stage, tiled, 0, g, rows=rows, chunks=chunks, stage_layout=stage_layout, layout=layout)

            @pl.when(g + 1 < granules)
            def _():
                issue(g + 1)

        plgpu.commit_smem()
        plgpu.barrier_wait(q_bar)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, tiled.transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((gm.HEAD_TILE, block_k), jnp.float32))
        s_direct[...] = s
        if s_via_smem:
            s_smem[...] = s
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_smem, s_tma)
        acc = plgpu.layout_cast(jnp.full((gm.HEAD_TILE, v_half), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        o = gm._pv(acc, s.astype(q_smem.dtype), tiled.at[:, pl.ds(0, v_half)], p_smem[0] if p_smem else None)
        o_direct[...] = o
        plgpu.wait_smem_to_gmem(0)

    p_scratch = [plgpu.SMEM((gm.HEAD_TILE, block_k), q.dtype, transforms=_tiled_transforms())] if interpret else []
    scratch = [plgpu.SMEM((gm.HEAD_TILE, dk), q.dtype, transforms=_tiled_transforms()),
               plgpu.SMEM(_stage_shape(stage_layout, stages, rows, chunks), kv3.dtype),
               plgpu.SMEM((block_k, dk), kv3.dtype, transforms=_tiled_transforms()),
               plgpu.SMEM(ids.shape, jnp.int32),
               *([plgpu.SMEM((gm.HEAD_TILE, block_k), jnp.float32)] if s_via_smem else []),
               *p_scratch,
               plgpu.Barrier(), *_barriers(rows, chunks, stages, stage_layout)]
    out_type = [jax.ShapeDtypeStruct((gm.HEAD_TILE, block_k), jnp.float32)] * (2 if s_via_smem else 1) + [
        jax.ShapeDtypeStruct((gm.HEAD_TILE, v_half), jnp.float32)]
    outs = _kernel_call(body, out_type, scratch, interpret)(q, kv3, ids)
    return outs if s_via_smem else (outs[0], None, outs[1])


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def _report(name, got, want, tol):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        RESULTS.append((name, "FAIL", float("nan")))
        print(f"FAIL   {name}: shape {got.shape} != {want.shape}", flush=True)
        return
    err = np.abs(got - want)
    err = np.where(np.isnan(err) | np.isinf(got) != np.isinf(want), np.inf, np.nan_to_num(err))
    worst = float(err.max()) if err.size else 0.0
    status = "PASS" if worst <= tol else "FAIL"
    extra = ""
    if status == "FAIL" and got.ndim >= 2:
        rows_bad = np.unique(np.argwhere(err > tol)[:, :-1], axis=0)
        extra = f" ({len(rows_bad)} bad rows, first {rows_bad[:4].tolist()}; mean err {float(err.mean()):.3g})"
    RESULTS.append((name, status, worst))
    print(f"{status}   {name}: max err {worst:.4g} (tol {tol:g}){extra}", flush=True)


def _run(name, fn):
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        RESULTS.append((name, "ERROR", float("nan")))
        print(f"ERROR  {name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
        traceback.print_exc(limit=3, file=sys.stdout)
    print(f"       ({time.perf_counter() - t0:.1f} s)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true", help="GPU interpret mode on a CPU, tiny shapes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", default="1234", help="which steps to run (default all: 1234)")
    args = ap.parse_args(argv)
    interp = args.interpret
    print(f"jax {jax.__version__}, jaxlib {getattr(jax.lib, '__version__', '?')}, "
          f"backend {jax.default_backend()}, devices {jax.devices()}", flush=True)
    for d in jax.devices():
        print(f"device: {getattr(d, 'device_kind', d)}", flush=True)
    if not gm.available() or (interp and not gm.interpret_available()):
        print("this jax has no Mosaic GPU Pallas API (or no GPU interpret mode)")
        return 1
    if not interp and jax.default_backend() != "gpu":
        print("no GPU: pass --interpret to run on a CPU")
        return 1

    rng = np.random.default_rng(args.seed)
    dk, v = (192, 128) if interp else (576, 512)
    chunks = dk // CHUNK
    n_rows = 1024 if interp else 8192
    kv = rng.normal(size=(n_rows, dk)).astype(np.float32)
    kv_bf = jnp.asarray(kv, jnp.bfloat16)
    kv_np = np.asarray(kv_bf.astype(jnp.float32))
    kv3 = kv_bf.reshape(n_rows, chunks, CHUNK)
    block_k = 64
    granules = 4                                       # 2 blocks of 64 rows, through 2 slots
    ids_np = rng.permutation(n_rows)[:granules * R].astype(np.int32)
    ids = jnp.asarray(ids_np)
    rows_np = kv_np[ids_np]                            # [granules * R, Dk]

    stage_layouts = ("rows", "chunks")
    if "1" in args.steps:
        print("--- step 1: per-row TMA gather -> staging -> GMEM", flush=True)
        for sl in stage_layouts:
            def step1(sl=sl):
                out = np.asarray(gather(kv3, ids, granules=granules, stages=2, stage_layout=sl,
                                        interpret=interp).astype(jnp.float32))
                if sl == "chunks":
                    out = out.transpose(0, 2, 1, 3)
                _report(f"1 gather stage={sl}", out.reshape(granules * R, dk), rows_np, 0.0)
            _run(f"1 gather stage={sl}", step1)

    variants = [("rows", "smem_gmem_copy", R), ("chunks", "smem_gmem_copy", R), ("rows", "wgmma", 64),
                ("chunks", "wgmma", 64)]
    if "2" in args.steps:
        print("--- step 2: ... -> staging -> tiled (registers) -> GMEM (tiled + swizzled TMA)", flush=True)
        for sl, layout, rows in variants:
            name = f"2 tiled stage={sl} layout={layout} rows={rows}"

            def step2(sl=sl, layout=layout, rows=rows, name=name):
                g = granules * R // rows
                out = gather_tiled(kv3, ids, block_k=block_k, granules=g, stages=2, stage_layout=sl, layout=layout,
                                   rows=rows, interpret=interp)
                _report(name, np.asarray(out.astype(jnp.float32)).reshape(-1, dk), rows_np, 0.0)
            _run(name, step2)

    if "3" in args.steps:
        print("--- step 3: q K^T and P V by wgmma from the tiled block", flush=True)
        q = jnp.asarray(rng.normal(size=(gm.HEAD_TILE, dk)) * dk ** -0.5, jnp.bfloat16)
        q_np = np.asarray(q.astype(jnp.float32), np.float64)
        k_np = rows_np[:block_k].astype(np.float64)
        s_want = q_np @ k_np.T
        p_np = np.asarray(jnp.asarray(s_want, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        o_want = p_np @ k_np[:, :v // 2]
        for sl, layout, rows in variants:
            name = f"3 matmul stage={sl} layout={layout} rows={rows}"

            def step3(sl=sl, layout=layout, rows=rows, name=name):
                s_direct, s_tma, o = matmul(q, kv3, ids[:block_k], block_k=block_k, v_half=v // 2, stage_layout=sl,
                                            layout=layout, rows=rows, interpret=interp)
                if s_tma is not None:
                    _report(name + " S(smem+TMA)", s_tma, s_want, 2e-2)
                _report(name + " S(direct store)", s_direct, s_want, 2e-2)
                # P is bf16(S) of the kernel's S: compare O with the kernel's own S as P
                s_got = s_direct if s_tma is None else s_tma
                p_got = np.asarray(jnp.asarray(s_got).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
                _report(name + " O=P V(direct store)", o, p_got @ k_np[:, :v // 2], 5e-2)
                _report(name + " O vs numpy P", o, o_want, 0.25)
            _run(name, step3)

    if "4" in args.steps:
        print("--- step 4: full gpu_mosaic.paged_sparse_mla vs reference (distinct indices)", flush=True)
        from pallas_kernels.attention import reference
        if interp:
            B, H, K, P, n = 1, 8, 128, 16, 16
        else:
            B, H, K, P, n = 8, 64, 2048, 64, 64
        slots, pages = 2, B * n + 3
        store = jnp.asarray(rng.normal(size=(slots, pages, P, dk)), jnp.bfloat16)
        table = jnp.asarray(rng.permutation(pages)[:B * n].reshape(B, n), jnp.int32)
        qf = jnp.asarray(rng.normal(size=(B, 1, H, dk)), jnp.bfloat16)
        idx = jnp.asarray(np.stack([rng.permutation(n * P)[:K] for _ in range(B)])[:, None, :], jnp.int32)
        sm_scale = dk ** -0.5
        ref_out, ref_lse = reference.paged_sparse_mla(qf, store, table, idx, slot=1, sm_scale=sm_scale, v_dim=v)
        configs = [("default", gm.SparseMLAMosaicConfig()),
                   ("stage=chunks", gm.SparseMLAMosaicConfig(stage_layout="chunks")),
                   ("num_splits=max", gm.SparseMLAMosaicConfig(num_splits=K // 64)),
                   ("stages=1", gm.SparseMLAMosaicConfig(stages=1))]
        for cname, cfg in configs:
            name = f"4 kernel {cname}"

            def step4(cfg=cfg, name=name):
                fn = jax.jit(functools.partial(gm.paged_sparse_mla, sm_scale=sm_scale, v_dim=v, config=cfg,
                                               interpret=interp))
                out, lse = fn(qf, store, table, idx, slot=jnp.int32(1))
                _report(name + " lse", lse, ref_lse, 1e-2)
                _report(name + " out", out.astype(jnp.float32), ref_out.astype(jnp.float32), 2e-2)
            _run(name, step4)

    print("--- summary")
    for name, status, err in RESULTS:
        print(f"{status:5s}  {err:10.4g}  {name}")
    return 0 if all(s == "PASS" for _, s, _ in RESULTS) else 2


if __name__ == "__main__":
    sys.exit(main())
