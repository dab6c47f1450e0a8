"""Host time per decode step of the serving engine as the context grows (one request decoding
a long continuation over a page pool), next to the whole step's wall time.

    python benchmarks/engine_steps.py --config configs/tiny.yaml --max-context 1024 --new-tokens 960
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=960)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--buckets", type=int, default=6)
    args = ap.parse_args()

    import numpy as np
    from flax import nnx

    from glm_jax.config import load_config
    from glm_jax.decoding.engine import Request, ServingEngine
    from glm_jax.model import GLMModel

    cfg = load_config(args.config)
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    pages = -(-(args.max_context + 64) // args.page_size) + 1
    engine = ServingEngine(model, slots=1, num_pages=pages, page_size=args.page_size,
                           max_context=args.max_context, prefill_chunk=64)
    engine.serve([Request(np.arange(1, 33), 4)])          # compile
    engine.step_times.clear()
    engine.serve([Request(np.arange(1, 33), args.new_tokens)])
    times = engine.step_times
    print(f"{cfg.name}: {len(times)} decode steps, pool of {pages} pages x {args.page_size} rows, one jitted "
          "call per step")
    print("| context (tokens) | host ms / step (median) | step ms (median, incl. device) |")
    print("|---|---|---|")
    for chunk in np.array_split(np.arange(len(times)), args.buckets):
        sel = [times[i] for i in chunk]
        print(f"| {sel[0].context}-{sel[-1].context} | {1e3 * np.median([t.host_s for t in sel]):.3f} | "
              f"{1e3 * np.median([t.step_s for t in sel]):.2f} |")


if __name__ == "__main__":
    main()
