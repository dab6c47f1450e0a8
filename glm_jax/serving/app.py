"""The Starlette app: POST /v1/completions (OpenAI Completions, streamed or not), GET /v1/models,
GET /health, over an `EngineLoop`.

    app = make_app(engine, tokenizer, model_name="tiny", max_context=1024, stop_token=0)
    uvicorn.run(app)            # or glm_jax.serving.server.serve(...) for the draining shutdown

Each choice (n per prompt, for each prompt listed) is an engine request of its own; their text
is merged as it arrives, each chunk of a stream naming its choice's `index`. A response is whole
once every choice has ended. With echo, a choice's prompt text comes with its first engine
event (in a stream, as a chunk of its own before that event's). With logprobs, each chunk
carries the log-probabilities of the tokens it brought (the echo chunk: the prompt's).

Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`: a bad request 400 (an
error the engine reports for one choice too, while other requests go on; the request's other
choices are cancelled), another model 404, a body too long 413, a server that drains or whose
engine failed 503. A client that disconnects has every engine request of its request cancelled.
A stream waits for the first engine event of any of its choices before it sends the headers, so
a request the engine refuses (all its choices alike, e.g. a prompt too long for the page pool)
still gets a 400; a choice refused after that ends the stream with an error event.

A request body may be `max_body_bytes(max_context)` bytes long: room for MAX_PROMPTS prompts of
32 bytes per token of the context, plus 16 KiB for the other fields (a 1024-token context takes
528 KiB). A longer one gets 413, its message giving the limit in bytes; it is refused by its
Content-Length before any of it is read, or, sent without one (chunked), as soon as the bytes
read pass the limit. Nothing of it is tokenized. Within it, a prompt string longer than 32 bytes
per token of the context gets 413 too, before any prompt is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Callable, NamedTuple

from glm_jax.extras import require

require("starlette")
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from glm_jax.decoding.engine import Request, TokenLogprob
from glm_jax.serving.engine_loop import EngineFailure, EngineLoop, Ticket
from glm_jax.serving.protocol import (APIError, CompletionRequest, Prompt, body_too_large, choice_body,
                                     completion_body, logprobs_body, max_body_bytes, parse_completion, usage)
from glm_jax.serving.text import Detokenizer, TextStream, token_texts


def make_app(engine, tokenizer, *, model_name: str, max_context: int, stop_token: int | None = None) -> Starlette:
    """engine: a ServingEngine (submit / cancel / step / has_work); tokenizer: a `tokenizers`
    Tokenizer; max_context: the most tokens (prompt + completion) one choice may use;
    stop_token: the end-of-text token id that ends a completion (finish_reason "stop")."""
    engine_loop = EngineLoop(engine)
    texts = _Texts(tokenizer, token_texts(tokenizer))
    created = int(time.time())
    body_limit = max_body_bytes(max_context)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_loop.start()
        yield
        engine_loop.stop_accepting()
        await asyncio.to_thread(engine_loop.close)

    async def completions(http: HTTPRequest):
        body = await _body_within(http, body_limit, max_context)
        if not engine_loop.accepting:      # checked after the last await before the submission
            raise APIError(503, "the server is shutting down and takes no new requests", type="server_error",
                           code="shutting_down")
        req = parse_completion(body, tokenizer, model_name=model_name, max_context=max_context)
        completion = _Completion(engine_loop, req, texts, stop_token, model_name)
        response = None
        try:
            async with _client_gone_cancels(http):
                if not req.stream:
                    return JSONResponse(await completion.whole())
                first = await completion.next_piece()      # before the headers: an error is still a 400
            response = _TicketStream(completion.stream(first), completion.close)
            return response
        finally:
            if response is None:
                completion.close()

    async def models(_):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "glm-jax", "max_model_len": max_context}]})

    async def health(_):
        if engine_loop.failure is not None:
            return JSONResponse({"status": "failed", "error": str(engine_loop.failure)}, status_code=503)
        if not engine_loop.accepting:
            return JSONResponse({"status": "draining", "in_flight": engine_loop.in_flight}, status_code=503)
        return JSONResponse({"status": "ok", "in_flight": engine_loop.in_flight})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"]),
                            Route("/health", health, methods=["GET"])],
                    exception_handlers={APIError: _api_error, HTTPException: _http_error,
                                        EngineFailure: _engine_failure, ClientDisconnect: _client_gone,
                                        Exception: _internal_error},
                    lifespan=lifespan)
    app.state.engine_loop = engine_loop
    return app


class _Texts(NamedTuple):
    tokenizer: object
    token_text: Callable[[int], str]    # a token's own text (`token_texts`)


class _Piece(NamedTuple):
    choice: _Choice
    text: str
    finish_reason: str | None           # None until the choice's last piece, then "length" or "stop"
    logprobs: dict | None = None        # its tokens' (`logprobs_body`), when the request asked


class _Logprobs:
    """A choice's log-probabilities in OpenAI's form, built token by token; `take()` gives the
    entries added since the last take (a stream chunk's), `whole()` all of them."""

    def __init__(self, token_text: Callable[[int], str]):
        self.token_text = token_text
        self.lists: tuple[list, list, list, list] = ([], [], [], [])   # tokens, logprobs, top, offsets
        self.taken = 0

    def add(self, token: int, scored: TokenLogprob | None, offset: int) -> None:
        """One token at character `offset` of the choice's text; scored None: nothing to score it
        against (the prompt's first token)."""
        tokens, logprobs, tops, offsets = self.lists
        tokens.append(self.token_text(token))
        logprobs.append(None if scored is None else scored.logprob)
        tops.append(None if scored is None else self._top(token, scored))
        offsets.append(offset)

    def _top(self, token: int, scored: TokenLogprob) -> dict[str, float]:
        """The most likely tokens' log-probs, most likely first, then the token's own if it is not
        among them (as OpenAI: up to N + 1). Two tokens of the same text keep the likelier's."""
        top: dict[str, float] = {}
        for other, logprob in scored.top:
            top.setdefault(self.token_text(other), logprob)
        if all(other != token for other, _ in scored.top):
            top.setdefault(self.token_text(token), scored.logprob)
        return top

    def take(self) -> dict:
        body = logprobs_body(*(entries[self.taken:] for entries in self.lists))
        self.taken = len(self.lists[0])
        return body

    def whole(self) -> dict:
        return logprobs_body(*(list(entries) for entries in self.lists))


class _Choice:
    """One completion of one prompt: its engine request, its text so far, its token count, its
    log-probabilities when asked for."""

    def __init__(self, index: int, prompt: Prompt, ticket: Ticket, texts: _Texts, req: CompletionRequest):
        self.index, self.prompt, self.ticket, self.echo = index, prompt, ticket, req.echo
        self.text = TextStream(texts.tokenizer, req.stop)
        self.texts = texts
        self.logprobs = None if req.logprobs is None else _Logprobs(texts.token_text)
        self.started = False                # its first engine event arrived
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def next_pieces(self) -> list[_Piece]:
        """The pieces of the choice's next engine event: with echo, on the first event, its prompt
        text first; then the event's text. Raises APIError if the engine refused the choice."""
        event = await self.ticket.next_event()
        if event.error is not None:
            raise APIError(400, event.error, code="request_refused")
        pieces = []
        if not self.started and self.echo:
            pieces.append(self._echo_piece(event.prompt_logprobs))
        self.started = True
        pieces.append(self._event_piece(event.tokens, event.logprobs, event.finished))
        return pieces

    def _echo_piece(self, scored: list[TokenLogprob] | None) -> _Piece:
        """The prompt's text and, with logprobs, its tokens' (scored: tokens 1..P-1)."""
        if self.logprobs is None:
            return _Piece(self, self.prompt.echo, None)
        detokenizer, offset = Detokenizer(self.texts.tokenizer), 0
        for token, token_scored in zip(self.prompt.ids.tolist(), [None, *scored]):
            self.logprobs.add(token, token_scored, offset)
            offset += len(detokenizer.push([token]))
        return _Piece(self, self.prompt.echo, None, self.logprobs.take())

    def _event_piece(self, tokens: list[int], scored: list[TokenLogprob] | None, finished: bool) -> _Piece:
        self.completion_tokens += len(tokens)
        text = self.text.push(tokens) if self.logprobs is None else self._push_scored(tokens, scored)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif finished:
            text += self.text.flush()
            self.finish_reason = "length" if self.completion_tokens >= self.prompt.max_tokens else "stop"
        return _Piece(self, text, self.finish_reason, None if self.logprobs is None else self.logprobs.take())

    def _push_scored(self, tokens: list[int], scored: list[TokenLogprob]) -> str:
        """The tokens' text, one token at a time, each token's log-probs recorded at the offset
        where its text starts; tokens after the one that completes a stop string are left out."""
        text, start = "", len(self.prompt.echo)
        for token, token_scored in zip(tokens, scored):
            if self.text.stopped:
                break
            self.logprobs.add(token, token_scored, start + self.text.decoded)
            text += self.text.push([token])
        return text

    def logprobs_body(self) -> dict | None:
        return None if self.logprobs is None else self.logprobs.whole()


class _Completion:
    """One HTTP request's way through the engine: an engine request per choice, their pieces of
    text merged in the order they arrive."""

    def __init__(self, engine_loop: EngineLoop, req: CompletionRequest, texts: _Texts, stop_token,
                 model_name: str):
        self.engine_loop, self.req, self.model_name = engine_loop, req, model_name
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices: list[_Choice] = []
        self.pumps: list[asyncio.Task] = []
        self.pieces: asyncio.Queue = asyncio.Queue()        # _Piece, or the exception that ended a choice
        try:
            for index, (prompt, seed) in enumerate(req.choices()):
                ticket = engine_loop.submit(Request(
                    prompt=prompt.ids, max_new_tokens=prompt.max_tokens, sampling=req.sampling, stop_token=stop_token,
                    seed=seed, logprobs=req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None))
                self.choices.append(_Choice(index, prompt, ticket, texts, req))
        except EngineFailure:               # the engine stopped: give back the choices submitted before
            self.close()
            raise
        self.unfinished = len(self.choices)
        self.pumps = [asyncio.create_task(self._pump(choice)) for choice in self.choices]

    async def _pump(self, choice: _Choice) -> None:
        """Moves the choice's pieces to `pieces`, then the error that ended it, if one did."""
        try:
            while choice.finish_reason is None:
                for piece in await choice.next_pieces():
                    self.pieces.put_nowait(piece)
        except Exception as e:
            self.pieces.put_nowait(e)

    async def next_piece(self) -> _Piece | None:
        """The next piece of text of any choice; None once every choice has ended. Raises the
        error (APIError, EngineFailure) that ended a choice."""
        if self.unfinished == 0:
            return None
        piece = await self.pieces.get()
        if isinstance(piece, Exception):
            raise piece
        if piece.finish_reason is not None:
            self.unfinished -= 1
        return piece

    async def whole(self) -> dict:
        texts = [[] for _ in self.choices]
        while (piece := await self.next_piece()) is not None:
            texts[piece.choice.index].append(piece.text)
        return completion_body(self.id, self.created, self.model_name,
                               [choice_body(c.index, "".join(texts[c.index]), c.finish_reason, c.logprobs_body())
                                for c in self.choices], usage=self._usage())

    async def stream(self, first: _Piece):
        """Server-sent events: a chunk per piece that brought text or tokens (each choice's echo
        first), each choice's last one with its finish_reason, the usage chunk if asked for,
        then [DONE]. An error mid-stream is sent as an error event."""
        extra = {"usage": None} if self.req.include_usage else {}
        try:
            piece = first
            while piece is not None:
                if piece.text or piece.finish_reason or (piece.logprobs and piece.logprobs["tokens"]):
                    yield self._chunk(piece, extra)
                piece = await self.next_piece()
        except (APIError, EngineFailure) as e:
            yield _sse(_error_of(e).body())
        else:
            if self.req.include_usage:
                yield _sse(completion_body(self.id, self.created, self.model_name, [], usage=self._usage()))
        yield "data: [DONE]\n\n"

    def _chunk(self, piece: _Piece, extra: dict) -> str:
        choices = [choice_body(piece.choice.index, piece.text, piece.finish_reason, piece.logprobs)]
        return _sse(completion_body(self.id, self.created, self.model_name, choices, **extra))

    def _usage(self) -> dict:
        """Each prompt's tokens counted once, as OpenAI does, and every choice's completion tokens."""
        return usage(sum(len(prompt.ids) for prompt in self.req.prompts),
                     sum(choice.completion_tokens for choice in self.choices))

    def close(self) -> None:
        """Stops the pumps and cancels every choice still running in the engine."""
        for pump in self.pumps:
            pump.cancel()
        for choice in self.choices:
            self.engine_loop.finish(choice.ticket)


class _TicketStream(StreamingResponse):
    """An SSE response that, however it ends (done, client gone, error), closes its request's choices."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _body_within(http: HTTPRequest, limit: int, max_context: int) -> bytes:
    """The request body, or 413 as soon as it is known to be longer than `limit` bytes: from its
    Content-Length before a byte is read, else once the bytes read pass the limit. A client that
    disconnects meanwhile raises ClientDisconnect."""
    declared = http.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > limit:
        raise body_too_large(limit, max_context)
    chunks, size = [], 0
    async with contextlib.aclosing(http.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit, max_context)
            chunks.append(chunk)
    return b"".join(chunks)


@contextlib.asynccontextmanager
async def _client_gone_cancels(http: HTTPRequest):
    """Within: the client disconnecting cancels the work, which ends in ClientDisconnect. The
    request body must have been read before."""
    task = asyncio.current_task()
    gone = False

    async def watch():
        nonlocal gone
        while (await http.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientDisconnect() from None
        raise
    finally:
        watcher.cancel()


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _error_of(e: Exception) -> APIError:
    if isinstance(e, EngineFailure):
        return APIError(503, str(e), type="server_error", code="engine_failed")
    return e


async def _api_error(_, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _engine_failure(_, e: EngineFailure):
    return await _api_error(_, _error_of(e))


async def _client_gone(_, e: ClientDisconnect):
    return Response(status_code=499)          # nobody reads it: the client closed the request


async def _http_error(_, e: HTTPException):
    return JSONResponse(APIError(e.status_code, e.detail, code=str(e.status_code)).body(),
                        status_code=e.status_code, headers=e.headers)


async def _internal_error(_, e: Exception):
    return await _api_error(_, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
