"""The OpenAI Completions protocol: a request body in -> `CompletionRequest`, or an `APIError`
naming the field; the JSON bodies the server sends back.

Supported request fields (anything else is refused with 400, naming the field):

    model        str, optional: must be the served model's name (else 404)
    prompt       str, a list of token ids, or a list of up to MAX_PROMPTS of either
    n            int in [1, MAX_N] (default 1): completions per prompt
    echo         bool (default false): each completion's text starts with its prompt's text
    max_tokens   int >= 1 (default 16; null: up to the end of the context), for each prompt
    temperature  number >= 0 (default 1; 0 = greedy), top_p in (0, 1] (default 1),
    top_k        int >= 0 (default 0 = off), min_p in [0, 1) (default 0 = off)
    seed         int in [0, 2**32) (default: a random one); choice j of a prompt draws with seed + j
    stop         str or a list of up to 4 non-empty str: the text ends before the first one
    stream       bool; stream_options {"include_usage": bool}
    logprobs     null (default) or int in [0, MAX_LOGPROBS]: each choice's "logprobs" (`logprobs_body`)
    best_of      null or n only;  suffix null only;
    presence_penalty, frequency_penalty 0 only;  logit_bias empty only;  user (ignored)

The response's choices are prompt-major: choice i * n + j is completion j of prompt i.

With `logprobs` N, each choice's "logprobs" is OpenAI's legacy object, one entry per token:
{"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]}.
The log-probabilities are the model's (log_softmax of its raw logits, before temperature and the
sampling filters); top_logprobs holds the N most likely tokens, most likely first, and the
token itself after them if it is not among them (so up to N + 1 entries). With echo the prompt's
tokens come first, the first of them with null token_logprobs and top_logprobs. text_offset is
where each token's text starts in the choice's text (echo included).

A body longer than `max_body_bytes(max_context)` is refused with 413 (the app reads no further),
and so is a prompt string longer than `max_prompt_bytes(max_context)` (it is not tokenized).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import secrets

import numpy as np

from glm_jax.decoding.slots import MAX_LOGPROBS
from glm_jax.decoding.sampling import SamplingError, SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
SEED_LIMIT = 2 ** 32
#: The most prompts one request may list, and the most completions (n) per prompt: a request
#: runs at most MAX_PROMPTS * MAX_N engine requests.
MAX_PROMPTS = 16
MAX_N = 16

#: Bytes of request body allowed per token of the server's context, for each prompt: 8 times the
#: 4 bytes of text a token holds on average. JSON's \uXXXX escapes (Python's json.dumps writes
#: them by default) take 6 bytes per non-ASCII character, 12 to 18 for a token of 2 or 3 CJK
#: characters; a token id takes at most 8 ("151329, "). So a prompt that fits the context fits the
#: body, unless most of its tokens are longer than 32 bytes (runs of dozens of spaces).
BODY_BYTES_PER_TOKEN = 32
#: Bytes of request body allowed besides the prompts: the sampling fields, up to 4 stop strings
#: and `user`, with room to spare.
BODY_BYTES_BESIDES_PROMPT = 16 * 1024

#: Fields of the OpenAI API this server does not implement, with the one value it accepts.
_ONLY_DEFAULT = {"suffix": None, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}}
_FIELDS = {"model", "prompt", "n", "echo", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stream", "stream_options", "best_of", "logprobs", "user", *_ONLY_DEFAULT}


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: np.ndarray                     # int32 [P]
    max_tokens: int                     # the most tokens each of its completions may have
    echo: str = ""                      # the text its completions start with: its own text with echo


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    seed: int
    n: int = 1                          # completions per prompt
    echo: bool = False
    logprobs: int | None = None         # the most likely tokens to report per position (None: no log-probs)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False         # stream: a last chunk with the usage

    def choices(self) -> list[tuple[Prompt, int]]:
        """(prompt, seed) of each choice, in the response's order: choice i * n + j completes
        prompt i with seed + j, so a prompt's choices differ when they sample, and its choice 0
        is what the prompt sent alone with the same seed gives."""
        return [(prompt, (self.seed + j) % SEED_LIMIT) for prompt in self.prompts for j in range(self.n)]


def max_prompt_bytes(max_context: int) -> int:
    """The longest prompt string (in UTF-8 bytes) a server whose context is `max_context` tokens tokenizes."""
    return max_context * BODY_BYTES_PER_TOKEN


def max_body_bytes(max_context: int) -> int:
    """The longest request body a server whose context is `max_context` tokens reads, in bytes:
    room for MAX_PROMPTS prompts of the whole context."""
    return MAX_PROMPTS * max_prompt_bytes(max_context) + BODY_BYTES_BESIDES_PROMPT


def body_too_large(limit: int, max_context: int) -> APIError:
    return APIError(413, f"the request body is longer than this server's limit of {limit} bytes (room for "
                         f"{MAX_PROMPTS} prompts of its whole {max_context}-token context); shorten the prompts",
                    code="request_too_large")


def parse_completion(body: bytes, tokenizer, *, model_name: str, max_context: int) -> CompletionRequest:
    """A /v1/completions request body -> CompletionRequest; APIError (400, or 404 for another
    model, or 413 for a prompt string too long to tokenize) naming the field that is wrong.
    `max_context`: each prompt + max_tokens must fit in it."""
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
    n = _n(fields)
    echo = fields.get("echo", False)
    if not isinstance(echo, bool):
        raise APIError(400, f"echo must be true or false, got {echo!r}", param="echo")
    prompts = _prompts(fields.get("prompt"), fields.get("max_tokens", DEFAULT_MAX_TOKENS), echo, tokenizer,
                       max_context)
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
    return CompletionRequest(prompts=prompts, sampling=sampling, seed=seed, n=n, echo=echo,
                             logprobs=_logprobs(fields), stop=_stop(fields.get("stop")), stream=stream,
                             include_usage=_include_usage(fields.get("stream_options"), stream))


def _n(fields: dict) -> int:
    n = _integer(fields, "n", 1)
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be from 1 to {MAX_N} (completions per prompt), got {n}", param="n")
    best_of = _integer(fields, "best_of", n)
    if best_of != n:
        raise APIError(400, f"best_of must equal n ({n}) or be null: this server does not generate extra "
                            "completions to pick the best of", param="best_of")
    return n


def _logprobs(fields: dict) -> int | None:
    value = fields.get("logprobs")
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise APIError(400, f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens to report "
                            f"per position; this server's limit is {MAX_LOGPROBS}) or null, got {value!r}",
                       param="logprobs")
    return value


def _prompts(value, max_tokens, echo: bool, tokenizer, max_context: int) -> tuple[Prompt, ...]:
    """The prompt field -> its prompts, each tokenized, checked against the context, with its
    max_tokens and its echo text. A prompt string too long to tokenize is refused with 413
    before any is tokenized."""
    given = _prompt_list(value)
    names = ["the prompt"] if len(given) == 1 else [f"prompt[{i}]" for i in range(len(given))]
    for name, prompt in zip(names, given):
        _check_prompt_bytes(name, prompt, max_context)
    prompts = []
    for name, prompt in zip(names, given):
        ids = _prompt_ids(name, prompt, tokenizer)
        text = (prompt if isinstance(prompt, str) else tokenizer.decode(ids.tolist())) if echo else ""
        prompts.append(Prompt(ids, _max_tokens(name, max_tokens, len(ids), max_context), text))
    return tuple(prompts)


def _prompt_list(value) -> list:
    """The prompt field -> its prompts, each a str or a list (of token ids, checked later)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(t) for t in value)):
        return [value]
    if not (isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value)):
        raise APIError(400, "prompt must be a string, a list of token ids, or a list of strings or of token-id "
                            f"lists, got {value!r:.80}", param="prompt")
    if len(value) > MAX_PROMPTS:
        raise APIError(400, f"a request may list up to {MAX_PROMPTS} prompts, got {len(value)}", param="prompt")
    return value


