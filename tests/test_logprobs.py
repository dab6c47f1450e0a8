"""Log-probabilities: the serving engine's (`Request.logprobs`, `prompt_logprobs`) against a plain
forward of the same micro model, and /v1/completions' `logprobs` (with echo, streamed, refused
past the limit) over a real server.

The engines have test_server.py's shapes (SERVE) or test_engine.py's (the preemption test), so
in one run the files share the compiled programs. Every request here is greedy or seeded, so
every run gives the same numbers."""

from __future__ import annotations

import contextlib

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from conftest import counting_compiles, micro_config
from glm_jax.decoding.engine import Request, ServingEngine
from glm_jax.decoding.slots import MAX_LOGPROBS
from glm_jax.decoding.sampling import SamplingParams
from glm_jax.model import GLMModel
from glm_jax.serving.app import make_app
from glm_jax.serving.engine_setup import build_engine
from glm_jax.serving.text import token_texts
from test_server import SERVE, TOKENIZER, VOCAB, micro_model, running, sse_chunks

#: 12 tokens: two prefill chunks of 8, so prompt positions are scored across a chunk boundary.
PROMPT = "def add(a, b):\n    return a + b"
ATOL = 1e-4


@contextlib.contextmanager
def served_micro():
    """-> (the micro model, the base URL of a server over an engine of SERVE's shapes on it)."""
    model = micro_model()
    engine = build_engine(model, **SERVE)
    with running(make_app(engine, TOKENIZER, model_name="micro", max_context=SERVE["max_context"])) as url:
        yield model, url


_forward = nnx.jit(lambda model, tokens: model(tokens).logits)


def model_logprobs(model, tokens) -> np.ndarray:
    """float32 [T, V]: log_softmax of a plain forward's logits over `tokens` (row t scores token
    t + 1). The forward runs over the model's whole context, zeros after the tokens (rows of a
    causal model never see later tokens), so one compiled forward serves every length."""
    padded = np.zeros((1, model.cfg.max_position_embeddings), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(jax.nn.log_softmax(_forward(model, padded)[0, :len(tokens)], axis=-1))


def run_engine(engine, requests: list[Request]) -> list[dict]:
    """Each request's tokens, logprobs and prompt_logprobs, joined over its events."""
    ids = [engine.submit(r) for r in requests]
    out = {i: {"tokens": [], "logprobs": None, "prompt_logprobs": None} for i in ids}
    while engine.has_work():
        for event in engine.step():
            got = out[event.request_id]
            assert event.error is None
            got["tokens"] += event.tokens
            if event.logprobs is not None:
                assert len(event.logprobs) == len(event.tokens)
                got["logprobs"] = (got["logprobs"] or []) + event.logprobs
            if event.prompt_logprobs is not None:                  # with the request's first event
                assert got["prompt_logprobs"] is None and got["tokens"] == event.tokens
                got["prompt_logprobs"] = event.prompt_logprobs
    return [out[i] for i in ids]


def assert_scores(scored, token: int, row: np.ndarray, k: int) -> None:
    """A TokenLogprob equals the plain forward's log-probs `row` [V] at `token`, with k alternatives."""
    assert abs(scored.logprob - row[token]) < ATOL
    ids, values = zip(*scored.top) if k else ((), ())
    assert len(ids) == k and list(values) == sorted(values, reverse=True)
    np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=ATOL)
    np.testing.assert_allclose(row[list(ids)], values, atol=ATOL)


@pytest.fixture(scope="module")
def engine_and_model():
    model = micro_model()
    return build_engine(model, **SERVE), model


