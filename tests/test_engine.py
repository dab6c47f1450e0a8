"""Serving engine with continuous batching: staggered arrivals, a request joining mid-decode,
chunked prefill beside decoding slots, preemption with requeue, waiting for pages, requests that
can never fit, cancel, per-request sampling streams, two programs for everything, flat host
time per step, blocks of decode steps giving the tokens of single steps.

Every engine here has the same shapes (3 slots, 13 pages of 8 rows, table width 16, chunk 8),
so the whole file compiles the two engine programs once (and, at its end, the decode program
of 4-step blocks and the batch-invariant programs). Greedy outputs are compared with one
batched run of the plain Generator (a greedy output of n tokens is a prefix of a longer one)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

import decode
from conftest import counting_compiles, micro_config
from glm_jax import ops
from glm_jax.decoding.engine import Request, ServingEngine
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.sampling import SamplingParams
from glm_jax.forward_options import ForwardOptions
from glm_jax.model import GLMModel

PROMPTS = [np.arange(3, 12), np.arange(20, 25), np.arange(40, 53), np.arange(60, 90) % 97]
LONGEST = 40                      # new tokens of the reference run


@pytest.fixture(scope="module")
def compiles():
    """Compilations per jitted function name while this file runs."""
    with counting_compiles() as counts:
        yield counts


@pytest.fixture(scope="module")
def model(compiles):
    return GLMModel(micro_config(max_position_embeddings=256), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """Each prompt's greedy continuation of LONGEST tokens from the plain Generator."""
    gen = Generator(model, batch=len(PROMPTS), max_len=120, prefill_chunk=8, block_size=8)
    out = np.concatenate(list(gen.generate(PROMPTS, max_new_tokens=LONGEST)), axis=1)
    return [row[:LONGEST].tolist() for row in out]


def new_engine(model, **settings) -> ServingEngine:
    """12 usable pages = 96 cache rows, max_context 120 (so a request can pass the context check
    and still need more pages than the pool has); settings: more of ServingEngine's."""
    return ServingEngine(model, slots=3, num_pages=13, page_size=8, max_context=120, prefill_chunk=8, **settings)


class Driver:
    """Steps an engine and logs (step number, event)."""

    def __init__(self, engine: ServingEngine):
        self.engine, self.log, self.steps = engine, [], 0

    def run(self, steps: int | None = None) -> None:
        """Step `steps` times, or until the engine is idle."""
        for _ in range(steps or 10**6):
            if not self.engine.has_work():
                return
            self.log += [(self.steps, e) for e in self.engine.step()]
            self.steps += 1

    def tokens(self, rid: int) -> list[int]:
        return [t for _, e in self.log if e.request_id == rid for t in e.tokens]

    def first_token_step(self, rid: int) -> int:
        return min(s for s, e in self.log if e.request_id == rid and e.tokens)


def assert_pool_full(engine: ServingEngine) -> None:
    assert not engine.pool.held and engine.pool.free_pages() == engine.pool.usable_pages


def test_staggered_arrivals_equal_each_request_decoded_alone(model, reference):
    engine = new_engine(model)
    run = Driver(engine)
    a = engine.submit(Request(PROMPTS[0], 12))
    b = engine.submit(Request(PROMPTS[1], 6))
    run.run(4)
    c = engine.submit(Request(PROMPTS[2], 8))             # joins while a and b decode
    run.run(3)
    d = engine.submit(Request(PROMPTS[3], 5))             # 30 tokens: 4 prefill chunks
    submitted_d = run.steps
    run.run()
    for rid, i, n in ((a, 0, 12), (b, 1, 6), (c, 2, 8), (d, 3, 5)):
        assert run.tokens(rid) == reference[i][:n], rid
    assert run.first_token_step(c) < max(s for s, e in run.log if e.request_id == a)   # a still decoding
    # d's chunks ran between decode steps of the others: tokens of a and c arrived meanwhile
    assert {e.request_id for s, e in run.log if submitted_d <= s < run.first_token_step(d) and e.tokens} >= {a, c}
    assert [e.finished for _, e in run.log if e.request_id == a] == [False] * 11 + [True]
    assert_pool_full(engine)


