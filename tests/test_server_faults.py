"""Faults the HTTP server (glm_jax.serving) must answer clearly and survive: a client that sends
half its body, a client that leaves while its prompt is prefilled, a burst of more requests than
the engine's slots and page pool hold.

Each case is bounded in time (a hang fails, it does not block), and ends by checking that the
server is healthy: no request in flight, no request handler still open, no error (traceback)
logged, and a new request completes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

import httpx
import pytest

from glm_jax.decoding.engine import ServingEngine
from glm_jax.serving.app import make_app
from test_server import MULTIBYTE, PROMPTS, TOKENIZER, FakeEngine, connection, micro_model, running, send_head

#: Seconds any one request, or any wait for the server to settle, may take.
TIMEOUT = 30
#: A pool too small for the burst: 2 slots, 6 usable pages of 8 rows (48 rows, the scratch page
#: aside), so two of its requests (33 to 42 rows each) cannot run together and one of 60 rows
#: never can.
SMALL_POOL = dict(slots=2, num_pages=7, page_size=8, max_context=64, prefill_chunk=8)


class OpenHandlers:
    """An ASGI app around `app` that counts the HTTP requests it is handling."""

    def __init__(self, app):
        self.app, self.open = app, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


class LoggedErrors(logging.Handler):
    """The records logged at ERROR or above."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def serving(engine, **app_args):
    """make_app over `engine`, served by uvicorn -> (base URL, the app, its OpenHandlers, the
    errors uvicorn logs). Ends by checking that the server is healthy."""
    app = make_app(engine, TOKENIZER, model_name="micro", max_context=SMALL_POOL["max_context"], **app_args)
    handlers = OpenHandlers(app)
    with running(handlers) as url:
        errors = LoggedErrors()
        logger = logging.getLogger("uvicorn.error")     # after uvicorn configured its logging
        logger.addHandler(errors)
        try:
            yield url, app, handlers
            assert_healthy(url, app, handlers, errors)
        finally:
            logger.removeHandler(errors)


def eventually(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"after {TIMEOUT} s, still not {what}"
        time.sleep(0.01)


def assert_healthy(url: str, app, handlers: OpenHandlers, errors: LoggedErrors) -> None:
    eventually(lambda: handlers.open == 0 and app.state.engine_loop.in_flight == 0, "settled")
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok", "in_flight": 0}
    new = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=TIMEOUT)
    assert new.status_code == 200 and new.json()["usage"]["completion_tokens"] >= 1
    assert [r.getMessage() for r in errors.records] == []


def assert_pool_full(engine: ServingEngine) -> None:
    eventually(lambda: not engine.has_work(), "idle")
    assert not engine.pool.held and engine.pool.free_pages() == engine.pool.usable_pages


@pytest.fixture(scope="module")
def small_engine():
    return ServingEngine(micro_model(), **SMALL_POOL)


# ---------------------------------------------------------------------- the cases
def test_a_client_that_sends_half_its_body_and_leaves():
    with serving(FakeEngine(TOKENIZER.encode(MULTIBYTE).ids + [0]), stop_token=0) as (url, app, handlers):
        conn = connection(url)
        send_head(conn, 100, b'{"prompt": "hi", ')               # 17 of the 100 bytes announced
        eventually(lambda: handlers.open == 1, "reading the body")
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok", "in_flight": 0}
        other = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 40}, timeout=TIMEOUT)
        assert other.json()["choices"][0]["text"] == MULTIBYTE      # served while the half body waits
        conn.close()


class PausedAfterFirstStep:
    """The ServingEngine API over `engine`; its first step (admission and the first prefill
    chunk) does not return until `resume` is set."""

    def __init__(self, engine: ServingEngine):
        self.engine = engine
        self.paused, self.resume = threading.Event(), threading.Event()
        self.cancelled: list[int] = []

    def submit(self, request) -> int:
        return self.engine.submit(request)

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)
        self.engine.cancel(request_id)

    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self):
        events = self.engine.step()
        if not self.resume.is_set():
            self.paused.set()
            assert self.resume.wait(TIMEOUT), "never resumed"
        return events


def test_a_client_that_leaves_while_its_prompt_is_prefilled(small_engine):
    engine = PausedAfterFirstStep(small_engine)
    with serving(engine) as (url, app, handlers):
        conn = connection(url)
        body = json.dumps({"prompt": list(range(1, 41)), "max_tokens": 4}).encode()
        send_head(conn, len(body), body)                         # 40 prompt tokens: 5 prefill chunks
        assert engine.paused.wait(TIMEOUT)                       # admitted, 1 chunk prefilled, no token yet
        [request_id] = small_engine.pool.held
        conn.close()
        eventually(lambda: app.state.engine_loop.in_flight == 0, "cancelled by the handler")
        engine.resume.set()
        assert_pool_full(small_engine)
        assert engine.cancelled == [request_id]


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def outcome(response: httpx.Response) -> str:
    """"completed" (a whole response, or a stream to its [DONE] without an error event), or the
    code of an error answered as OpenAI's error JSON."""
    if response.status_code != 200:
        error = response.json()["error"]
        assert response.status_code >= 400 and set(error) == {"message", "type", "param", "code"}
        return error["code"]
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text, response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
    return "completed"


def test_a_burst_past_the_slots_and_the_page_pool(small_engine):
    preempted = small_engine.preemptions
    fitting = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 30, "temperature": 0, "stream": i % 2 == 1}
               for i in range(8)]
    never_fits = {"prompt": list(range(1, 11)), "max_tokens": 50}      # 60 rows: more than the whole pool
    with serving(small_engine) as (url, app, handlers):
        responses = asyncio.run(asyncio.wait_for(post_all(url, [*fitting, never_fits]), TIMEOUT))
        assert [outcome(r) for r in responses] == ["completed"] * 8 + ["request_refused"]
        assert responses[-1].status_code == 400 and "whole pool" in responses[-1].json()["error"]["message"]
        assert small_engine.preemptions > preempted              # the pool was short while they ran
        greedy = {r.json()["choices"][0]["text"] for r, body in zip(responses, fitting)
                  if not body["stream"] and body["prompt"] == PROMPTS[0]}
        assert len(greedy) == 1                                  # preempted or not, the same text
        assert_pool_full(small_engine)