def test_engine_logprobs_equal_a_plain_forward(engine_and_model):
    engine, model = engine_and_model
    prompt = np.asarray(TOKENIZER.encode(PROMPT).ids, np.int32)
    greedy, sampled, plain = run_engine(engine, [
        Request(prompt, 6, logprobs=MAX_LOGPROBS, prompt_logprobs=True),
        Request(prompt, 6, sampling=SamplingParams(temperature=0.5), seed=3, logprobs=2),
        Request(prompt[:5], 4)])
    p = len(prompt)

    reference = model_logprobs(model, np.concatenate([prompt, greedy["tokens"]]))
    for i, (token, scored) in enumerate(zip(greedy["tokens"], greedy["logprobs"], strict=True)):
        row = reference[p - 1 + i]
        assert token == row.argmax() == scored.top[0][0]            # temperature 0 draws the argmax
        assert_scores(scored, token, row, MAX_LOGPROBS)
    assert len(greedy["prompt_logprobs"]) == p - 1                   # prompt tokens 1..P-1
    for i, scored in enumerate(greedy["prompt_logprobs"]):
        assert_scores(scored, prompt[i + 1], reference[i], MAX_LOGPROBS)

    # Sampled at temperature 0.5: the log-probs are the model's, before temperature.
    reference = model_logprobs(model, np.concatenate([prompt, sampled["tokens"]]))
    tempered = np.asarray(jax.nn.log_softmax(reference / 0.5, axis=-1))
    for i, (token, scored) in enumerate(zip(sampled["tokens"], sampled["logprobs"], strict=True)):
        assert_scores(scored, token, reference[p - 1 + i], 2)
        assert abs(scored.logprob - tempered[p - 1 + i, token]) > 1e-2
    assert sampled["prompt_logprobs"] is None and plain["logprobs"] is None and plain["prompt_logprobs"] is None


def test_any_logprobs_count_runs_on_the_same_programs(engine_and_model):
    engine, _ = engine_and_model
    prompt = np.asarray(TOKENIZER.encode(PROMPT).ids, np.int32)
    run_engine(engine, [Request(prompt, 2, logprobs=1, prompt_logprobs=True), Request(prompt, 2)])   # compiled
    with counting_compiles() as compiles:
        results = run_engine(engine, [Request(prompt, 3, logprobs=k, prompt_logprobs=k % 2 == 0)
                                      for k in (0, 5, MAX_LOGPROBS)] + [Request(prompt, 3)])
    assert not compiles, compiles
    assert [[len(s.top) for s in r["logprobs"]] for r in results[:3]] == [[0] * 3, [5] * 3, [MAX_LOGPROBS] * 3]
    assert results[3]["logprobs"] is None
    assert [r["tokens"] for r in results] == [results[0]["tokens"]] * 4


def test_prompt_logprobs_survive_a_preemption():
    """test_engine.py's preemption case (its engine shapes): two requests that do not fit the pool
    together, each with prompt and token log-probs, against a plain forward."""
    model = GLMModel(micro_config(max_position_embeddings=256), rngs=nnx.Rngs(0))
    engine = ServingEngine(model, slots=3, num_pages=13, page_size=8, max_context=120, prefill_chunk=8)
    prompts = [np.arange(60, 90) % 97, np.arange(40, 53)]
    results = run_engine(engine, [Request(p, 40, logprobs=2, prompt_logprobs=True) for p in prompts])
    assert engine.preemptions >= 1
    for prompt, result in zip(prompts, results):
        sequence = np.concatenate([prompt, result["tokens"]])
        reference = model_logprobs(model, sequence)
        scored = result["prompt_logprobs"] + result["logprobs"]         # each scores token i + 1, once
        assert len(result["prompt_logprobs"]) == len(prompt) - 1 and len(result["logprobs"]) == 40
        for i, s in enumerate(scored):
            assert_scores(s, sequence[i + 1], reference[i], 2)


def test_engine_refuses_a_bad_logprobs_request(engine_and_model):
    engine, _ = engine_and_model
    for bad in (Request(np.arange(1, 4), 2, logprobs=MAX_LOGPROBS + 1), Request(np.arange(1, 4), 2, logprobs=-1),
                Request(np.arange(1, 4), 2, prompt_logprobs=True)):
        rid = engine.submit(bad)
        [event] = engine.step()
        assert event.request_id == rid and event.finished and ("logprobs" in event.error)


