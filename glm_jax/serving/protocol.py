"""The OpenAI Completions protocol: a request body in -> `CompletionRequest`, or an `APIError`
naming the field; the JSON bodies the server sends back.

Supported request fields (anything else is refused with 400, naming the field):

    model        str, optional: must be the served model's name (else 404)
    prompt       str, a list of one str, a list of token ids, or a list of one list of token ids
    max_tokens   int >= 1 (default 16; null: up to the end of the context)
    temperature  number >= 0 (default 1; 0 = greedy), top_p in (0, 1] (default 1),
    top_k        int >= 0 (default 0 = off), min_p in [0, 1) (default 0 = off)
    seed         int in [0, 2**32) (default: a random one)
    stop         str or a list of up to 4 non-empty str: the text ends before the first one
    stream       bool; stream_options {"include_usage": bool}
    n, best_of   1 only;  echo false only;  logprobs, suffix null only;
    presence_penalty, frequency_penalty 0 only;  logit_bias empty only;  user (ignored)

A body longer than `max_body_bytes(max_context)` is refused with 413 (the app reads no further).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import secrets

import numpy as np

from glm_jax.decoding.sampling import SamplingError, SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
SEED_LIMIT = 2 ** 32

#: Bytes of request body allowed per token of the server's context: 8 times the 4 bytes of text
#: a token holds on average. JSON's \uXXXX escapes (Python's json.dumps writes them by default)
#: take 6 bytes per non-ASCII character, 12 to 18 for a token of 2 or 3 CJK characters; a token
#: id takes at most 8 ("151329, "). So a prompt that fits the context fits the body, unless most
#: of its tokens are longer than 32 bytes (runs of dozens of spaces).
BODY_BYTES_PER_TOKEN = 32
#: Bytes of request body allowed besides the prompt: the sampling fields, up to 4 stop strings
#: and `user`, with room to spare.
BODY_BYTES_BESIDES_PROMPT = 16 * 1024

#: Fields of the OpenAI API this server does not implement, with the one value it accepts.
_ONLY_DEFAULT = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None,
                 "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}
_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stream", "stream_options", "user", *_ONLY_DEFAULT}


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompt: np.ndarray                  # int32 [P]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False         # stream: a last chunk with the usage


def max_body_bytes(max_context: int) -> int:
    """The longest request body a server whose context is `max_context` tokens reads, in bytes."""
    return max_context * BODY_BYTES_PER_TOKEN + BODY_BYTES_BESIDES_PROMPT


def body_too_large(limit: int, max_context: int) -> APIError:
    return APIError(413, f"the request body is longer than this server's limit of {limit} bytes (room for a "
                         f"prompt of its whole {max_context}-token context); shorten the prompt",
                    code="request_too_large")


def parse_completion(body: bytes, tokenizer, *, model_name: str, max_context: int) -> CompletionRequest:
    """A /v1/completions request body -> CompletionRequest; APIError (400, or 404 for another
    model) naming the field that is wrong. `max_context`: prompt + max_tokens must fit in it."""
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(fields).__name__}")
    for name in fields:
        if name not in _FIELDS:
            raise APIError(400, f"unknown field {name!r}", param=name)
    for name, accepted in _ONLY_DEFAULT.items():
        if fields.get(name) is not None and fields[name] != accepted:
            raise APIError(400, f"{name} is not supported by this server (only {json.dumps(accepted)})",
                           param=name)
    model = fields.get("model", model_name)
    if model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    prompt = _prompt_ids(fields.get("prompt"), tokenizer)
    max_tokens = _max_tokens(fields.get("max_tokens", DEFAULT_MAX_TOKENS), len(prompt), max_context)
    try:
        sampling = SamplingParams(temperature=_number(fields, "temperature", 1.0), top_p=_number(fields, "top_p", 1.0),
                                  top_k=_integer(fields, "top_k", 0), min_p=_number(fields, "min_p", 0.0))
    except SamplingError as e:
        raise APIError(400, str(e), param=e.field) from None
    seed = _integer(fields, "seed", None)
    if seed is None:
        seed = secrets.randbelow(SEED_LIMIT)
    elif not 0 <= seed < SEED_LIMIT:
        raise APIError(400, f"seed must be in [0, 2**32), got {seed}", param="seed")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be true or false, got {stream!r}", param="stream")
    return CompletionRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling, seed=seed,
                             stop=_stop(fields.get("stop")), stream=stream,
                             include_usage=_include_usage(fields.get("stream_options"), stream))


def _prompt_ids(prompt, tokenizer) -> np.ndarray:
    """A prompt in any of its accepted forms -> int32 [P], P >= 1."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                   # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt).ids
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        vocab = tokenizer.get_vocab_size()
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[0]}", param="prompt")
        ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
    else:
        raise APIError(400, "prompt must be a string, a list of one string, or a list of token ids",
                       param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
    return np.asarray(ids, np.int32)


def _max_tokens(value, prompt_tokens: int, max_context: int) -> int:
    room = max_context - prompt_tokens
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens, but this server's context is {max_context} "
                            "tokens, which leaves no room for the completion; shorten the prompt",
                       param="prompt", code="context_length_exceeded")
    if value is None:
        return room
    if not _is_int(value) or value < 1:
        raise APIError(400, f"max_tokens must be an integer >= 1, got {value!r}", param="max_tokens")
    if value > room:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens and max_tokens is {value}: {prompt_tokens + value} "
                            f"exceeds this server's context of {max_context} tokens; lower max_tokens to at most "
                            f"{room} or shorten the prompt", param="max_tokens", code="context_length_exceeded")
    return value


def _stop(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if (not isinstance(stops, list) or not 0 < len(stops) <= MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise APIError(400, f"stop must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} non-empty "
                            f"strings, got {value!r}", param="stop")
    return tuple(stops)


def _include_usage(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, f"stream_options must be {{\"include_usage\": true|false}}, got {options!r}",
                       param="stream_options")
    return options.get("include_usage", False)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(fields: dict, name: str, default):
    value = fields.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise APIError(400, f"{name} must be an integer, got {value!r}", param=name)
    return value


def _number(fields: dict, name: str, default: float) -> float:
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise APIError(400, f"{name} must be a number, got {value!r}", param=name)
    return float(value)


# ---------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(completion_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    **extra) -> dict:
    """A whole response (with `usage=`) or one stream chunk: an object "text_completion" of one choice."""
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}], **extra}
