"""Serving under load: Poisson arrivals, mixed prompt lengths, continuous batching against
static waves, IndexShare against every layer Full, at several max-context values.

    PYTHONPATH=. python3 benchmarks/serving_load.py --out docs/data/serving_load_h200.json    # on a GPU
    PYTHONPATH=. python3 benchmarks/serving_load.py --smoke --out /tmp/serving_load.json       # tiny, CPU
    PYTHONPATH=. python3 benchmarks/plot.py serving_load /tmp/serving_load.json /tmp/serving_load.svg

The model is benchmarks/long_context.py's 8-layer model with GLM-5.2's attention (random
weights; `--smoke` shrinks it), once with the IndexShare pattern and once all Full. For each
max context a workload is drawn once: `--requests` arrivals at `--rate` per second (Poisson),
prompt lengths log-uniform from 16 to max context - new tokens, `--new-tokens` each (greedy,
no stop token). It is replayed in real time against two servers with the same slots and page
pool:

* continuous: `ServingEngine.step()` in a loop (requests join and leave at every step, chunked
  prefill beside decoding, one step of host/device overlap);
* static waves (the baseline, the engine before continuous batching): take up to `slots`
  waiting requests that fit the pool with prompt + new tokens up front, prefill them together,
  decode one blocking step at a time until all of them finish; arrivals wait for the next wave;
* with `--mesh SPEC` (e.g. `layer=2`), the continuous servers on that device mesh (static waves
  are left out: compare with a run without --mesh);
* with `--step-token-budget N [N ...]`, also "continuous, budget N" for each N: the continuous
  engine with at most N tokens per step while requests decode
  (`ServingEngine(step_token_budget=N)`), to compare its ITL p99 and TTFT with the row of the
  engine without a budget.

Per run: throughput (new tokens / time from the first arrival to the last token), time to
first token and inter-token latency (p50 / p99, as a client sees tokens arrive), host ms per
step (median; wall time minus waits on the device, and the CPU time of the engine's thread),
two ceilings and goodput: the tokens/s of the requests that met the objective (TTFT <=
--slo-ttft-ms and mean time per output token <= --slo-tpot-ms, as vLLM's serving benchmark
counts it).

The ceilings. "decode ceiling": `slots` tokens per median full-batch decode step of the
continuous run (n/a when no step had every slot decoding): what the device gives if it only
decoded. "device ceiling": what the device gives for this workload, prompts included: the
workload's new tokens over the device seconds they need at best, the prefill of every prompt
plus every token decoded in a full batch,

    N / (sum_i prefill(L_i) + N d / slots)

with d the median full-batch decode step and prefill(L) measured before the clock: a request of
L prompt tokens served alone to its first token, for --ceiling-points prompt lengths of the
workload (its quantiles), interpolated linearly between them, less the one decode step it
includes (d - d / slots: the share a full batch would not pay). The host's launch of each
prefill chunk stays in, so the ceiling errs low by that much (well under a millisecond a
chunk).

Rate sweep (as vLLM's serving benchmark): `--rates R1 R2 ...` replays the continuous server(s) at
each arrival rate (the same prompts, arrival gaps scaled), and `--sweep` doubles the rate from
--rate until the throughput grows by less than 5% (saturation, at most --max-rates rates). The
static waves run at the first rate only (the baseline). After each context, pattern and
continuous server a line gives the saturation throughput (the best of the sweep) against the
device ceiling. With --sweep, each continuous server is then replayed once more at 80% of
its saturation throughput (the arrival rate that offers 0.8 x saturation tokens/s): its ITL p99
against p50 there is the latency target's measure.

KV cache layouts: `--kv-cache-dtype auto fp8` runs every server once per layout, in turn, in one
process (server names end ", KV auto" / ", KV fp8"). `--cache-memory-fraction F` gives every
layout's pool the same bytes: F of the device's free memory once the first model's weights are
placed, measured once (a CPU has no memory statistics: `--kv-cache-memory-bytes N`). Rows record
the layout, the pool's pages and bytes, `admits` (max-context sequences the pool holds at once),
`peak_decoding` (most slots drawing in one step) and `decode_tokens_s` (tokens drawn per second
in steps that prefilled nothing); a line gives FP8 / auto ratios per rate (`_serving_layouts`).
`--min-prompt N`: prompts from N tokens (max context - new tokens: all at the full context);
`--config FILE`: its model (8 layers, random weights) for the default; `--no-waves`: no baseline.
Programs are compiled before the clock starts. A server that fails at a context (e.g. out of
device memory, a refused layout) gets a row with its error, and the run goes on. --out is
rewritten after every row, so a run cut short keeps the rows it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import deque

from benchmarks._report import device_kind, failure, write_json
from benchmarks._serving_layouts import cache_budget, capacity, decode_rate, layout_server, pool_size, print_ratios
from benchmarks._serving_report import failed_row, print_row, print_saturation, saturation_row


@dataclasses.dataclass
class Arrival:
    at: float                 # seconds after the start
    prompt: object            # int32 numpy [P]
    new_tokens: int


@dataclasses.dataclass
class Trace:
    """What one replay produced: per request its arrival and its token arrival times."""

    arrivals: list[float]
    token_times: list[list[float]]
    host_s: list[float]       # host seconds per decode step
    step_s: list[float]       # wall seconds of the decode steps where every slot decoded
    cpu_s: list[float] = dataclasses.field(default_factory=list)   # CPU seconds per step (engine thread)

    def metrics(self, slots: int, slo: "Objective | None" = None) -> dict:
        import numpy as np

        slo = slo or Objective()
        tokens = sum(map(len, self.token_times))
        end = max(t[-1] for t in self.token_times if t)
        span = end - min(self.arrivals)
        ttft = [t[0] - a for a, t in zip(self.arrivals, self.token_times) if t]
        itl = [b - a for t in self.token_times for a, b in zip(t, t[1:])]
        pct = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
        good = sum(len(t) for a, t in zip(self.arrivals, self.token_times) if t and slo.met(a, t))
        return dict(tokens=tokens, throughput=tokens / span, goodput=good / span,
                    ttft_p50_ms=pct(ttft, 50), ttft_p99_ms=pct(ttft, 99), itl_p50_ms=pct(itl, 50),
                    itl_p99_ms=pct(itl, 99), host_ms_per_step=1e3 * float(np.median(self.host_s)),
                    host_cpu_ms_per_step=1e3 * float(np.median(self.cpu_s)) if self.cpu_s else float("nan"),
                    decode_step_ms=1e3 * float(np.median(self.step_s)) if self.step_s else float("nan"),
                    ceiling_tokens_s=slots / float(np.median(self.step_s)) if self.step_s else float("nan"))


def prefill_profile(engine, arrivals: list[Arrival], points: int) -> tuple[list[int], list[float]]:
    """(prompt lengths, seconds): `points` prompts of the workload (quantiles of its lengths), each
    served alone to its first token by `engine` (compiled, idle) -> the seconds it took."""
    import numpy as np

    from glm_jax.decoding.engine import Request

    by_length = sorted(arrivals, key=lambda a: len(a.prompt))
    picks = sorted({int(round(q * (len(by_length) - 1))) for q in np.linspace(0.0, 1.0, points)})
    lengths, seconds = [], []
    for i in picks:
        prompt = by_length[i].prompt
        t0 = time.perf_counter()
        engine.serve([Request(prompt, 1)])
        seconds.append(time.perf_counter() - t0)
        lengths.append(len(prompt))
    return lengths, seconds


def device_ceiling(arrivals: list[Arrival], profile, decode_step_s: float, slots: int) -> float:
    """New tokens / s the device gives for the workload at best (module docstring): every prompt
    prefilled (`profile`, interpolated, less a decode step's unshared part), every token decoded
    in a full batch."""
    import numpy as np

    lengths, seconds = profile
    if not lengths or decode_step_s != decode_step_s:
        return float("nan")
    unshared = decode_step_s * (1 - 1 / slots)
    prefill = sum(max(0.0, float(np.interp(len(a.prompt), lengths, seconds)) - unshared) for a in arrivals)
    tokens = sum(a.new_tokens for a in arrivals)
    return tokens / (prefill + tokens * decode_step_s / slots)


@dataclasses.dataclass(frozen=True)
class Objective:
    """A request meets it if its first token came within ttft_ms of its arrival and its later
    tokens took at most tpot_ms each on average."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0

    def met(self, arrival: float, times: list[float]) -> bool:
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        return (times[0] - arrival) * 1e3 <= self.ttft_ms and tpot * 1e3 <= self.tpot_ms


def at_rate(arrivals: list[Arrival], base_rate: float, rate: float) -> list[Arrival]:
    """The same requests with their arrival times scaled from base_rate to rate per second."""
    return [dataclasses.replace(a, at=a.at * base_rate / rate) for a in arrivals]


def sweep_rates(first: float, *, given: list[float] | None, sweep: bool, most: int):
    """The rates to run, as a generator that is told each rate's throughput (send): the given
    ones, or with sweep doubling from `first` until the throughput grows < 5% or `most` ran."""
    if not sweep:
        for rate in given or [first]:
            yield rate
        return
    rate, best = first, 0.0
    for _ in range(most):
        throughput = yield rate
        if throughput is not None and throughput < 1.05 * best:
            return
        best = max(best, throughput or 0.0)
        rate *= 2


def workload(rng, *, requests: int, rate: float, context: int, new_tokens: int, vocab: int,
             shortest: int = 16) -> list[Arrival]:
    import numpy as np

    gaps = rng.exponential(1.0 / rate, requests)
    top = context - new_tokens
    lengths = np.exp(rng.uniform(np.log(shortest), np.log(top), requests)).astype(int)
    return [Arrival(float(at), rng.integers(1, vocab, n).astype(np.int32), new_tokens)
            for at, n in zip(np.cumsum(gaps) - gaps[0], lengths)]


def replay(arrivals: list[Arrival], submit, step, busy) -> None:
    """Feed arrivals in real time: submit(index, arrival) once due, step() while busy(), sleep when idle."""
    pending = deque(enumerate(arrivals))
    t0 = time.perf_counter()
    while pending or busy():
        now = time.perf_counter() - t0
        while pending and pending[0][1].at <= now:
            submit(*pending.popleft())
        if busy():
            step(t0)
        elif pending:
            time.sleep(max(0.0, pending[0][1].at - (time.perf_counter() - t0)))


def run_continuous(engine, arrivals: list[Arrival]) -> Trace:
    from glm_jax.decoding.engine import Request

    times: list[list[float]] = [[] for _ in arrivals]
    index: dict[int, int] = {}
    engine.step_times.clear()

    def submit(i, a):
        index[engine.submit(Request(a.prompt, a.new_tokens))] = i

    def step(t0):
        for event in engine.step():
            if event.error:
                raise RuntimeError(event.error)
            times[index[event.request_id]] += [time.perf_counter() - t0] * len(event.tokens)

    replay(arrivals, submit, step, engine.has_work)
    full = [t.step_s for t in engine.step_times if t.rows == engine.batch]
    return Trace([a.at for a in arrivals], times, [t.host_s for t in engine.step_times], full,
                 [t.cpu_s for t in engine.step_times])


class WaveServer:
    """The baseline: the serving engine as it was before continuous batching (static waves)."""

    def __init__(self, model, *, slots: int, num_pages: int, page_size: int, max_context: int, prefill_chunk: int,
                 kv_cache_dtype: str = "auto"):
        from glm_jax.cache import PagePool
        from glm_jax.decoding.runtime import DecodeRuntime

        self.gen = DecodeRuntime(model, batch=slots, max_len=max_context, prefill_chunk=prefill_chunk,
                                kv_cache_dtype=kv_cache_dtype)
        self.pool = PagePool(model.cfg, num_pages=num_pages, page_size=page_size, dtype=self.gen.cache_dtype)
        self.cache_layout = self.gen.cache_layout
        self.width = self.pool.pages_for(max_context + prefill_chunk)
        self.cache = self.pool.create_cache(slots, self.width)
        self.queue: deque = deque()
        self.host_s: list[float] = []

    def busy(self) -> bool:
        return bool(self.queue)

    def wave(self, on_tokens) -> None:
        """Admit a wave from the queue, run it to the end; on_tokens({index: token}) after each step."""
        import jax.numpy as jnp
        import numpy as np

        from glm_jax.decoding.generate import decode_block
        from glm_jax.decoding.sampling import GREEDY

        wave = []
        while self.queue and len(wave) < self.gen.batch:
            i, a = self.queue[0]
            if self.pool.free_pages() < self.pool.pages_for(len(a.prompt) + a.new_tokens):
                break
            self.queue.popleft()
            self.pool.allocate(i, len(a.prompt) + a.new_tokens)
            wave.append((i, a))
        ids = [i for i, _ in wave] + [None] * (self.gen.batch - len(wave))
        lengths = np.array([len(a.prompt) for _, a in wave] + [0] * (self.gen.batch - len(wave)), np.int32)
        padded = np.zeros((self.gen.batch, int(lengths.max())), np.int32)
        for b, (_, a) in enumerate(wave):
            padded[b, :len(a.prompt)] = a.prompt
        cache = dataclasses.replace(self.cache, lengths=jnp.zeros((self.gen.batch,), jnp.int32),
                                    page_table=jnp.asarray(self.pool.page_table(ids, self.width)))
        logits, _, cache, _ = self.gen.prefill(cache, padded, lengths)
        key, sampling = self.gen.sampling_args(0, GREEDY)
        left = [a.new_tokens for _, a in wave]
        while any(left):
            t0 = time.perf_counter()
            tokens, logits, cache, key = decode_block(self.gen.layout, self.gen.params, cache, logits, key,
                                                      sampling, self.gen.forward, 1)
            self.host_s.append(time.perf_counter() - t0)
            tokens = np.asarray(tokens)[:, 0]
            on_tokens({i: int(tokens[b]) for b, (i, _) in enumerate(wave) if left[b]})
            left = [max(n - 1, 0) for n in left]
        self.cache = cache
        for i, _ in wave:
            self.pool.release(i)


def run_waves(server: WaveServer, arrivals: list[Arrival]) -> Trace:
    times: list[list[float]] = [[] for _ in arrivals]
    server.host_s.clear()

    def step(t0):
        def on_tokens(emitted):
            now = time.perf_counter() - t0
            for i in emitted:
                times[i].append(now)
        server.wave(on_tokens)

    replay(arrivals, lambda i, a: server.queue.append((i, a)), step, server.busy)
    return Trace([a.at for a in arrivals], times, server.host_s, [])


def _next_rate(rates, throughput: float | None) -> float | None:
    try:
        return rates.send(throughput)
    except StopIteration:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few requests, small contexts (CPU)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="max-context values (default 32768 131072 1048576; smoke 256)")
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 64; smoke 6)")
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (default 4; smoke 20)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default 128; smoke 8)")
    ap.add_argument("--slots", type=int, default=None, help="batch slots (default 8; smoke 3)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default 2048; smoke 64")
    ap.add_argument("--step-token-budget", type=int, nargs="+", default=[], metavar="N",
                    help="also replay the continuous engine with each step token budget (rows 'continuous, budget N')")
    ap.add_argument("--pool-contexts", type=float, default=2.0,
                    help="pool size in max-context sequences (at least 1: the longest request must fit)")
    ap.add_argument("--patterns", nargs="+", default=["IndexShare", "all Full"], choices=["IndexShare", "all Full"],
                    help="layer patterns to serve (default both)")
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help="arrival rates to replay the continuous server at (default: --rate)")
    ap.add_argument("--sweep", action="store_true", help="double the rate from --rate until saturation")
    ap.add_argument("--max-rates", type=int, default=6, help="--sweep: at most this many rates")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: time to first token objective")
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput: mean time per output token objective")
    ap.add_argument("--ceiling-points", type=int, default=None,
                    help="prompt lengths timed alone for the device ceiling (default 8; smoke 3; 0: no device ceiling)")
    ap.add_argument("--mesh", default=None, metavar="SPEC",
                    help="serve on a device mesh (e.g. layer=2: the cache split by layers), continuous servers only")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "bf16", "fp8"],
                    help="the cache layouts to serve, each in turn (default auto: the model's dtype)")
    ap.add_argument("--cache-memory-fraction", type=float, default=None, metavar="F",
                    help="every layout's pool: F of the device's free memory after the weights")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="N",
                    help="every layout's pool: N bytes (over --cache-memory-fraction; a CPU's way to give it)")
    ap.add_argument("--no-waves", action="store_true", help="leave out the static waves baseline")
    ap.add_argument("--config", default=None, help="serve this config's model (8 layers; default: GLM-5.2's "
                                                   "attention at 8 layers)")
    ap.add_argument("--min-prompt", type=int, default=16, help="shortest prompt drawn (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="write the rows here (JSON)")
    args = ap.parse_args()
    smoke = args.smoke
    if smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    pick = lambda value, full, tiny: value if value is not None else (tiny if smoke else full)  # noqa: E731
    contexts = pick(args.contexts, [32768, 131072, 1048576], [256])
    requests, rate = pick(args.requests, 64, 6), pick(args.rate, 4.0, 20.0)
    new_tokens, slots = pick(args.new_tokens, 128, 8), pick(args.slots, 8, 3)
    chunk = pick(args.prefill_chunk, 2048, 64)
    ceiling_points = pick(args.ceiling_points, 8, 3)
    if args.pool_contexts < 1:
        sys.exit("--pool-contexts must be >= 1: the longest request must fit the pool")
    if not 1 <= args.min_prompt <= min(contexts) - new_tokens:
        sys.exit(f"--min-prompt must be in 1..{min(contexts) - new_tokens} (max context - new tokens)")
    if args.cache_memory_fraction is not None and not 0 < args.cache_memory_fraction <= 1:
        sys.exit("--cache-memory-fraction must be in (0, 1]")
    layouts = list(dict.fromkeys(args.kv_cache_dtype))

    import functools

    import jax
    import numpy as np
    from flax import nnx

    from benchmarks._serving_model import PATTERNS, model_config
    from glm_jax.decoding.engine import ServingEngine, budget_chunk
    from glm_jax.model import GLMModel
    from glm_jax.sharding import make_mesh

    mesh = None if args.mesh is None else make_mesh(args.mesh)
    shards = 1 if mesh is None else mesh.shape.get("data", 1)

    budgets = []
    for n in args.step_token_budget:
        try:
            small = budget_chunk(n, slots=slots, rows=1, page_size=args.page_size, prefill_chunk=chunk)
        except ValueError as e:
            sys.exit(f"--step-token-budget {n}: {e}")
        budgets.append(f"{n} (prefill chunk {small} while requests decode)")
    budget = ", ".join(budgets) or "none"

    print(f"device {jax.devices()[0].device_kind}; {requests} requests at {rate}/s, {new_tokens} new tokens each, "
          f"{slots} slots, pages of {args.page_size}, prefill chunk {chunk}, pool {args.pool_contexts} x max context, "
          f"step token budgets {budget}; KV cache {', '.join(layouts)}; "
          f"patterns {', '.join(f'{n} {PATTERNS[n]}' for n in args.patterns)}")
    slo = Objective(args.slo_ttft_ms, args.slo_tpot_ms)
    print(f"goodput objective: TTFT <= {slo.ttft_ms:.0f} ms, mean time per output token <= {slo.tpot_ms:.0f} ms")
    print("| max context | pattern | server | rate /s | tokens/s | goodput tokens/s | device ceiling tokens/s | "
          "decode ceiling tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | host ms/step (wall / CPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []

    def save():             # after every row, so a run cut short keeps what it measured
        write_json(args.out, dict(requests=requests, rate=rate, new_tokens=new_tokens, slots=slots,
                                  page_size=args.page_size, prefill_chunk=chunk,
                                  step_token_budget=args.step_token_budget, smoke=smoke, device=device_kind(),
                                  config=args.config, kv_cache_dtype=layouts, cache_bytes=cache_bytes, rows=rows))

    cache_bytes, measured = args.kv_cache_memory_bytes, False
    for context in contexts:
        vocab = model_config(PATTERNS["IndexShare"], smoke, args.config).vocab_size
        arrivals = workload(np.random.default_rng([args.seed, context]), requests=requests, rate=rate,
                            context=context, new_tokens=new_tokens, vocab=vocab, shortest=args.min_prompt)
        for pattern_name, layout in ((p, kv) for p in args.patterns for kv in layouts):
            model = GLMModel(model_config(PATTERNS[pattern_name], smoke, args.config), rngs=nnx.Rngs(0))
            if not measured:                  # once, the first model's weights placed: every layout's bytes
                cache_bytes, measured = cache_budget(args.cache_memory_fraction, cache_bytes), True
            shape = dict(slots=slots, page_size=args.page_size, max_context=context, prefill_chunk=chunk,
                         kv_cache_dtype=layout)
            # Compiles every program: the second request prefills while the first decodes (budget's chunk).
            warm = [dataclasses.replace(arrivals[0], at=0.0, new_tokens=2),
                    dataclasses.replace(arrivals[0], at=0.0, prompt=arrivals[0].prompt[:8], new_tokens=2)]
            engine = ServingEngine if mesh is None else functools.partial(ServingEngine, mesh=mesh)
            where = "" if mesh is None else f" ({args.mesh})"
            servers = [(f"continuous{where}", engine, run_continuous)]
            servers += [(f"continuous, budget {n}{where}", functools.partial(engine, step_token_budget=n),
                         run_continuous) for n in args.step_token_budget]
            if mesh is None and not args.no_waves:    # the baseline, on one device
                servers.append(("static waves", WaveServer, run_waves))
            for base_name, build, run in servers:    # one at a time: one pool in device memory
                name = layout_server(base_name, layout, layouts)
                fields = dict(kv_cache_dtype=layout)
                try:
                    pages = pool_size(model.cfg, context=context, page_size=args.page_size, kv_cache_dtype=layout,
                                      budget=cache_bytes, pool_contexts=args.pool_contexts, shards=shards)
                    server = build(model, num_pages=pages, **shape)
                    fields.update(layout=server.cache_layout, **capacity(server.pool, context))
                    run(server, warm)                                          # compile
                except (jax.errors.JaxRuntimeError, ValueError) as e:          # out of memory, a refused layout
                    server = None
                    rows.append(failed_row(context, pattern_name, name, rate, e, **fields))
                    save()
                    continue
                profile = None
                if run is run_continuous and ceiling_points:
                    try:
                        profile = prefill_profile(server, arrivals, ceiling_points)
                    except jax.errors.JaxRuntimeError as e:
                        print(f"device ceiling n/a: prefill profile failed: {failure(e)}", flush=True)

                def replay_at(at, **extra):
                    row = dict(context=context, pattern=pattern_name, server=name, rate=at, **fields, **extra)
                    try:
                        trace = run(server, at_rate(arrivals, rate, at))
                        row.update(trace.metrics(slots, slo), preemptions=getattr(server, "preemptions", 0),
                                   **decode_rate(server))
                        if profile is not None:
                            row["device_ceiling_tokens_s"] = device_ceiling(
                                arrivals, profile, row["decode_step_ms"] / 1e3, slots)
                            row["prefill_profile"] = dict(zip(("lengths", "seconds"), profile))
                        print_row(row)
                    except jax.errors.JaxRuntimeError as e:
                        row = failed_row(context, pattern_name, name, at, e, **fields, **extra)
                    rows.append(row)
                    save()
                    return row

                rates = sweep_rates(rate, given=args.rates, sweep=args.sweep, most=args.max_rates)
                at = next(rates)
                while at is not None:
                    row = replay_at(at)
                    if run is run_waves or "error" in row:
                        break                                 # the baseline runs at the first rate only
                    at = _next_rate(rates, row["throughput"])
                if run is run_continuous:
                    print_saturation(rows, context, pattern_name, name)
                    best = saturation_row(rows, context, pattern_name, name)
                    if args.sweep and best is not None:
                        at = 0.8 * best["throughput"] / new_tokens
                        row = replay_at(at, load="80% of saturation")
                        if "error" not in row:
                            print(f"80% of saturation, {context} {pattern_name} {name}: {row['throughput']:.1f} "
                                  f"tokens/s at {at:.3g}/s; ITL p50 {row['itl_p50_ms']:.1f} ms, p99 "
                                  f"{row['itl_p99_ms']:.1f} ms ({row['itl_p99_ms'] / row['itl_p50_ms']:.1f}x p50; "
                                  f"target <= 3x)", flush=True)
                server = None
                if layout == layouts[-1]:
                    print_ratios(rows, context=context, pattern=pattern_name, server=base_name, layouts=layouts)
            del model


if __name__ == "__main__":
    main()