# ---------------------------------------------------------------------- /v1/completions
@pytest.fixture(scope="module")
def server():
    with served_micro() as (model, url):
        yield model, url


def completion(url: str, **fields) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                         **fields}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_and_logprobs_give_openai_legacy_logprobs(server):
    model, url = server
    [choice] = completion(url, logprobs=3, echo=True)["choices"]
    logprobs, text = choice["logprobs"], choice["text"]
    prompt_ids = TOKENIZER.encode(PROMPT).ids
    p = len(prompt_ids)
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == p + 5 and text.startswith(PROMPT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None     # as OpenAI
    assert "".join(logprobs["tokens"]) == text                                            # ASCII: token texts join up
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(p + 5)]
    text_of = token_texts(TOKENIZER)
    id_of = {text_of(token): token for token in range(VOCAB)}
    generated = [id_of[t] for t in logprobs["tokens"][p:]]             # (ASCII tokens: one id per text)
    reference = model_logprobs(model, prompt_ids + generated)
    for i in range(1, p + 5):
        token = (prompt_ids + generated)[i]
        assert abs(logprobs["token_logprobs"][i] - reference[i - 1, token]) < ATOL
        top = logprobs["top_logprobs"][i]
        values = list(top.values())
        assert values == sorted(values, reverse=True) and len(top) in (3, 4)    # + the token itself, if not in the 3
        assert values[:3] == pytest.approx(np.sort(reference[i - 1])[::-1][:3].tolist(), abs=ATOL)
        if i >= p:
            assert next(iter(top)) == logprobs["tokens"][i]                                # greedy: the most likely

    plain = completion(url, logprobs=0)["choices"][0]
    assert plain["text"] == text[len(PROMPT):] and plain["logprobs"]["text_offset"][0] == 0
    assert plain["logprobs"]["tokens"] == logprobs["tokens"][p:]
    assert [list(top) for top in plain["logprobs"]["top_logprobs"]] == [[t] for t in plain["logprobs"]["tokens"]]
    assert completion(url)["choices"][0]["logprobs"] is None

    # A stop string inside token 2's text: the tokens end with the one that completed it.
    tokens, offsets = plain["logprobs"]["tokens"], plain["logprobs"]["text_offset"]
    stop = tokens[2].strip()
    assert stop and stop not in plain["text"][:offsets[2] + tokens[2].index(stop)]
    stopped = completion(url, logprobs=1, stop=stop)["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["logprobs"]["tokens"] == tokens[:3]
    assert stopped["text"] == plain["text"][:offsets[2] + tokens[2].index(stop)]


def test_each_stream_chunk_carries_its_tokens_logprobs(server):
    _, url = server
    body = {"prompt": [PROMPT, "import os\n"], "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 11,
            "logprobs": 2, "echo": True}
    whole = completion(url, **body)["choices"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        chunks = sse_chunks(r)
    for index, want in enumerate(whole):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == want["text"]
        joined = {key: [v for c in mine for v in c["logprobs"][key]] for key in want["logprobs"]}
        assert joined == want["logprobs"]
        for c in mine:                                       # a chunk's tokens are that chunk's text
            assert "".join(c["logprobs"]["tokens"]) == c["text"]
    assert whole[0]["text"] != whole[1]["text"]               # sampled: the choices differ


@pytest.mark.parametrize("value", [MAX_LOGPROBS + 1, -1, 2.5, True])
def test_logprobs_past_the_limit_get_400_naming_it(server, value):
    _, url = server
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "logprobs": value}, timeout=10)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "logprobs"
    assert f"from 0 to {MAX_LOGPROBS}" in error["message"] and f"limit is {MAX_LOGPROBS}" in error["message"]
