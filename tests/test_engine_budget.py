"""The serving engine's step token budget: the same tokens with and without it (greedy and
sampled), at most `budget - decoding` prefill tokens in every step that decodes, whole chunks
when nothing decodes, at most two prefill programs, and a budget too small refused (by the
engine, and by `decode.py --serve --step-token-budget` in one line).

One scenario runs on two engines of the same shapes (3 slots, pages of 8 rows, prefill chunk
32), one without a budget and one with a budget of 19 tokens (a prefill chunk of 16 while
slots decode): two short requests decode while a 75-token prompt arrives, then a 50-token one
(sampled, with prompt log-probabilities) arrives while the others still decode."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

import decode
from glm_jax.decoding.engine import Request, ServingEngine, budget_chunk
from glm_jax.decoding.sampling import SamplingParams
from test_engine import compiles, model  # noqa: F401 - the engine tests' fixtures: micro model, compile counts

BUDGET = 19                        # 3 decoding slots + a chunk of 16 (two pages of 8)
SHAPES = dict(slots=3, num_pages=46, page_size=8, max_context=120, prefill_chunk=32)
LONG = (np.arange(75) * 7) % 97
HOT = SamplingParams(temperature=1.5, top_k=20)
# (step to submit at, request): the long prompts arrive while the short ones decode.
SCENARIO = [
    (0, Request(np.arange(3, 12), 24)),
    (0, Request(np.arange(20, 25), 40, sampling=HOT, seed=7)),
    (3, Request(LONG, 6)),
    (16, Request(np.arange(50), 8, sampling=SamplingParams(1.0, top_p=0.9), seed=11, logprobs=2,
                 prompt_logprobs=True)),
]


class Output(NamedTuple):
    tokens: list[int]
    prompt_logprobs: list | None
    first_step: int                 # the step whose events held its first token


def run_scenario(engine: ServingEngine, scenario) -> tuple[list[Output], list]:
    """Step the engine through `scenario` -> (an Output per request, the engine's StepTimes)."""
    engine.step_times.clear()
    ids, tokens, prompt_scores, first = {}, {}, {}, {}
    step = 0
    while step <= max(at for at, _ in scenario) or engine.has_work():
        for i, (at, request) in enumerate(scenario):
            if at == step:
                ids[engine.submit(request)] = i
        for event in engine.step():
            i = ids[event.request_id]
            assert event.error is None, event.error
            tokens.setdefault(i, []).extend(event.tokens)
            if event.tokens:
                first.setdefault(i, step)
            if event.prompt_logprobs is not None:
                prompt_scores[i] = event.prompt_logprobs
        step += 1
    assert not engine.pool.held and engine.pool.free_pages() == engine.pool.usable_pages
    outputs = [Output(tokens.get(i, []), prompt_scores.get(i), first.get(i)) for i in range(len(scenario))]
    return outputs, list(engine.step_times)


@pytest.fixture(scope="module")
def runs(model) -> dict:
    """The scenario on an engine without a budget (None) and on one with BUDGET."""
    return {budget: run_scenario(ServingEngine(model, **SHAPES, step_token_budget=budget), SCENARIO)
            for budget in (None, BUDGET)}


def test_tokens_are_the_same_with_and_without_the_budget(runs):
    plain, budgeted = runs[None][0], runs[BUDGET][0]
    for i, (_, request) in enumerate(SCENARIO):
        assert len(budgeted[i].tokens) == request.max_new_tokens, i          # every request completes
        assert budgeted[i].tokens == plain[i].tokens, i
    got, want = budgeted[3].prompt_logprobs, plain[3].prompt_logprobs    # scored in other chunks
    assert len(got) == len(want) == len(SCENARIO[3][1].prompt) - 1
    for a, b in zip(got, want):
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
        assert [a.logprob, *(p for _, p in a.top)] == pytest.approx([b.logprob, *(p for _, p in b.top)], abs=1e-4)


def test_every_decoding_step_stays_within_the_budget(runs, compiles):
    plain, budgeted = runs[None][1], runs[BUDGET][1]
    # Without the budget, the long prompts' 32-token chunks ran beside decoding slots.
    assert max(t.prefill + t.rows for t in plain) > BUDGET
    assert all(t.prefill <= BUDGET - t.rows for t in budgeted), [(t.prefill, t.rows) for t in budgeted]
    assert max(t.prefill for t in budgeted) == 16 and sum(t.prefill for t in budgeted) >= len(LONG) + 50
    # The long prompt's prefill takes more steps: its first token comes later (its TTFT grows).
    assert runs[BUDGET][0][2].first_step > runs[None][0][2].first_step
    # Two chunk sizes: the prefill compiled at most twice without targets and twice with them in this file.
    assert compiles["jit(prefill_chunk)"] <= 4, compiles


def test_a_prompt_with_nothing_decoding_prefills_whole_chunks(model):
    engine = ServingEngine(model, **SHAPES, step_token_budget=BUDGET)
    outputs, _ = run_scenario(engine, [(0, Request(LONG, 2))])
    assert outputs[0].first_step == 3       # chunks of 32, 32, 11 in steps 0-2; its first token read in step 3


def test_budget_chunk_is_a_whole_number_of_pages_within_the_budget():
    shapes = dict(slots=3, page_size=8, prefill_chunk=32)
    assert budget_chunk(None, rows=1, **shapes) == 32
    assert budget_chunk(BUDGET, rows=1, **shapes) == 16 and budget_chunk(26, rows=1, **shapes) == 16
    assert budget_chunk(11, rows=1, **shapes) == 8 and budget_chunk(1000, rows=1, **shapes) == 32
    assert budget_chunk(35, rows=2, **shapes) == 16                       # one chunk per data shard


@pytest.mark.parametrize("budget", [10, 0, 2.5])
def test_a_budget_too_small_is_refused_naming_the_minimum(model, budget):
    with pytest.raises(ValueError, match="step token budget must be an integer >= 11 "):    # 3 slots + a page of 8
        ServingEngine(model, **SHAPES, step_token_budget=budget)
    with pytest.raises(ValueError, match=">= 19 "):                                         # 3 + two rows of 8
        budget_chunk(18, slots=3, rows=2, page_size=8, prefill_chunk=32)


def test_serve_flag_refuses_a_budget_too_small_in_one_line(capsys):
    """The default checkpoint with the server's defaults: 4 slots, pages of 16."""
    assert decode.main(["--serve", "--step-token-budget", "5"]) == 2
    assert capsys.readouterr().err.startswith("error: the step token budget must be an integer >= 20 ")