def _check_prompt_bytes(name: str, prompt: str | list, max_context: int) -> None:
    limit = max_prompt_bytes(max_context)
    if isinstance(prompt, str) and len(prompt.encode()) > limit:
        raise APIError(413, f"{name} is longer than this server's limit of {limit} bytes per prompt (room for its "
                            f"whole {max_context}-token context); shorten it", param="prompt", code="request_too_large")


def _prompt_ids(name: str, prompt: str | list, tokenizer) -> np.ndarray:
    """One prompt, a str or a list of token ids -> int32 [P], P >= 1."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt).ids
    elif all(_is_int(t) for t in prompt):
        vocab = tokenizer.get_vocab_size()
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"{name}: token ids must be in [0, {vocab}), got {bad[0]}", param="prompt")
        ids = prompt
    else:
        raise APIError(400, f"{name} must be a string or a list of token ids", param="prompt")
    if not ids:
        raise APIError(400, f"{name} is empty: give at least one token", param="prompt")
    return np.asarray(ids, np.int32)


def _max_tokens(name: str, value, prompt_tokens: int, max_context: int) -> int:
    room = max_context - prompt_tokens
    if room < 1:
        raise APIError(400, f"{name} has {prompt_tokens} tokens, but this server's context is {max_context} "
                            "tokens, which leaves no room for the completion; shorten the prompt",
                       param="prompt", code="context_length_exceeded")
    if value is None:
        return room
    if not _is_int(value) or value < 1:
        raise APIError(400, f"max_tokens must be an integer >= 1, got {value!r}", param="max_tokens")
    if value > room:
        raise APIError(400, f"{name} has {prompt_tokens} tokens and max_tokens is {value}: {prompt_tokens + value} "
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


def choice_body(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def logprobs_body(tokens: list[str], token_logprobs: list[float | None], top_logprobs: list[dict | None],
                  text_offset: list[int]) -> dict:
    """A choice's (or a stream chunk's) "logprobs": the four lists, one entry per token."""
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def completion_body(completion_id: str, created: int, model: str, choices: list[dict], **extra) -> dict:
    """A whole response (with `usage=`) or one stream chunk: an object "text_completion"."""
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, **extra}
