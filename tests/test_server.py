"""The HTTP front end (glm_jax.serving): OpenAI-style /v1/completions over a real uvicorn server
on localhost, driven with httpx.

The protocol layer runs over `FakeEngine` (the ServingEngine API, scripted tokens, no model):
response shapes, lists of prompts with n choices each and echo, streams of several choices,
cancellation on disconnect. The real engine with a micro model checks concurrent greedy
requests and the choices of a list of prompts against decoding each prompt alone, streaming
against non-streaming, errors while other requests complete, and a `decode.py --serve` process
draining on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from flax import nnx

import decode
from conftest import ROOT, micro_config
from glm_jax.checkpoint import save_model_dir
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.decoding.engine import Event, Request
from glm_jax.model import GLMModel
from glm_jax.serving.app import make_app
from glm_jax.serving.engine_setup import build_engine
from glm_jax.serving.protocol import MAX_N, MAX_PROMPTS, APIError, max_body_bytes, max_prompt_bytes, parse_completion
from glm_jax.serving.text import Detokenizer, TextStream

TOKENIZER_FILE = ROOT / "checkpoints" / "default" / "tokenizer.json"
TOKENIZER = load_tokenizer(TOKENIZER_FILE)
VOCAB = TOKENIZER.get_vocab_size()
MULTIBYTE = "héllo 日本 🎉 ok"


@contextlib.contextmanager
def running(app):
    """`app` served by uvicorn on a free localhost port, in a thread -> its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def connection(url: str) -> http.client.HTTPConnection:
    """A plain HTTP/1.1 connection to the server at `url`, for requests httpx will not send (a
    body shorter than its Content-Length, or none)."""
    address = httpx.URL(url)
    return http.client.HTTPConnection(address.host, address.port, timeout=10)


def send_head(conn: http.client.HTTPConnection, content_length: int, body: bytes = b"") -> None:
    """A POST /v1/completions whose headers announce `content_length` bytes, with `body` only."""
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(content_length))
    conn.endheaders(body)


def sse_chunks(response: httpx.Response) -> list:
    """The JSON chunks of a server-sent event stream, checking that it ends with [DONE]."""
    data = [line[len("data: "):] for line in response.iter_lines() if line]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ---------------------------------------------------------------------- text and protocol
def test_detokenizer_never_splits_a_character():
    ids = TOKENIZER.encode(MULTIBYTE).ids
    detok = Detokenizer(TOKENIZER)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces                          # some token ended inside a character and was held back


@pytest.mark.parametrize("stop, want", [(("日本",), "héllo "), (("ok", "🎉"), "héllo 日本 "),
                                        (("llo 日本 🎉 ok!",), MULTIBYTE)])
def test_text_stream_ends_before_the_first_stop_string(stop, want):
    stream = TextStream(TOKENIZER, stop)
    pieces = [stream.push([t]) for t in TOKENIZER.encode(MULTIBYTE).ids] + [stream.flush()]
    assert "".join(pieces) == want
    assert stream.stopped == (want != MULTIBYTE)


def parse(**fields):
    return parse_completion(json.dumps(fields).encode(), TOKENIZER, model_name="micro", max_context=32)


@pytest.mark.parametrize("fields, param, words", [
    ({"prompt": "a", "temperature": "hot"}, "temperature", "must be a number"),
    ({"prompt": "a", "top_p": 1.5}, "top_p", "in (0, 1]"),
    ({"prompt": "a", "top_k": 2.5}, "top_k", "must be an integer"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "a", "max_tokens": 40}, "max_tokens", "exceeds this server's context of 32"),
    ({"prompt": list(range(32))}, "prompt", "leaves no room"),
    ({"prompt": ["a", list(range(32))]}, "prompt", "prompt[1] has 32 tokens"),
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt", f"up to {MAX_PROMPTS} prompts"),
    ({"prompt": []}, "prompt", "must be a string"),
    ({"prompt": ["a", ["b"]]}, "prompt", "prompt[1] must be a string or a list of token ids"),
    ({"prompt": [VOCAB + 1]}, "prompt", f"in [0, {VOCAB})"),
    ({"prompt": ["a", [1, VOCAB]]}, "prompt", f"prompt[1]: token ids must be in [0, {VOCAB})"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": "a", "stop": ["x", 3]}, "stop", "non-empty string"),
    ({"prompt": "a", "n": MAX_N + 1}, "n", f"n must be from 1 to {MAX_N}"),
    ({"prompt": "a", "n": 0}, "n", f"n must be from 1 to {MAX_N}"),
    ({"prompt": "a", "n": 2, "best_of": 3}, "best_of", "must equal n (2)"),
    ({"prompt": "a", "echo": "yes"}, "echo", "true or false"),
    ({"prompt": "a", "logprobs": 21}, "logprobs", "from 0 to 20"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"prompt": "a", "bogus": 1}, "bogus", "unknown field"),
])
def test_bad_fields_are_named(fields, param, words):
    with pytest.raises(APIError) as e:
        parse(**fields)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


