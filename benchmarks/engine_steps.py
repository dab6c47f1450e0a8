"""Host time per decoded step of the serving engine as the context grows (one request decoding
a long continuation over a page pool), next to the device's time per step, and what one jitted
call costs the host, piece by piece.

    PYTHONPATH=. python benchmarks/engine_steps.py --config configs/tiny.yaml --max-context 1024 --new-tokens 960
    PYTHONPATH=. python benchmarks/engine_steps.py --decode-steps 8    # blocks of 8 decode steps per call

Each engine step makes one decode call of one decode step or, with --decode-steps N, mostly a
block of N (`ServingEngine(decode_steps=N)`; single steps where the request prefills or has
fewer than N tokens left), so the per-step columns divide each call's time by the steps it ran.
"host" is an engine step's wall time minus the time it blocked waiting for the device (the
engine reads call n's tokens after dispatching call n+1); "host CPU" is the CPU time of the
engine's thread in the step (what the host works, without any wait, even one inside the
runtime); "decode call" is the time until the jitted decode call returned (the runtime
launching the program), wall / CPU, per call and per decoded step. A second run calls the
decode program with its inputs ready (the device idle): the launch alone, to tell launch work
from time the call spent waiting on the call in flight. A third run blocks on each call's outputs before the engine goes
on, so the device is idle while the engine works: the step's host work minus the call and that
block is the engine's own work around the call (scheduling, inputs, read-back, events), free of
contention with the device (on a CPU it computes on the same cores). On a GPU the programs run
as CUDA graphs unless --no-cuda-graphs; --check-cuda-graphs N decodes N greedy tokens both ways
and compares them. "device" is the engine step's wall time per decoded step: with one call in
flight the engine runs at the pace of the slower of host and device, so where host < device the
device sets the pace and host time is hidden. The summary says in how many context ranges host
time per decoded step (wall and CPU) is under 1 ms and under the device's. The
last table times what the engine avoids per call: hashing the nnx GraphDef as a static
argument, passing the nnx State pytree instead of a flat tuple of its arrays, and passing the
MTP layer's arrays, which serving never reads.

    PYTHONPATH=. python benchmarks/engine_steps.py --loop 8 --new-tokens 300

`--loop N` measures instead what the HTTP server's engine thread adds: N concurrent requests
(N slots) stepped directly by `engine.serve`, then the same requests through an `EngineLoop`
(glm_jax/serving/engine_loop.py) with an asyncio consumer per request that encodes each event
as a JSON chunk, as a stream does, without HTTP. It prints host ms/step by context range for
both (steps with a prefill chunk included), and the loop's step time, per decoded step.
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


def model_config(name: str):
    """A config file's config, or for 'serving-load' the model benchmarks/serving_load.py serves."""
    if name == "serving-load":
        from benchmarks._serving_model import PATTERNS, model_config as serving_model

        return serving_model(PATTERNS["IndexShare"], smoke=False)
    from glm_jax.config import load_config

    return load_config(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml",
                    help="a config file, or 'serving-load' for benchmarks/serving_load.py's model (8 layers, "
                         "GLM-5.2's attention, IndexShare)")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="on a GPU, launch the programs kernel by kernel (ServingEngine(cuda_graphs=False))")
    ap.add_argument("--check-cuda-graphs", type=int, default=0, metavar="N",
                    help="also decode N greedy tokens with and without CUDA graphs and say whether they are equal")
    ap.add_argument("--new-tokens", type=int, default=960)
    ap.add_argument("--decode-steps", type=int, default=1, metavar="N",
                    help="the most decode steps per call (ServingEngine(decode_steps=N), at most --page-size)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--buckets", type=int, default=6)
    ap.add_argument("--loop", type=int, default=0, metavar="N",
                    help="N concurrent requests stepped directly and through an EngineLoop (see above)")
    args = ap.parse_args()
    if args.loop:
        loop_main(args)
        return

    import jax
    import numpy as np
    from flax import nnx

    from glm_jax.decoding.engine import Request, ServingEngine
    from glm_jax.decoding.programs import compiler_options
    from glm_jax.model import GLMModel

    cfg = model_config(args.config)
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    pages = -(-(args.max_context + 64) // args.page_size) + 1
    shapes = dict(slots=1, num_pages=pages, page_size=args.page_size, max_context=args.max_context, prefill_chunk=64,
                  decode_steps=args.decode_steps)
    engine = ServingEngine(model, **shapes, cuda_graphs=not args.no_cuda_graphs)
    graphs = bool(compiler_options(jax.default_backend(), not args.no_cuda_graphs))
    print(f"backend {jax.default_backend()}; CUDA graphs {'on' if graphs else 'off'}; up to {args.decode_steps} "
          "decode steps per call")
    engine.serve([Request(np.arange(1, 33), 1 + 2 * args.decode_steps)])          # compile (single steps and blocks)
    engine.step_times.clear()
    calls: list[tuple[float, float]] = []      # (wall, CPU) seconds of each decode program call
    settled: list[tuple[float, float]] = []    # (wall, CPU) seconds blocked on its outputs (third run)
    decode = engine.programs.decode
    idle, settle = [False], [False]

    def timed_decode(*args, steps):
        if idle[0]:
            jax.block_until_ready(args)                  # the device idle, the inputs ready
        t0, cpu0 = time.perf_counter(), time.thread_time()
        out = decode(*args, steps=steps)
        calls.append((time.perf_counter() - t0, time.thread_time() - cpu0))
        if settle[0]:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            jax.block_until_ready(out)                   # the device idle while the engine works on
            settled.append((time.perf_counter() - t0, time.thread_time() - cpu0))
        return out
    engine.programs = engine.programs._replace(decode=timed_decode)
    engine.serve([Request(np.arange(1, 33), args.new_tokens)])
    times = engine.step_times
    ms = lambda xs: 1e3 * float(np.median(xs))  # noqa: E731
    steps = sum(t.steps for t in times)
    print(f"{cfg.name}: {steps} decode steps in {len(times)} calls, pool of {pages} pages x {args.page_size} rows "
          "(medians; per step: a call's time / the decode steps it ran)")
    print("| context (tokens) | host ms / step | host CPU ms / step | decode call ms / call (wall / CPU) | "
          "decode call ms / step (wall / CPU) | device ms / step |")
    print("|---|---|---|---|---|---|")
    rows = []
    for chunk in np.array_split(np.arange(len(times)), args.buckets):
        host, cpu, device = (ms([getattr(times[i], f) / times[i].steps for i in chunk])
                             for f in ("host_s", "cpu_s", "step_s"))
        rows.append((host, cpu, device))
        per_call = [ms([calls[i][k] for i in chunk]) for k in (0, 1)]
        per_step = [ms([calls[i][k] / times[i].steps for i in chunk]) for k in (0, 1)]
        print(f"| {times[chunk[0]].context}-{times[chunk[-1]].context} | {host:.3f} | {cpu:.3f} | "
              f"{per_call[0]:.3f} / {per_call[1]:.3f} | {per_step[0]:.3f} / {per_step[1]:.3f} | {device:.2f} |")
    print(f"host < 1 ms in {sum(h < 1 for h, _, _ in rows)} of {len(rows)} context ranges (wall), "
          f"{sum(c < 1 for _, c, _ in rows)} of {len(rows)} (CPU); host < device in "
          f"{sum(h < d for h, _, d in rows)} of {len(rows)}")
    if args.check_cuda_graphs:
        request = [Request(np.arange(1, 33), args.check_cuda_graphs)]
        plain = ServingEngine(model, **shapes, cuda_graphs=False)
        graphs = ServingEngine(model, **shapes, cuda_graphs=True)
        same = plain.serve(request)[0].tokens == graphs.serve(request)[0].tokens
        print(f"{args.check_cuda_graphs} greedy tokens with and without CUDA graphs equal: {same}")
    calls.clear()
    engine.step_times.clear()
    idle[0] = True
    engine.serve([Request(np.arange(1, 33), min(args.new_tokens, 200))])
    ready_steps = [t.steps for t in engine.step_times]
    print(f"the decode call with its inputs ready (device idle), {len(calls)} calls of {sum(ready_steps)} steps: "
          f"{ms([w for w, _ in calls]):.3f} ms wall, {ms([c for _, c in calls]):.3f} ms CPU per call; "
          f"{ms([w / n for (w, _), n in zip(calls, ready_steps)]):.3f} ms wall, "
          f"{ms([c / n for (_, c), n in zip(calls, ready_steps)]):.3f} ms CPU per step")
    calls.clear()
    engine.step_times.clear()
    idle[0], settle[0] = False, True
    engine.serve([Request(np.arange(1, 33), min(args.new_tokens, 500))])
    around = [(t.host_s - c[0] - b[0], t.cpu_s - c[1] - b[1]) for t, c, b in zip(engine.step_times, calls, settled)]
    print(f"the engine's host work around the decode call, the device idle during it, {len(around)} calls: "
          f"{1e3 * ms([w for w, _ in around]):.1f} us wall, {1e3 * ms([c for _, c in around]):.1f} us CPU")
    trivial = jax.jit(lambda params, x: x + 1)
    x = jax.numpy.zeros(())
    graphdef, state = nnx.split(model)       # the nnx convention the programs no longer take, for comparison
    every = tuple(jax.tree.leaves(state))
    print("\n| per call (host) | us (median) |")
    print("|---|---|")
    print(f"| hash of the model's nnx GraphDef (a static argument hashes it every call) | "
          f"{per_call_us(lambda: hash(graphdef)):.0f} |")
    print(f"| a trivial jitted call given the nnx State | {per_call_us(lambda: trivial(state, x)):.0f} |")
    print(f"| a trivial jitted call given the flat tuple of its {len(every)} arrays | "
          f"{per_call_us(lambda: trivial(every, x)):.0f} |")
    print(f"| a trivial jitted call given the {len(engine.params)} arrays serving reads (no MTP layer) | "
          f"{per_call_us(lambda: trivial(engine.params, x)):.0f} |")


def through_engine_loop(engine, requests) -> None:
    """Run `requests` through an EngineLoop on the engine, one asyncio consumer per request that
    JSON-encodes each event (what a stream does per chunk, without HTTP)."""
    import asyncio
    import json

    from glm_jax.serving.engine_loop import EngineLoop

    async def consume(loop: EngineLoop, request) -> None:
        ticket = loop.submit(request)
        try:
            while True:
                event = await ticket.next_event()
                json.dumps({"object": "text_completion", "choices": [{"index": 0, "tokens": event.tokens}]})
                if event.finished:
                    return
        finally:
            loop.finish(ticket)

    async def serve_all() -> None:
        loop = EngineLoop(engine)
        loop.start()
        await asyncio.gather(*(consume(loop, r) for r in requests))
        await asyncio.to_thread(loop.close)

    asyncio.run(serve_all())


def loop_main(args) -> None:
    """--loop N: host ms/step of N concurrent requests, engine stepped directly and in an EngineLoop."""
    import numpy as np
    from flax import nnx

    from glm_jax.decoding.engine import Request, ServingEngine
    from glm_jax.model import GLMModel

    cfg = model_config(args.config)
    slots = args.loop
    pages = slots * -(-(args.max_context + 64) // args.page_size) + 1
    engine = ServingEngine(GLMModel(cfg, rngs=nnx.Rngs(0)), slots=slots, num_pages=pages, page_size=args.page_size,
                           max_context=args.max_context, prefill_chunk=64, decode_steps=args.decode_steps)
    engine.serve([Request(np.arange(1, 33), 4)])          # compile
    requests = [Request(np.arange(1, 33), args.new_tokens) for _ in range(slots)]
    engine.step_times.clear()
    engine.serve(requests)
    direct = list(engine.step_times)
    engine.step_times.clear()
    through_engine_loop(engine, requests)
    looped = list(engine.step_times)
    print(f"{cfg.name}: {slots} concurrent requests of {args.new_tokens} new tokens, {slots} slots, up to "
          f"{args.decode_steps} decode steps per call (medians; per step: a call's time / its decode steps)")
    print("| context (tokens) | host ms / step, engine.serve | host ms / step, in the EngineLoop | "
          "step ms, in the EngineLoop |")
    print("|---|---|---|---|")
    buckets = zip(np.array_split(np.arange(len(direct)), args.buckets),
                  np.array_split(np.arange(len(looped)), args.buckets))
    for plain, loop in buckets:
        print(f"| {looped[loop[0]].context}-{looped[loop[-1]].context} | "
              f"{1e3 * np.median([direct[i].host_s / direct[i].steps for i in plain]):.3f} | "
              f"{1e3 * np.median([looped[i].host_s / looped[i].steps for i in loop]):.3f} | "
              f"{1e3 * np.median([looped[i].step_s / looped[i].steps for i in loop]):.2f} |")


if __name__ == "__main__":
    main()
