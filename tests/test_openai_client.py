"""/v1/completions through the official `openai` client (an optional test dependency, in the dev
extra): a list of prompts with n=2, echo and logprobs, whole and streamed, and the client's
BadRequestError for a logprobs value past the server's limit. Skipped where openai is missing."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from glm_jax.decoding.slots import MAX_LOGPROBS  # noqa: E402
from test_logprobs import served_micro  # noqa: E402

PROMPTS = ["def add(a, b):", "import os\n"]


@pytest.fixture(scope="module")
def client():
    with served_micro() as (_, url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client


def create(client, **fields):
    return client.completions.create(model="micro", prompt=PROMPTS, n=2, max_tokens=5, echo=True, logprobs=2,
                                     **fields)


def test_prompt_list_n_echo_and_logprobs(client):
    response = create(client, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        prompt = PROMPTS[choice.index // 2]                         # prompt-major
        logprobs = choice.logprobs
        assert choice.text.startswith(prompt) and choice.finish_reason == "length"
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) \
            == len(logprobs.text_offset)
        assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
        assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
        assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    greedy = [(c.text, c.logprobs.token_logprobs) for c in response.choices]
    assert greedy[0] == greedy[1] and greedy[2] == greedy[3]         # temperature 0: a prompt's choices agree
    assert response.usage.completion_tokens == 4 * 5


def test_stream_carries_each_chunks_logprobs(client):
    whole = create(client, temperature=0.9, seed=5)
    texts, logprobs = {}, {}
    for chunk in create(client, temperature=0.9, seed=5, stream=True):
        [choice] = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.logprobs is not None:
            logprobs.setdefault(choice.index, []).extend(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs))
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert logprobs[choice.index] == list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs))


def test_logprobs_past_the_limit_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="micro", prompt="a", logprobs=MAX_LOGPROBS + 1)
    assert e.value.status_code == 400 and f"from 0 to {MAX_LOGPROBS}" in e.value.message
