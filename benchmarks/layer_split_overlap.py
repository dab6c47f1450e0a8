"""Compile a LayerSplit decode step for a TPU slice (ahead of time, no TPU needed) and print
the async collectives in its scheduled HLO and the compute that runs while each is in flight.

    python benchmarks/layer_split_overlap.py --config configs/tiny.yaml --topology v5p:2x2x1 --mesh layer=4
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks._report import Table  # noqa: E402 - after JAX_PLATFORMS (it imports no jax)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--mesh", default="layer=4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--collective", default="permute", choices=("permute", "psum"))
    args = ap.parse_args()

    from glm_jax.aot import compile_decode_step
    from glm_jax.config import load_config
    from glm_jax.hlo_overlap import async_pairs, summarize

    cfg = load_config(args.config).replace(dtype="bfloat16")
    compiled = compile_decode_step(cfg, topology=args.topology, mesh_spec=args.mesh, batch=args.batch,
                                   max_len=args.max_len, collective=args.collective)
    pairs = async_pairs(compiled.as_text())
    print(f"{cfg.name}: decode step, batch {args.batch}, cache {args.max_len} rows, mesh {args.mesh} on "
          f"{args.topology}, owner broadcast by {args.collective}")
    table = Table("async op", "start/done pairs", "with compute in flight")
    for kind, row in sorted(summarize(pairs).items()):
        table.row(kind, row["pairs"], row["overlapped"])
    permutes = [p for p in pairs if p.kind == "collective-permute"]
    if permutes:
        print("\ncollective-permute pairs (start -> done: compute ops scheduled between):")
        for p in permutes:
            print(f"  {p.start} -> {p.done}: {p.ops_between}")


if __name__ == "__main__":
    main()
