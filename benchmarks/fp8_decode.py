"""FP8 against bf16 cache pages in the paged decode kernels, in one run.

    PYTHONPATH=. python3 benchmarks/fp8_decode.py --json fp8_decode.json    # on a GPU
    PYTHONPATH=. python3 benchmarks/fp8_decode.py --smoke                   # tiny, CPU, Pallas interpreted

Prints the device copy bandwidth (read + write of a 2 GiB bf16 array, `_measure.ceilings`), then
one row per measurement and a final markdown table:

* paged sparse MLA decode (GLM-5.2's shapes: 64 heads, Dk 576 = 512 latent + 64 rope, v 512,
  top-k 2048, one query per sequence) at 128K and 1M context, batch 64 and 128, with bf16
  pages [1, pages, 64, 576] and FP8 pages (`pallas_kernels.fp8.Fp8Latent`: the same rows
  quantized, 656 bytes a row against 1,152), per implementation (`--impls`; the GPU default is
  pallas_gpu and xla, and cuda where its library is built: scripts/build_cuda_kernels.sh). GB/s
  counts the selected rows' bytes in each layout (B x K x row bytes: what the kernel must read),
  set against the copy bandwidth. "vs bf16" is the largest
  |out_fp8 - out_bf16| of the same implementation (random rows: the quantization error, not a
  quality measurement).
* the paged indexer top-k at 1M context (32 heads x 128, top-k 2048): bf16 keys against FP8
  keys (`Fp8Keys`, 132 bytes a key against 256) per implementation (one that does not read
  FP8 keys gives a row with the op's refusal). GB/s counts every key's bytes (B x T x key bytes);
  "vs bf16" is the share of the bf16 selection the FP8 one keeps.

The pages: sequences' page tables point at random into one pool of at most `--pool-gib` GiB
per layout (sequences share pages), so a 1M context at batch 128 (151 GB of bf16 rows) needs no
such store: the decode kernels read the selected rows (MLA) or every key of the context through
the table, the bytes they move do not depend on the pool's size, and a pool of GiBs is far
above the L2 cache. A row that fails (out of memory, a lowering error) is kept as a row with its
exception. `--json FILE` writes the rows after each one.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks._measure import bench, ceilings
from benchmarks._report import Table, device_kind, failure, write_json
from pallas_kernels import fp8
from pallas_kernels.sparse_mla import cuda

HEADS, DK, V_DIM, TOPK, PAGE = 64, 576, 512, 2048, 64
IDX_HEADS, IDX_DIM = 32, 128


def default_mla_impls(interpret: bool) -> list[str]:
    """pallas_gpu and xla, and cuda on a GPU where its library is built (`cuda.available`)."""
    return ["pallas_gpu", "xla"] + (["cuda"] if not interpret and cuda.available() else [])


def pool_pages(budget_bytes: float, page: int, row_bytes: int, wanted: int) -> int:
    """Pages of the shared pool: as many as the sequences address, at most budget_bytes of bf16."""
    return int(max(2, min(wanted, budget_bytes // (page * row_bytes))))


def page_table(key, batch: int, context: int, page: int, pages: int) -> jax.Array:
    """int32 [batch, context / page] of random page ids in [0, pages)."""
    return jax.random.randint(key, (batch, -(-context // page)), 0, pages, jnp.int32)


def latent_stores(pages: int, page: int, dk: int, v_dim: int):
    """(bf16 store [1, pages, page, dk], the same rows in the FP8 layout)."""
    bf16 = jax.jit(lambda k: jax.random.normal(k, (1, pages, page, dk), jnp.bfloat16))(jax.random.key(1))
    return bf16, jax.jit(lambda s: fp8.quantize_latent(s, v_dim))(bf16)


def key_stores(pages: int, page: int, dim: int):
    bf16 = jax.jit(lambda k: jax.random.normal(k, (1, pages, page, dim), jnp.bfloat16))(jax.random.key(2))
    return bf16, jax.jit(fp8.quantize_keys)(bf16)


def mla_rows(args, impls, interpret, bw, rows, report):
    heads, dk, v_dim, topk, page = args.heads, args.dk, args.dk - 64, args.topk, args.page
    wanted = max(args.batches) * -(-max(args.contexts) // page)
    pages = pool_pages(args.pool_gib * 2 ** 30, page, 2 * dk, wanted)
    stores = latent_stores(pages, page, dk, v_dim)
    for context in args.contexts:
        for batch in args.batches:
            keys = jax.random.split(jax.random.key(context + batch), 3)
            q = jax.random.normal(keys[0], (batch, 1, heads, dk), jnp.bfloat16)
            table = page_table(keys[1], batch, context, page, pages)
            idx = jax.random.randint(keys[2], (batch, 1, topk), 0, context, jnp.int32)
            for impl in impls:
                outs = {}
                for layout, store in zip(("bf16", "fp8"), stores):
                    row = dict(op="paged_sparse_mla", layout=layout, impl=impl, context=context, batch=batch,
                               row_bytes=fp8.row_bytes(store))
                    try:
                        fn = jax.jit(lambda q, s, t, i, impl=impl: pk.paged_sparse_mla(
                            q, s, t, i, sm_scale=dk ** -0.5, v_dim=v_dim, impl=impl,
                            interpret=interpret and impl.startswith("pallas")))
                        outs[layout] = fn(q, store, table, idx)[0]
                        t = bench(fn, q, store, table, idx, reps=3 if interpret else 7)
                        moved = batch * topk * row["row_bytes"]
                        row.update(ms=t * 1e3, bytes=moved, gb_s=moved / t / 1e9, copy_share=moved / t / bw)
                        if layout == "fp8" and "bf16" in outs:
                            row["vs_bf16"] = float(jnp.max(jnp.abs(outs["fp8"].astype(jnp.float32)
                                                                   - outs["bf16"].astype(jnp.float32))))
                    except Exception as e:  # noqa: BLE001 -- a failed row is reported, the run goes on
                        row["failed"] = failure(e)
                    report(row)
    del stores


def indexer_rows(args, impls, interpret, bw, rows, report):
    batch, context, page, topk = args.indexer_batch, args.indexer_context, args.page, args.topk
    wanted = batch * -(-context // page)
    pages = pool_pages(args.pool_gib * 2 ** 30, page, 2 * IDX_DIM, wanted)
    stores = key_stores(pages, page, IDX_DIM)
    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (batch, 1, args.idx_heads, IDX_DIM), jnp.bfloat16)
    w = jax.random.uniform(keys[1], (batch, 1, args.idx_heads), jnp.float32) * (args.idx_heads * IDX_DIM) ** -0.5
    table = page_table(keys[2], batch, context, page, pages)
    q_pos, kv_len = jnp.full((batch, 1), context - 1, jnp.int32), jnp.full((batch,), context, jnp.int32)
    selected = {}
    for impl in impls:
        for layout, store in zip(("bf16", "fp8"), stores):
            row = dict(op="paged_indexer_topk", layout=layout, impl=impl, context=context, batch=batch,
                       row_bytes=fp8.row_bytes(store))
            try:
                fn = jax.jit(lambda q, s, t, w, p, n, impl=impl: pk.paged_indexer_topk(
                    q, s, t, w, topk=topk, q_pos=p, kv_len=n, impl=impl,
                    interpret=interpret and impl.startswith("pallas")))
                selected[impl, layout] = np.asarray(fn(q, store, table, w, q_pos, kv_len))
                t = bench(fn, q, store, table, w, q_pos, kv_len, reps=3 if interpret else 7)
                moved = batch * context * row["row_bytes"]
                row.update(ms=t * 1e3, bytes=moved, gb_s=moved / t / 1e9, copy_share=moved / t / bw)
                base = selected.get((impl, "bf16"))
                if layout == "fp8" and base is not None:
                    got = selected[impl, layout]
                    row["vs_bf16"] = float(np.mean([np.intersect1d(a, b).size / max(1, (b >= 0).sum())
                                                    for a, b in zip(got.reshape(batch, -1), base.reshape(batch, -1))]))
            except Exception as e:  # noqa: BLE001
                row["failed"] = failure(e)
            report(row)
    del stores


def _cell(row, key, fmt):
    return fmt.format(row[key]) if key in row else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Pallas in interpret mode")
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--impls", nargs="+",
                    help="paged_sparse_mla impls (default: pallas_gpu and xla on a GPU, and cuda where it is built)")
    ap.add_argument("--indexer-impls", nargs="+", help="paged_indexer_topk impls (default: pallas_gpu and xla)")
    ap.add_argument("--indexer-context", type=int, default=1048576)
    ap.add_argument("--indexer-batch", type=int, default=64)
    ap.add_argument("--pool-gib", type=float, default=4.0, help="bf16 bytes of each shared page pool")
    ap.add_argument("--json", help="also write the rows here (after each row)")
    args = ap.parse_args(argv)
    args.heads, args.dk, args.topk, args.page, args.idx_heads = HEADS, DK, TOPK, PAGE, IDX_HEADS
    if args.smoke:
        args.contexts, args.batches, args.indexer_context, args.indexer_batch = [512], [2], 512, 2
        args.heads, args.dk, args.topk, args.page, args.idx_heads, args.pool_gib = 16, 256 + 64, 64, 16, 4, 0.01
    interpret = jax.default_backend() == "cpu"
    impls = args.impls or default_mla_impls(interpret)
    indexer_impls = args.indexer_impls or ["pallas_gpu", "xla"]
    bw, _ = ceilings(args.smoke)
    print(f"device: {device_kind()}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)"
          f"{'; Pallas interpreted' if interpret else ''}", flush=True)
    rows = []
    columns = ("op", "layout", "impl", "context", "batch", "row bytes", "ms", "GB read", "GB/s", "% of copy BW",
               "vs bf16", "failed")

    def cells(row):
        return (row["op"], row["layout"], row["impl"], row["context"], row["batch"], row["row_bytes"],
                _cell(row, "ms", "{:.3f}"), f"{row['bytes'] / 1e9:.3f}" if "bytes" in row else "",
                _cell(row, "gb_s", "{:.0f}"), _cell(row, "copy_share", "{:.0%}"), _cell(row, "vs_bf16", "{:.3g}"),
                row.get("failed", ""))

    def report(row):
        rows.append(row)
        print("row: " + " | ".join(str(c) for c in cells(row)), flush=True)
        write_json(args.json, dict(device=device_kind(), copy_bytes_per_s=bw, rows=rows))

    for part in (lambda: mla_rows(args, impls, interpret, bw, rows, report),
                 lambda: indexer_rows(args, indexer_impls, interpret, bw, rows, report)):
        try:
            part()
        except Exception as e:  # noqa: BLE001 -- a part that fails before its rows (its stores)
            report(dict(op="setup", layout="", impl="", context="", batch="", row_bytes="", failed=failure(e)))
    print(f"\n### FP8 against bf16 pages, paged decode ({device_kind()}, copy {bw / 1e9:.0f} GB/s)\n")
    table = Table(*columns)
    for row in rows:
        table.row(*cells(row))
    return rows


if __name__ == "__main__":
    main()