def test_preemption_requeues_and_gives_identical_greedy_output(model, reference):
    engine = new_engine(model)
    # 30 + 40 rows (9 pages) and 13 + 40 rows (7 pages) do not fit 12 pages together.
    ids = [engine.submit(Request(PROMPTS[3], 40)), engine.submit(Request(PROMPTS[2], 40))]
    run = Driver(engine)
    run.run()
    assert engine.preemptions >= 1
    assert run.tokens(ids[0]) == reference[3] and run.tokens(ids[1]) == reference[2]
    assert_pool_full(engine)


def test_request_waits_for_pages_while_a_slot_is_free(model, reference):
    engine = new_engine(model)
    run = Driver(engine)
    big = engine.submit(Request(np.arange(85), 5))               # 11 of the 12 pages from the start
    small = engine.submit(Request(PROMPTS[0], 6))                # needs 2 pages: waits
    run.run()
    assert run.first_token_step(small) > max(s for s, e in run.log if e.request_id == big)
    assert len(run.tokens(big)) == 5 and run.tokens(small) == reference[0][:6]
    assert_pool_full(engine)


def test_request_that_can_never_fit_fails_alone(model, reference):
    engine = new_engine(model)
    ok = engine.submit(Request(PROMPTS[0], 6))
    too_long = engine.submit(Request(np.arange(100) % 97, 30))     # 130 > max_context 120
    too_big = engine.submit(Request(np.arange(90), 10))            # 100 rows = 13 pages > 12
    empty = engine.submit(Request(np.zeros((0,), np.int32), 4))
    bad_id = engine.submit(Request(np.array([5, 97]), 4))
    run = Driver(engine)
    run.run()
    errors = {e.request_id: e.error for _, e in run.log if e.error}
    assert "exceeds the context of 120 tokens" in errors[too_long] and "17 pages" in errors[too_long]
    assert "MiB of KV cache" in errors[too_long]
    assert "needs 13 pages" in errors[too_big] and "MiB" in errors[too_big] and "whole pool" in errors[too_big]
    assert "empty" in errors[empty] and "token ids must be in [0, 97)" in errors[bad_id]
    assert all(e.finished and not e.tokens for _, e in run.log if e.error)
    assert run.tokens(ok) == reference[0][:6]
    assert_pool_full(engine)


def test_cancel_frees_the_slot_and_pages_whether_decoding_waiting_or_prefilling(model, reference):
    engine = new_engine(model)
    run = Driver(engine)
    ids = [engine.submit(Request(p, 30)) for p in PROMPTS]       # the fourth waits for a slot
    run.run(6)
    assert run.tokens(ids[1]) and not run.tokens(ids[3])
    engine.cancel(ids[1])                                        # decoding
    engine.cancel(ids[3])                                        # still waiting
    run.run(1)
    long = engine.submit(Request(PROMPTS[3], 4))                 # 4 prefill chunks
    run.run(2)
    assert long in engine.pool.held and not run.tokens(long)     # admitted, 2 of 4 chunks done
    engine.cancel(long)                                          # mid-prefill
    run.run()
    assert not [e for s, e in run.log if s >= 6 and e.request_id in (ids[1], ids[3], long)]
    assert run.tokens(ids[0]) == reference[0][:30] and run.tokens(ids[2]) == reference[2][:30]
    assert_pool_full(engine)


def test_per_request_sampling_does_not_depend_on_batch_companions(model):
    hot = Request(PROMPTS[0], 10, sampling=SamplingParams(temperature=1.5, top_k=20), seed=7)
    alone = new_engine(model).serve([hot])[0].tokens
    engine = new_engine(model)
    nucleus = Request(PROMPTS[2], 10, SamplingParams(0.7, top_p=0.5), seed=3)
    together = engine.serve([Request(PROMPTS[1], 12), hot, nucleus, hot])
    assert together[1].tokens == together[3].tokens == alone
    other_seed = new_engine(model).serve([Request(PROMPTS[0], 10, hot.sampling, seed=8)])[0].tokens
    assert other_seed != alone
    assert_pool_full(engine)


