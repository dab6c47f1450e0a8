"""Host time per decode step of the serving engine as the context grows (one request decoding
a long continuation over a page pool), next to the whole step's wall time, and what one jitted
call costs the host, piece by piece.

    PYTHONPATH=. python benchmarks/engine_steps.py --config configs/tiny.yaml --max-context 1024 --new-tokens 960

"host" is a step's wall time minus the time it blocked waiting for the device (the engine
reads step n's tokens after dispatching step n+1); "of which the decode program call" is the
time until the jitted decode call returned (the runtime launching the program). The last table
times what the engine avoids per call: hashing the nnx GraphDef as a static argument and
passing the nnx State pytree instead of a flat tuple of its arrays.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def per_call_us(fn, calls: int = 200) -> float:
    """Median microseconds of fn() over `calls` calls (after one warm-up call)."""
    import numpy as np

    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=960)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--buckets", type=int, default=6)
    args = ap.parse_args()

    import jax
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
    calls: list[float] = []                              # host seconds of each decode program call
    decode = engine.programs.decode

    def timed_decode(*args):
        t0 = time.perf_counter()
        out = decode(*args)
        calls.append(time.perf_counter() - t0)
        return out
    engine.programs = engine.programs._replace(decode=timed_decode)
    engine.serve([Request(np.arange(1, 33), args.new_tokens)])
    times = engine.step_times
    print(f"{cfg.name}: {len(times)} decode steps, pool of {pages} pages x {args.page_size} rows, one jitted "
          "call per step")
    print("| context (tokens) | host ms / step (median) | of which the decode program call | "
          "step ms (median, incl. device) |")
    print("|---|---|---|---|")
    for chunk in np.array_split(np.arange(len(times)), args.buckets):
        sel = [times[i] for i in chunk]
        print(f"| {sel[0].context}-{sel[-1].context} | {1e3 * np.median([t.host_s for t in sel]):.3f} | "
              f"{1e3 * np.median([calls[i] for i in chunk]):.3f} | {1e3 * np.median([t.step_s for t in sel]):.2f} |")
    trivial = jax.jit(lambda params, x: x + 1)
    x = jax.numpy.zeros(())
    print("\n| per call (host) | us (median) |")
    print("|---|---|")
    print(f"| hash of the model's nnx GraphDef (a static argument hashes it every call) | "
          f"{per_call_us(lambda: hash(engine.graphdef)):.0f} |")
    print(f"| a trivial jitted call given the nnx State | {per_call_us(lambda: trivial(engine.state, x)):.0f} |")
    print(f"| a trivial jitted call given the flat tuple of its {len(engine.params)} arrays | "
          f"{per_call_us(lambda: trivial(engine.params, x)):.0f} |")


if __name__ == "__main__":
    main()