def test_request_fields_and_defaults():
    req = parse(prompt=[[1, 2, 3]], max_tokens=None, temperature=0, top_k=5, seed=7, stop="\n", stream=True,
                stream_options={"include_usage": True})
    [prompt] = req.prompts
    assert prompt.ids.tolist() == [1, 2, 3] and prompt.max_tokens == 29 and prompt.echo == ""
    assert (req.sampling.temperature, req.sampling.top_k, req.seed, req.stop, req.n) == (0, 5, 7, ("\n",), 1)
    assert req.stream and req.include_usage
    default = parse(prompt="a", model="micro")
    assert default.prompts[0].max_tokens == 16 and default.sampling.temperature == 1 and default.stop == ()
    with pytest.raises(APIError) as e:
        parse(prompt="a", model="gpt-4")
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_prompt_lists_n_and_echo_make_prompt_major_choices():
    ids = TOKENIZER.encode("héllo").ids
    req = parse(prompt=["a b", ids], n=3, echo=True, max_tokens=None, seed=2**32 - 2)
    assert [p.ids.tolist() for p in req.prompts] == [TOKENIZER.encode("a b").ids, ids]
    assert [p.echo for p in req.prompts] == ["a b", "héllo"]            # a token-id prompt echoes its text
    assert [p.max_tokens for p in req.prompts] == [32 - len(p.ids) for p in req.prompts]   # each its own room
    choices = req.choices()
    assert [prompt for prompt, _ in choices] == [req.prompts[0]] * 3 + [req.prompts[1]] * 3
    assert [seed for _, seed in choices] == [2**32 - 2, 2**32 - 1, 0] * 2    # seed + j, wrapping
    assert parse(prompt=[[1, 2]], n=2, best_of=2).n == 2
    assert parse(prompt="a", echo=False).prompts[0].echo == ""


def test_a_prompt_string_past_its_limit_gets_413_before_any_prompt_is_tokenized():
    tokenizer = CountingTokenizer(TOKENIZER)
    long = "a" * (max_prompt_bytes(32) + 1)
    body = json.dumps({"prompt": ["short", long]}).encode()
    assert len(body) < max_body_bytes(32)
    with pytest.raises(APIError) as e:
        parse_completion(body, tokenizer, model_name="micro", max_context=32)
    assert (e.value.status, e.value.param, e.value.code) == (413, "prompt", "request_too_large")
    assert f"prompt[1] is longer than this server's limit of {max_prompt_bytes(32)} bytes per prompt" in e.value.message
    assert tokenizer.encoded == 0


# ---------------------------------------------------------------------- the app over a fake engine
class FakeEngine:
    """The ServingEngine API, no model: each step gives every active request the next token of
    `script` (cycling); a prompt longer than `limit` tokens fails alone; `step_s` slows steps."""

    def __init__(self, script: list[int], *, limit: int = 16, step_s: float = 0.0):
        self.script, self.limit, self.step_s = script, limit, step_s
        self.active: dict[int, list] = {}           # id -> [request, tokens given]
        self.refused: list[int] = []
        self.cancelled: list[int] = []
        self.requests: list = []

    def submit(self, request) -> int:
        self.requests.append(request)
        request_id = len(self.requests) - 1
        if len(request.prompt) > self.limit:
            self.refused.append(request_id)
        else:
            self.active[request_id] = [request, 0]
        return request_id

    def cancel(self, request_id: int) -> None:
        self.active.pop(request_id)
        self.cancelled.append(request_id)

    def has_work(self) -> bool:
        return bool(self.active or self.refused)

    def step(self) -> list[Event]:
        time.sleep(self.step_s)
        events = [Event(i, [], True, error=f"prompt longer than {self.limit} tokens") for i in self.refused]
        self.refused = []
        for request_id, entry in list(self.active.items()):
            request, given = entry
            entry[1] += 1
            token = self.script[given % len(self.script)]
            done = entry[1] >= request.max_new_tokens or token == request.stop_token
            events.append(Event(request_id, [] if token == request.stop_token else [token], done))
            if done:
                del self.active[request_id]
        return events