def test_stop_token_ends_a_request_and_the_extra_token_is_dropped(model, reference):
    stop = reference[0][3]
    engine = new_engine(model)
    out = engine.serve([Request(PROMPTS[0], 20, stop_token=stop), Request(PROMPTS[1], 8)])
    assert out[0].tokens == reference[0][:reference[0].index(stop)] and out[1].tokens == reference[1][:8]
    assert_pool_full(engine)


def test_two_programs_serve_every_mix_and_host_time_is_flat(model, compiles):
    engine = new_engine(model)
    engine.serve([Request(np.arange(1, 9), 88)])          # 8 + 88 = 96 rows: the whole pool
    # At most once each for the whole file (none if another file compiled these same programs); the
    # one prefill program twice: for the reference Generator's cache and for the engine's pool.
    assert compiles["jit(decode)"] <= 1 and compiles["jit(prefill_chunk)"] <= 2, compiles
    times = engine.step_times
    early = np.median([t.host_s for t in times[5:25]])
    late = np.median([t.host_s for t in times[-20:]])
    assert times[-1].context >= 90
    assert late < 3 * early + 1e-3, (early, late)


def test_cuda_graph_options_only_on_a_gpu_and_when_asked():
    """The serving programs ask XLA for CUDA graphs (loops and conditionals included) on a GPU
    only."""
    from glm_jax.decoding.programs import CUDA_GRAPH_OPTIONS, compiler_options

    assert compiler_options("gpu", True) == CUDA_GRAPH_OPTIONS
    assert compiler_options("gpu", False) == () and compiler_options("cpu", True) == ()
    assert "WHILE" in dict(CUDA_GRAPH_OPTIONS)["xla_gpu_enable_command_buffer"]


# Blocks of decode steps (decode_steps): the same events' tokens, finish flags and log-probs as
# single steps, with requests arriving between steps, waiting for a slot, preempted for pages,
# stopping mid-block and crossing pages inside a block. (The 4-step decode program compiles
# here, after the check of the two programs above.)
BLOCK = 4
HOT_BLOCK = SamplingParams(temperature=0.7)
# (step to submit at, request): three requests of different lengths start together, two more
# arrive while they decode and wait for a slot (the last is preempted for pages once it has one:
# 5 + 5 + 3 pages of the 12); max_new_tokens not multiples of BLOCK.
BLOCK_SCENARIO = [
    (0, Request(PROMPTS[0], 18)),
    (0, Request(PROMPTS[1], 11, HOT_BLOCK, seed=5, logprobs=2)),
    (0, Request(PROMPTS[2], 21, logprobs=3, prompt_logprobs=True)),
    (5, Request(PROMPTS[3], 9, HOT_BLOCK, seed=9)),
    (5, Request(PROMPTS[0], 10)),
]


def run_block_scenario(engine: ServingEngine, scenario) -> tuple[dict, list, int]:
    """Step the engine through `scenario` -> ({request index: its events}, per decode call
    (steps, cache lengths int32 [B] before it, control int32 [B, 3]), preemptions)."""
    calls = []
    decode = engine.programs.decode

    def recorded(params, cache, slots, control, steps):
        calls.append((steps, np.asarray(cache.lengths), np.asarray(control)))
        return decode(params, cache, slots, control, steps=steps)

    engine.programs = engine.programs._replace(decode=recorded)
    ids, events, step = {}, {}, 0
    while step <= max(at for at, _ in scenario) or engine.has_work():
        for i, (at, request) in enumerate(scenario):
            if at == step:
                ids[engine.submit(request)] = i
        for event in engine.step():
            events.setdefault(ids[event.request_id], []).append(event)
        step += 1
    assert_pool_full(engine)
    return events, calls, engine.preemptions


def joined(events) -> tuple[list[int], list | None, list | None, list[bool]]:
    """A request's events -> (its tokens, token log-probs, prompt log-probs, finished flags)."""
    logprobs = None if events[0].logprobs is None else [lp for e in events for lp in e.logprobs]
    return ([t for e in events for t in e.tokens], logprobs,
            next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None),
            [e.finished for e in events])


