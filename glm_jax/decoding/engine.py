"""A serving engine with continuous batching: requests join and leave at every decode step,
sharing a fixed number of batch slots and a pool of cache pages.

    engine = ServingEngine(model, slots=4, num_pages=64, page_size=16, max_context=512)
    rid = engine.submit(Request(prompt_ids, max_new_tokens=32, sampling=SamplingParams(0.7), seed=1))
    while engine.has_work():
        for event in engine.step(): ...        # Event(request_id, tokens since the last event, finished, error)
    engine.cancel(rid)                         # frees its slot and pages at the next step
    results = engine.serve([Request(...), ...])   # the same loop, collected per request

One `step()`:
1. drops cancelled requests (their slot and pages are free at once);
2. admits waiting requests, oldest first, into free slots while the pool has pages for the
   prompt and its first token; a request that does not fit now waits (nothing behind it
   overtakes it);
3. runs one prefill chunk of the oldest request still prefilling, one per data shard
   (`prefill_chunk` tokens, or `decode_chunk` while some slot decodes under a step token
   budget); a request whose last chunk ran joins the decoding slots in this same step;
4. dispatches one decode call for every decoding slot: one decode step, or a block of
   `decode_steps` steps (see below);
5. reads back the tokens of the decode call dispatched by the previous `step()` and turns them
   into events; finished requests free their slot and pages.

Blocks of decode steps. Each jitted call costs the host a launch that does not shrink with the
work it launches, so with `decode_steps` N > 1 a call runs up to N decode steps (`engine_programs`'
`decode`, one program per block size: 1 and N), dividing that cost by N. A block runs only in a
step that prefills nothing, in which no waiting request could be admitted and in which some
drawing request has N or more tokens left; otherwise the step is a single step as without
blocks. So a request arriving while a block is in flight waits for it: its first token comes up
to one block later. Inside a block each slot runs only the steps its request has tokens left
for (max_new_tokens), so it never writes a row past the pages the pool gives that request; a
stop token ends the request mid-block and the tokens after it are discarded. N is at most
page_size, so a block's rows cross at most one page boundary and the block installs at most
one new page per slot. Tokens, sampling streams and log-probabilities are those of single steps.

Two programs, alternated, under an optional token budget. Prefill chunks and decode steps are
separate jitted calls (`engine_programs`): a "mixed" program would have to give every slot room
for a whole chunk, doing C times the work of a decode step on each step, or have one shape per
mix of chunk and decode rows. Alternating keeps a fixed set of compiled programs for any mix of
requests and contexts: one decode program (slots x table width) and one prefill program per
chunk size (prefill rows x chunk), of which there are at most two:
* without a budget (`step_token_budget=None`), every prefill call runs `prefill_chunk` tokens
  per row, so a long prompt delays the others' next token by one chunk per step, never by its
  whole prefill;
* with a budget N, a step that starts with some slot decoding (its prompt prefilled, tokens
  left to draw) runs `decode_chunk` tokens per row: the largest multiple of page_size with
  rows x decode_chunk <= N - slots, at most `prefill_chunk` (`budget_chunk`). The step's
  prefill tokens plus its decode tokens are then at most N, however many slots decode, so the
  decoding slots' inter-token latency is bounded by one decode step plus N - slots prefill
  tokens; a long prompt takes more steps to prefill, so its time to first token grows. A step
  with no slot decoding prefills a whole `prefill_chunk` (the budget protects decoding slots
  only). The kernels take any chunk length (they pad the queries to their own blocks); whole
  pages keep the chunk starts page-aligned when `prefill_chunk` is a multiple of the page too.
  N below slots + rows x page_size leaves no page of prefill beside a full decode batch and is
  refused.

Pages on demand. A request gets pages for its prompt when it is admitted and one more page
each time its sequence crosses into a new page; all of them go back as soon as it finishes or
is cancelled. When a decoding request needs a page and none is free, the engine first waits for
the step in flight (finished requests may free pages), then preempts the youngest request in
that data shard (it may be the one asking): its pages are freed and it goes back to the head of
the queue with its emitted tokens appended to its prompt, so it is recomputed later and
continues its output and its sampling stream where it stopped. A request that could never run
(prompt + max_new_tokens over max_context, or more pages than the whole pool) fails alone: an
Event with `error` naming the memory it needs, while the others go on.

Host/device overlap. Sampled tokens stay on the device: each slot's logits live in the slot
state and the next decode step draws from them. Step n+1 is dispatched before step n's tokens
are read, so the host's scheduling of n+1 overlaps the device's work on n. A stop token is
noticed one call late; the tokens the slot drew in that extra call are discarded (max_new_tokens
is known ahead, so it costs no extra step). Per request, token i is drawn with the key
fold_in(key(seed), i), so a request's output does not depend on its batch companions or on
preemption. `step_times` holds a StepTime per decode call: host time is the engine step's wall
time minus the time blocked waiting for the device; `steps` the decode steps the call ran (host
time per decoded step: host_s / steps); `prefill` the prompt tokens prefilled beside it.

Log-probabilities. A request with `logprobs=k` (0..MAX_LOGPROBS) gets, with each token of its
events, the token's log-probability and the k most likely tokens' (`TokenLogprob`): the model's
own distribution, log_softmax of the raw logits before temperature and the sampling filters.
They come out of the same decode program that draws the token (`slots.Scores`, always
computed at the static size MAX_LOGPROBS), packed with the drawn tokens in the one array a
decode call reads back (`engine_programs.pack_draws`). With `prompt_logprobs` too, the
request's first event carries its prompt tokens' log-probabilities (from the second token on),
from the prefill given the next prompt tokens as `targets` (it then scores each chunk
position; only for the chunks of such requests; a request recomputed after a preemption is
not scored again).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Iterator

import jax
import numpy as np

from glm_jax.cache import CacheFullError, PagePool, shard_cache
from glm_jax.decoding.engine_programs import OutputShardings, drawn_scores, drawn_tokens, engine_programs
from glm_jax.decoding.engine_requests import (Event, Launched, Request, Result, Run, ScoredChunk, StepTime,
                                              TokenLogprob, checked_prompt, merged_events, record_prompt_scores,
                                              scores_to_host, token_logprob)
from glm_jax.decoding.prefill import PrefillRows
from glm_jax.decoding.runtime import ContextTooLongError, DecodeRuntime, DecodeStats, committed, cut
from glm_jax.decoding.sampling import GREEDY, SamplingParams
from glm_jax.decoding.slots import Scores, empty_slots
from glm_jax.forward_options import ForwardOptions
from glm_jax.multihost import to_host
from glm_jax.sharding import logical_sharding

__all__ = ["Event", "Request", "Result", "ServingEngine", "StepTime", "TokenLogprob", "budget_chunk"]


class ServingEngine(DecodeRuntime):
    """Continuous batching over a page pool (see the module docstring).

    slots: sequences decoded together; num_pages x page_size: the pool (page 0 of each data
    shard is scratch); max_context: the longest prompt + max_new_tokens of one request;
    prefill_chunk: prompt tokens per prefill row and call; step_token_budget: the most tokens
    (prefill + decode) of a step in which some slot decodes (None: no limit; `budget_chunk`);
    forward / mesh / collective as for the Generator (slots split over the mesh's `data` axis,
    pages too); cuda_graphs: on a GPU, compile the programs to replay as CUDA graphs, loops and
    conditionals included (`programs.compiler_options`: the host launches a step as a
    few graphs instead of kernel by kernel); decode_steps: the most decode steps one call runs
    (1..page_size; blocks, see the module docstring); kv_cache_dtype: the pool's rows, "auto"
    (the model's dtype), "bf16" or "fp8" (`DecodeRuntime`; `pool.describe()` names it)."""

    def __init__(self, model, *, slots: int, num_pages: int, page_size: int, max_context: int,
                 prefill_chunk: int = 64, step_token_budget: int | None = None,
                 forward: ForwardOptions = ForwardOptions(), mesh=None, collective: str = "permute",
                 cuda_graphs: bool = True, decode_steps: int = 1, kv_cache_dtype: str = "auto"):
        if isinstance(decode_steps, bool) or not isinstance(decode_steps, (int, np.integer)) \
                or not 1 <= decode_steps <= page_size:
            raise ValueError(f"decode_steps must be an integer from 1 to the page size {page_size} (a block of "
                             f"steps crosses at most one page boundary), got {decode_steps!r}")
        super().__init__(model, batch=slots, max_len=max_context, prefill_chunk=prefill_chunk, forward=forward,
                         mesh=mesh, collective=collective, cuda_graphs=cuda_graphs, kv_cache_dtype=kv_cache_dtype)
        shards = 1 if mesh is None else mesh.shape.get("data", 1)
        self.pool = PagePool(self.cfg, num_pages=num_pages, page_size=page_size, data_shards=shards,
                             dtype=self.cache_dtype)
        self.step_token_budget = step_token_budget
        self.decode_steps = int(decode_steps)
        # The prefill chunk of a step in which some slot decodes (prefill_chunk without a budget).
        self.decode_chunk = budget_chunk(step_token_budget, slots=slots, rows=shards, page_size=page_size,
                                         prefill_chunk=prefill_chunk)
        # Room in every row's table for its longest context plus the padding of a prefill chunk.
        self.width = self.pool.pages_for(max_context + prefill_chunk)
        cache = self.pool.create_cache(slots, self.width, self.split)
        self.cache = committed(cache) if mesh is None else shard_cache(cache, mesh)   # as the programs return it
        # Rows split over `data` as the programs return them (the same placement on every call).
        self.slot_state = jax.tree.map(lambda x: self.put(np.asarray(x), ("batch",) + (None,) * (x.ndim - 1)),
                                       empty_slots(slots, self.cfg.vocab_size))
        outputs = None if mesh is None else OutputShardings.of(
            self.cache, self.slot_state, logical_sharding(mesh, ("batch",), (slots,), "tokens"))
        self.programs = engine_programs(self.layout, self.forward, shards, outputs, self.options)
        # In one process every array is whole here: np.asarray skips to_host's check on each read-back.
        self._to_host = np.asarray if jax.process_count() == 1 else to_host
        self.step_times: list[StepTime] = []
        self.stats = DecodeStats()                  # of the last `serve`
        self.preemptions = 0                        # requests preempted so far (recomputed later)
        self._slots: list[Run | None] = [None] * slots
        self._waiting: deque[Run] = deque()
        self._runs: dict[int, Run] = {}            # every request not yet finished
        self._events: list[Event] = []              # this step's events (errors from submit wait here)
        self._cancelled: set[int] = set()
        self._in_flight: Launched | None = None
        self._scored_chunks: list[ScoredChunk] = []  # read back with the next decode call
        self._control = None                        # (the last control's rows, it on the device): `_control_for`
        self._next_id = 0
        self._admissions = 0
        self._waited = 0.0

    # ------------------------------------------------------------------ the public API
    def submit(self, request: Request) -> int:
        """Queue a request -> its id. Never raises for a bad request: its error arrives as an Event."""
        rid, self._next_id = self._next_id, self._next_id + 1
        try:
            prompt = self._checked_prompt(rid, request)
        except (ValueError, TypeError, CacheFullError) as e:
            self._events.append(Event(rid, [], True, str(e)))
            return rid
        run = Run(rid, request, prompt)
        self._runs[rid] = run
        self._waiting.append(run)
        return rid

    def cancel(self, request_id: int) -> None:
        """Drop a request at the next step: its slot and pages are freed, no further events."""
        self._cancelled.add(request_id)

    def has_work(self) -> bool:
        return bool(self._runs or self._in_flight or self._events or self._cancelled)

    def step(self) -> list[Event]:
        """One scheduling step (see the module docstring) -> the events it produced."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self._waited = 0.0
        self._drop_cancelled()
        self._admit()
        prefilled = self._prefill_chunk()
        steps = self._call_steps(prefilled)
        launched, context = self._dispatch_decode(steps)
        self._drain()
        self._in_flight = launched
        if launched is not None:
            wall = time.perf_counter() - t0
            self.step_times.append(StepTime(context, wall - self._waited, wall, len(launched.runs), prefilled,
                                            time.thread_time() - cpu0, steps))
        events, self._events = self._events, []
        return merged_events(events)

    def serve(self, requests: list[Request], *, sampling: SamplingParams | None = None, seed: int = 0,
              stop_token: int | None = None) -> list[Result]:
        """Run `requests` to the end -> one Result each, in order. `sampling` / `stop_token`, when
        given, replace every request's own; `seed` is added to every request's seed. It steps
        the engine until idle: events of requests submitted elsewhere are dropped. `stats`: the
        run's DecodeStats (prefill and compilation inside decode_s: they interleave)."""
        t0 = time.perf_counter()
        ids = [self.submit(dataclasses.replace(
            r, sampling=r.sampling if sampling is None else sampling, seed=r.seed + seed,
            stop_token=r.stop_token if stop_token is None else stop_token)) for r in requests]
        results = {i: Result(tokens=[]) for i in ids}
        while self.has_work():
            for event in self.step():
                result = results.get(event.request_id)
                if result is None:                  # a request submitted outside this call
                    continue
                if event.error is not None:
                    result.tokens, result.error = None, event.error
                else:
                    result.tokens += event.tokens
        self.stats = DecodeStats(prompt_tokens=sum(len(r.prompt) for r in requests), decode_s=time.perf_counter() - t0,
                                 new_tokens=sum(len(r.tokens or []) for r in results.values()))
        return [results[i] for i in ids]

    def completions(self, prompts, *, max_new_tokens: int, sampling: SamplingParams = GREEDY, seed: int = 0,
                    stop_token: int | None = None, progress=None) -> Iterator[list[list[int]]]:
        """Every prompt (int [P_i]) a request, prompt i's sampling stream seeded seed + i (so its
        tokens do not depend on its batch companions), served to the end -> yields their new
        tokens once, cut before the stop token. progress: not called (prefill and decode interleave)."""
        results = self.serve([Request(np.asarray(row, np.int32), max_new_tokens, sampling, stop_token, seed + i)
                              for i, row in enumerate(prompts)])
        failed = [f"prompt {i}: {r.error}" for i, r in enumerate(results) if r.error is not None]
        if failed:
            raise ValueError("; ".join(failed))
        yield [r.tokens for r in results]

    # ------------------------------------------------------------------ scheduling
    def _checked_prompt(self, rid: int, request: Request) -> np.ndarray:
        prompt = checked_prompt(rid, request, self.cfg.vocab_size)
        rows = len(prompt) + int(request.max_new_tokens)
        try:
            self.check_fits(len(prompt), int(request.max_new_tokens))
        except ContextTooLongError as e:
            raise ContextTooLongError(f"request {rid}: {e} (it would need {self.pool.memory_for(rows)})") from None
        self.pool.check_fits_ever(rid, rows)
        return prompt

    def _shard(self, slot: int) -> int:
        return slot * self.pool.data_shards // self.batch

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for rid in sorted(self._cancelled):
            run = self._runs.get(rid)
            if run is None:
                continue
            if run.slot is None:
                self._waiting.remove(run)
            self._retire(run)
        self._cancelled.clear()

    def _retire(self, run: Run) -> None:
        """The request is finished or cancelled: free its slot and pages now (device work already
        dispatched on them runs before anything dispatched later)."""
        run.gone = True
        self.pool.release(run.id)
        if run.slot is not None:
            self._slots[run.slot] = None
            run.slot = None
        del self._runs[run.id]

    def _admit(self) -> None:
        """Waiting requests into free slots, oldest first, while the pool has pages for each one's
        context and first token."""
        while self._waiting:
            run = self._waiting[0]
            rows = len(run.context) + 1
            free = [b for b, r in enumerate(self._slots) if r is None
                    and self.pool.free_pages(self._shard(b)) >= self.pool.pages_for(rows)]
            if not free:
                return
            slot = max(free, key=lambda b: self.pool.free_pages(self._shard(b)))
            self._waiting.popleft()
            self.pool.grow(run.id, rows, self._shard(slot))
            self._admissions += 1
            run.slot, run.order, run.prefilled, run.length = slot, self._admissions, 0, 0
            run.drawn, run.stopped = len(run.emitted), False
            self._slots[slot] = run

    def _chunk(self) -> int:
        """This step's prefill chunk: decode_chunk while some slot decodes, else prefill_chunk."""
        decoding = any(run is not None and run.draws for run in self._slots)
        return self.decode_chunk if decoding else self.prefill_chunk

    def _prefill_chunk(self) -> int:
        """One chunk for the oldest prefilling request of each data shard (one jitted call)
        -> the prompt tokens it prefilled (0: none)."""
        shards = self.pool.data_shards
        chosen: list[Run | None] = [None] * shards
        for run in self._slots:
            if run is not None and not run.decoding:
                s = self._shard(run.slot)
                if chosen[s] is None or run.order < chosen[s].order:
                    chosen[s] = run
        if not any(chosen):
            return 0
        c = self._chunk()
        rows = np.full((shards,), self.batch, np.int32)
        starts, num_valid, drawn = (np.zeros((shards,), np.int32) for _ in range(3))
        seeds = np.zeros((shards,), np.uint32)
        tokens, targets = np.zeros((shards, c), np.int32), np.zeros((shards, c), np.int32)
        scored = []
        for s, run in enumerate(chosen):
            if run is None:
                continue
            start = run.prefilled
            piece = run.context[start:start + c]
            tokens[s, :len(piece)] = piece
            rows[s], starts[s], num_valid[s] = run.slot, start, len(piece)
            seeds[s], drawn[s] = run.request.seed % 2**32, run.drawn
            if run.wants_prompt_scores(start + len(piece)):
                following = run.context[start + 1:start + 1 + c]
                targets[s, :len(following)] = following
                scored.append((s, run, start, len(piece)))
                run.scored = min(start + len(piece), len(run.request.prompt) - 1)
            run.prefilled += len(piece)
            run.length = run.prefilled
            run.synced_pages = len(self.pool.held.get(run.id, []))
        tables = self.pool.page_table([None if r is None else r.id for r in chosen], self.width)
        sampling = SamplingParams.stack([GREEDY if r is None else r.request.sampling for r in chosen])
        batch, row = ("batch", None), ("batch",)
        prefilled = int(num_valid.sum())
        values = [rows, tables, starts, tokens, num_valid, seeds, drawn, sampling, targets if scored else None]
        names = [row, batch, row, batch, row, row, row, row, batch]
        rows, tables, starts, tokens, num_valid, seeds, drawn, sampling, targets = self.call_inputs(values, names)
        _, _, self.cache, _, self.slot_state, scores = self.programs.prefill(
            self.layout, self.params, self.cache, tokens, num_valid, self.forward,
            rows=PrefillRows(rows, tables, starts), slots=self.slot_state, slot_inputs=(seeds, drawn, sampling),
            targets=targets)
        if scored:
            for x in scores:
                x.copy_to_host_async()
            self._scored_chunks.append(ScoredChunk(scores, scored))
        return prefilled

    def _call_steps(self, prefilled: int) -> int:
        """The decode steps of this step's call: a block of decode_steps when the step prefilled
        nothing, no waiting request could be admitted at the next step (`_admit` left it waiting,
        and no slot frees at this step's read-back: every decoding request still draws) and some
        drawing request has that many tokens left; else 1."""
        n = self.decode_steps
        drawing = [run for run in self._slots if run is not None and run.draws]
        if n == 1 or prefilled or (self._waiting and len(drawing) < sum(run is not None for run in self._slots)):
            return 1
        return n if any(run.steps_in(n) == n for run in drawing) else 1

    def _dispatch_decode(self, steps: int) -> tuple[Launched | None, int]:
        """Dispatch one call of `steps` decode steps for every drawing slot (each runs
        `Run.steps_in` of them) -> (what to read back, longest context before the call), or
        (None, 0) when no slot draws."""
        runs = self._grow_pages(steps)
        if not runs:
            return None, 0
        newest = []                  # (slot, steps, table column, page id of its newest page) of each drawing slot
        context, logprobs = 0, False
        for b, run, own_steps in runs:
            held = self.pool.held[run.id]
            if len(held) > run.synced_pages:             # a new page (at most one: steps <= page_size): installed
                run.synced_pages += 1
            newest.append((b, own_steps, run.synced_pages - 1, held[run.synced_pages - 1]))
            context = max(context, run.length)
            logprobs = logprobs or run.request.logprobs is not None
            run.length += own_steps
            run.drawn += own_steps
        control = self._control_for(newest)
        draws, self.cache, self.slot_state = self.programs.decode(self.params, self.cache, self.slot_state, control,
                                                                  steps=steps)
        draws.copy_to_host_async()                       # read back by the next step without a transfer wait
        launched = Launched(draws, runs, logprobs, self._scored_chunks)
        self._scored_chunks = []
        return launched, context

    def _control_for(self, newest: list[tuple[int, int, int, int]]) -> jax.Array:
        """The decode call's control int32 [B, 3] on the device (`engine_programs`: steps, table
        column, page id per slot) from (slot, steps, table column, page id) of each drawing slot's
        newest page. A page already in the table is written again unchanged, so the control
        changes (and is built and sent) only when a slot gets a page, the drawing slots change or
        a slot runs fewer steps than the call."""
        key = tuple(newest)
        if self._control is None or self._control[0] != key:
            control = np.zeros((self.batch, 3), np.int32)
            control[:, 1] = self.width                   # idle slots: no page
            for b, steps, column, page in newest:
                control[b] = steps, column, page
            self._control = key, self.put(control, ("batch", None))
        return self._control[1]

    def _grow_pages(self, steps: int) -> list[tuple[int, Run, int]]:
        """Give every drawing slot the pages of its rows in a call of `steps` decode steps (the page
        its last row lands in); when the pool is short, wait for the call in flight, then preempt
        the youngest request of that data shard. -> (slot, run, its steps in the call) of every
        drawing slot, in slot order."""
        while True:
            runs = [(b, r, r.steps_in(steps)) for b, r in enumerate(self._slots) if r is not None and r.draws]
            short = [(r, n) for _, r, n in runs if self.pool.pages_for(r.length + n) > len(self.pool.held[r.id])]
            if not short:
                return runs
            run, own_steps = min(short, key=lambda rn: rn[0].order)
            shard = self._shard(run.slot)
            try:
                self.pool.grow(run.id, run.length + own_steps, shard)
            except CacheFullError:
                if self._in_flight is not None:
                    self._drain()
                    continue
                self._preempt(max((r for r in self._slots if r is not None and self._shard(r.slot) == shard),
                                  key=lambda r: r.order))

    def _preempt(self, run: Run) -> None:
        """Free the request's slot and pages and queue it first, to be recomputed from its prompt
        and the tokens it emitted (no step is in flight here)."""
        self.preemptions += 1
        self.pool.release(run.id)
        self._slots[run.slot] = None
        run.slot = None
        run.context = np.concatenate([np.asarray(run.request.prompt, np.int32), np.asarray(run.emitted, np.int32)])
        self._waiting.appendleft(run)

    def _drain(self) -> None:
        """Read back the tokens of the call in flight (and the log-probs asked for) and turn them
        into events."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return
        t0 = time.perf_counter()
        launched.draws.block_until_ready()
        self._waited += time.perf_counter() - t0
        draws = self._to_host(launched.draws)
        tokens = drawn_tokens(draws)
        scores = drawn_scores(draws) if launched.logprobs else None
        for chunk in launched.scored_chunks:
            record_prompt_scores(scores_to_host(chunk.scores), chunk.rows)
        for b, run, steps in launched.runs:
            if not (run.gone or run.stopped):
                self._emit(run, tokens[b][:steps], scores, b)

    def _emit(self, run: Run, tokens: list[int], scores: Scores | None, slot: int) -> None:
        """The event of the tokens `run` drew in `slot` in one call, in order (host `scores`
        [B, S] of the call's draws, if a drawing request asked for log-probs), cut before its
        stop token; retires the run when it is done (its stop token, or max_new_tokens reached)."""
        request = run.request
        prompt_scores = list(run.prompt_scores) if request.prompt_logprobs and not run.emitted else None
        kept = cut(tokens, request.stop_token)
        run.stopped = len(kept) < len(tokens)
        tokens = kept
        run.emitted += tokens
        finished = run.stopped or len(run.emitted) >= request.max_new_tokens
        logprobs = None if request.logprobs is None else \
            [token_logprob(scores, (slot, i), request.logprobs) for i in range(len(tokens))]
        self._events.append(Event(run.id, tokens, finished, logprobs=logprobs, prompt_logprobs=prompt_scores))
        if finished:
            self._retire(run)


def budget_chunk(budget: int | None, *, slots: int, rows: int, page_size: int, prefill_chunk: int) -> int:
    """The prefill chunk (tokens per prefill row) of a step in which some of the `slots` decode,
    with `rows` prefill rows (one per data shard) and a step token budget: the largest multiple
    of page_size with rows x chunk <= budget - slots, at most prefill_chunk (prefill_chunk when
    budget is None). A budget that leaves no page per row beside a full decode batch is refused."""
    if budget is None:
        return prefill_chunk
    least = slots + rows * page_size
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < least:
        raise ValueError(f"the step token budget must be an integer >= {least} ({slots} decoding slots + one page of "
                         f"{page_size} prefill tokens per prefill row, {rows} row(s)), got {budget!r}")
    return min(prefill_chunk, (budget - slots) // rows // page_size * page_size)