@pytest.fixture
def fake():
    """-> (engine, base URL) of an app over a FakeEngine that emits MULTIBYTE's tokens, then the stop token."""
    engine = FakeEngine(TOKENIZER.encode(MULTIBYTE).ids + [0])
    with running(make_app(engine, TOKENIZER, model_name="micro", max_context=64, stop_token=0)) as url:
        yield engine, url


def test_fake_completion_stream_and_stop_reasons(fake):
    engine, url = fake
    n = len(TOKENIZER.encode(MULTIBYTE).ids)
    whole = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 40, "temperature": 0}).json()
    assert whole["object"] == "text_completion" and whole["model"] == "micro"
    assert whole["choices"] == [{"index": 0, "text": MULTIBYTE, "finish_reason": "stop", "logprobs": None}]
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    assert engine.requests[0].stop_token == 0 and engine.requests[0].max_new_tokens == 40

    short = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3

    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 40, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_chunks(r)
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert "".join(texts) == MULTIBYTE and not any("\ufffd" in t for t in texts)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(texts) - 1) + ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n

    stopped = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 40, "stop": ["🎉"]}).json()
    assert stopped["choices"][0]["text"] == "héllo 日本 " and stopped["choices"][0]["finish_reason"] == "stop"


def test_fake_errors_are_openai_json(fake):
    engine, url = fake
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(20)), "stream": True})
    assert refused.status_code == 400
    assert refused.json()["error"] == {"message": "prompt longer than 16 tokens", "type": "invalid_request_error",
                                       "param": None, "code": "request_refused"}
    one_refused = httpx.post(f"{url}/v1/completions", json={"prompt": ["hi", list(range(20))], "max_tokens": 40})
    assert one_refused.status_code == 400 and one_refused.json()["error"]["code"] == "request_refused"
    too_many = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "n": MAX_N + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    missing = httpx.get(f"{url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "micro"
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "in_flight": 0}


def choices_of_stream(chunks: list) -> dict[int, list]:
    """A stream's chunks (the usage chunk aside) -> each choice index's choices, in order; each
    chunk carries one choice."""
    by_index = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    return by_index


def test_fake_prompt_list_with_n_and_echo(fake):
    engine, url = fake
    prompts, completion_tokens = ["hi", "yo there"], len(TOKENIZER.encode(MULTIBYTE).ids)
    prompt_ids = [TOKENIZER.encode(p).ids for p in prompts]
    body = {"prompt": prompts, "n": 2, "max_tokens": 40, "temperature": 0.7, "seed": 7}
    whole = httpx.post(f"{url}/v1/completions", json=body).json()
    assert whole["choices"] == [{"index": i, "text": MULTIBYTE, "finish_reason": "stop", "logprobs": None}
                                for i in range(4)]
    prompt_tokens = sum(map(len, prompt_ids))                      # each prompt once, as OpenAI counts
    assert whole["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4 * completion_tokens,
                              "total_tokens": prompt_tokens + 4 * completion_tokens}
    assert [r.prompt.tolist() for r in engine.requests] == [prompt_ids[0]] * 2 + [prompt_ids[1]] * 2
    assert [r.seed for r in engine.requests] == [7, 8, 7, 8]       # a prompt's choices draw differently

    echoed = httpx.post(f"{url}/v1/completions", json={**body, "echo": True}).json()
    assert [c["text"] for c in echoed["choices"]] == [p + MULTIBYTE for p in prompts for _ in range(2)]
    ids_echoed = httpx.post(f"{url}/v1/completions", json={"prompt": prompt_ids[1], "echo": True, "max_tokens": 40})
    assert ids_echoed.json()["choices"][0]["text"] == "yo there" + MULTIBYTE      # token ids echo as their text