@pytest.fixture(scope="module")
def block_runs(model, reference) -> dict:
    """{decode_steps: run_block_scenario's output} for single steps and blocks of BLOCK, the
    first request stopping at the token it draws seventh."""
    stop = reference[0][6]
    assert stop not in reference[0][:6]
    scenario = [(0, dataclasses.replace(BLOCK_SCENARIO[0][1], stop_token=stop))] + BLOCK_SCENARIO[1:]
    return {n: run_block_scenario(new_engine(model, decode_steps=n), scenario) for n in (1, BLOCK)}


def test_blocks_give_the_tokens_of_single_steps(block_runs, reference):
    single, blocks = block_runs[1][0], block_runs[BLOCK][0]
    for i, (_, request) in enumerate(BLOCK_SCENARIO):
        tokens, _, _, finished = joined(blocks[i])
        assert tokens == joined(single[i])[0], i
        assert finished[-1] and not any(finished[:-1]), i
    assert joined(blocks[0])[0] == reference[0][:6]                     # cut before its stop token
    for i, prompt in ((2, 2), (4, 0)):                                  # greedy: the Generator's tokens
        assert joined(blocks[i])[0] == reference[prompt][:BLOCK_SCENARIO[i][1].max_new_tokens], i
    for i in (1, 3):                                                    # sampled: every token drawn
        assert len(joined(blocks[i])[0]) == BLOCK_SCENARIO[i][1].max_new_tokens, i


def test_blocks_give_the_logprobs_of_single_steps(block_runs):
    for i in (1, 2):
        _, logprobs, prompt_logprobs, _ = joined(block_runs[BLOCK][0][i])
        _, want, want_prompt, _ = joined(block_runs[1][0][i])
        assert len(logprobs) == BLOCK_SCENARIO[i][1].max_new_tokens and logprobs == want, i
        assert len(want[0].top) == BLOCK_SCENARIO[i][1].logprobs
        assert prompt_logprobs == want_prompt, i
    assert len(joined(block_runs[BLOCK][0][2])[2]) == len(PROMPTS[2]) - 1


def test_blocks_run_and_cross_pages_inside(block_runs):
    """Blocks ran (so the equalities above are not vacuous), one with a slot whose rows cross into
    a new page mid-block, one with a slot running fewer steps than the block, single steps where
    a prefill chunk ran beside; a request was preempted and recomputed."""
    assert all(steps == 1 for steps, _, _ in block_runs[1][1])
    _, calls, preemptions = block_runs[BLOCK]
    assert preemptions >= 1
    blocks = [(lengths, control) for steps, lengths, control in calls if steps == BLOCK]
    assert len(blocks) >= 3 and any(steps == 1 for steps, _, _ in calls)
    crossing = [(b, lengths[b]) for lengths, control in blocks for b in range(len(lengths))
                if control[b, 0] > 1 and lengths[b] // 8 != (lengths[b] + control[b, 0] - 1) // 8
                and lengths[b] % 8]
    assert crossing
    assert any(0 < control[b, 0] < BLOCK for _, control in blocks for b in range(len(control)))   # a request's last


def test_decode_steps_must_be_from_1_to_the_page_size(model, capsys):
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="decode_steps must be an integer from 1 to the page size 8"):
            new_engine(model, decode_steps=bad)
    # decode.py: below 1 before the model loads; above the server's page size (16) by the engine.
    assert decode.main(["--serve", "--decode-steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --decode-steps (decode_steps) must be >= 1, got 0")
    assert decode.main(["--serve", "--decode-steps", "17"]) == 2
    assert capsys.readouterr().err.startswith("error: decode_steps must be an integer from 1 to the page size 16")


def test_batch_invariant_blocks_give_the_tokens_of_single_steps(model):
    """The batch-invariant kernels (their own programs) inside a block: the same tokens, and a
    request's own alone and beside others."""
    forward = ForwardOptions(kernels=ops.KernelChoice(batch_invariant=True))
    requests = [Request(PROMPTS[0], 10), Request(PROMPTS[2], 9, HOT_BLOCK, seed=2)]
    single = new_engine(model, forward=forward).serve(requests)
    engine = new_engine(model, forward=forward, decode_steps=BLOCK)
    blocks = engine.serve(requests)
    assert [r.tokens for r in blocks] == [r.tokens for r in single]
    assert any(t.steps == BLOCK for t in engine.step_times)
    assert engine.serve(requests[:1])[0].tokens == blocks[0].tokens