def test_fake_stream_of_several_choices_echoes_and_ends_each_choice(fake):
    _, url = fake
    prompts, completion_tokens = ["hi", "yo there"], len(TOKENIZER.encode(MULTIBYTE).ids)
    body = {"prompt": prompts, "n": 2, "max_tokens": 40, "echo": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        *chunks, usage_chunk = sse_chunks(r)
    by_index = choices_of_stream(chunks)
    assert sorted(by_index) == [0, 1, 2, 3]
    for index, choices in by_index.items():
        prompt = prompts[index // 2]                                # prompt-major: index = prompt * n + j
        assert choices[0] == {"index": index, "text": prompt, "finish_reason": None, "logprobs": None}
        assert "".join(c["text"] for c in choices) == prompt + MULTIBYTE
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4 * completion_tokens

    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": prompts, "max_tokens": 3, "stream": True}) as r:
        short = choices_of_stream(sse_chunks(r))
    assert {index: choices[-1]["finish_reason"] for index, choices in short.items()} == {0: "length", 1: "length"}


class CountingTokenizer:
    """The tokenizer, counting the texts it encodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, 0

    def encode(self, text):
        self.encoded += 1
        return self.tokenizer.encode(text)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def padded_body(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (its JSON, then spaces)."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    return body + b" " * (size - len(body))


def test_a_body_past_the_limit_gets_413_and_is_never_tokenized():
    tokenizer, engine = CountingTokenizer(TOKENIZER), FakeEngine([5])
    limit = max_body_bytes(64)
    with running(make_app(engine, tokenizer, model_name="micro", max_context=64)) as url:
        at_limit = httpx.post(f"{url}/v1/completions", content=padded_body(limit), timeout=10)
        assert at_limit.status_code == 200 and tokenizer.encoded == 1
        over = padded_body(limit + 1)
        chunked = (over[i:i + 1000] for i in range(0, len(over), 1000))     # a generator: no Content-Length
        for content in over, chunked:
            refused = httpx.post(f"{url}/v1/completions", content=content, timeout=10)
            assert refused.status_code == 413
            assert refused.json()["error"] == {
                "message": f"the request body is longer than this server's limit of {limit} bytes (room for "
                           f"{MAX_PROMPTS} prompts of its whole 64-token context); shorten the prompts",
                "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        conn = connection(url)
        send_head(conn, 10_000_000)                    # 10 MB announced, none sent: refused at once
        announced = conn.getresponse()
        assert announced.status == 413 and f"limit of {limit} bytes" in json.loads(announced.read())["error"]["message"]
        conn.close()
        assert tokenizer.encoded == 1 and len(engine.requests) == 1
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "in_flight": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_every_choice_of_the_request(stream):
    engine = FakeEngine([5], step_s=0.01)
    app = make_app(engine, TOKENIZER, model_name="micro", max_context=4096)
    with running(app) as url:
        body = {"prompt": ["hi", "yo"], "n": 2, "max_tokens": 4000, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")             # streaming; then the client goes
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 5
        while len(engine.cancelled) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(engine.cancelled) == [0, 1, 2, 3] and not engine.active
        assert app.state.engine_loop.in_flight == 0


def test_engine_failure_fails_requests_with_503():
    class Broken(FakeEngine):
        def step(self):
            raise RuntimeError("device lost")

    with running(make_app(Broken([1]), TOKENIZER, model_name="micro", max_context=64)) as url:
        first = httpx.post(f"{url}/v1/completions", json={"prompt": ["hi", "yo"], "n": 2})     # 4 choices fail
        assert first.status_code == 503 and "device lost" in first.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 503
        assert httpx.get(f"{url}/health").json()["status"] == "failed"


# ---------------------------------------------------------------------- the real engine
#: The server's settings: the in-process server and the decode.py --serve process share them,
#: so the process finds the programs in the compilation cache.
SERVE = dict(slots=2, page_size=8, max_context=64, prefill_chunk=8)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):"]


def micro_model():
    return GLMModel(micro_config(vocab_size=TOKENIZER.get_vocab_size(), max_position_embeddings=64),
                    rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def real():
    """-> (greedy completions of PROMPTS, each decoded alone by the engine before the server
    starts, the base URL of the server over that engine with a micro model)."""
    engine = build_engine(micro_model(), **SERVE)
    alone = [TOKENIZER.decode(engine.serve([Request(np.asarray(TOKENIZER.encode(p).ids), 6)])[0].tokens)
             for p in PROMPTS]
    app = make_app(engine, TOKENIZER, model_name="micro", max_context=SERVE["max_context"])
    with running(app) as url:
        yield alone, url


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def test_concurrent_greedy_requests_equal_decoding_each_alone(real):
    alone, url = real
    over_long = {"prompt": list(range(1, 70)), "max_tokens": 4}
    responses = asyncio.run(post_all(url, [{"prompt": p, "max_tokens": 6, "temperature": 0} for p in PROMPTS]
                                     + [over_long]))
    *served, refused = responses
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    for want, response in zip(alone, served):
        body = response.json()
        assert response.status_code == 200 and body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["text"] == want
        assert body["choices"][0]["finish_reason"] == "length"


def test_prompt_list_with_n_equals_decoding_each_prompt_alone(real):
    alone, url = real
    greedy = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 6, "temperature": 0}
    body = httpx.post(f"{url}/v1/completions", json=greedy, timeout=120).json()
    assert [c["text"] for c in body["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3] and body["usage"]["completion_tokens"] == 24
    sampled = {"prompt": PROMPTS[0], "n": 2, "max_tokens": 6, "temperature": 1, "seed": 5}
    choices = httpx.post(f"{url}/v1/completions", json=sampled, timeout=120).json()["choices"]
    first, second = [c["text"] for c in choices]
    assert first != second
    alone_with_seed = httpx.post(f"{url}/v1/completions", json={**sampled, "n": 1}, timeout=120).json()
    assert alone_with_seed["choices"][0]["text"] == first         # choice 0 draws with the seed itself


def test_stream_equals_whole_response_and_bad_bodies_get_400(real):
    _, url = real
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.8, "top_k": 20, "seed": 3}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        chunks = sse_chunks(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "length"
    malformed = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a",', timeout=10)
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]["message"]
    wrong = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "min_p": 2}, timeout=10).json()["error"]
    assert wrong["param"] == "min_p" and wrong["type"] == "invalid_request_error"


def test_sigterm_drains_the_request_in_flight_and_refuses_new_ones(tmp_path):
    save_model_dir(tmp_path / "micro", micro_model(), tokenizer_file=TOKENIZER_FILE)
    flags = ["--max-batch", SERVE["slots"], "--page-size", SERVE["page_size"], "--max-len", SERVE["max_context"],
             "--prefill-chunk", SERVE["prefill_chunk"]]
    proc = subprocess.Popen([sys.executable, str(ROOT / "decode.py"), "--serve", "--port", "0", "--checkpoint",
                             str(tmp_path / "micro"), *map(str, flags)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    output = []
    try:
        for line in proc.stdout:                  # until the banner names the URL
            output.append(line)
            if found := re.search(r"at (http://\S+)/v1/completions", line):
                url = found[1]
                break
        else:
            pytest.fail("decode.py --serve did not start:\n" + "".join(output))
        assert "example: curl " in proc.stdout.readline()
        in_flight = {}
        thread = threading.Thread(target=lambda: in_flight.update(response=httpx.post(
            f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}, timeout=120)))
        thread.start()
        while httpx.get(f"{url}/health").json()["in_flight"] == 0:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        while (health := httpx.get(f"{url}/health")).status_code == 200:
            time.sleep(0.01)
        assert health.json() == {"status": "draining", "in_flight": 1}
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "a"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        thread.join()
        drained = in_flight["response"]
        assert drained.status_code == 200          # whole: 8 tokens, or fewer ending at the end-of-text token
        finish = drained.json()["choices"][0]["finish_reason"]
        assert (drained.json()["usage"]["completion_tokens"], finish) == (8, "length") or finish == "stop"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        proc.kill()
        output.append(proc.communicate()[0])
    assert "draining: new requests get 503" in "".join(output)


def test_serve_flags_out_of_range_are_one_line_errors(capsys):
    assert decode.main(["--serve", "--max-batch", "0"]) == 2
    assert capsys.readouterr().err == "error: --max-batch (max_batch) must be >= 1, got 0\n"
