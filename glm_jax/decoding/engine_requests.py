"""The serving engine's requests and what it reports: `Request`, `Event` (tokens since the last
event, with their log-probabilities if asked), `Result`, `StepTime`; and its host bookkeeping of
each request (`Run`), of the calls in flight (`Launched`, `ScoredChunk`) and of the log-probs it
reads back (`token_logprob`, `record_prompt_scores`, `merged_events`). See `engine`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from glm_jax.decoding.sampling import GREEDY, SamplingParams
from glm_jax.decoding.slots import MAX_LOGPROBS, Scores
from glm_jax.multihost import to_host


@dataclasses.dataclass
class Request:
    prompt: np.ndarray                  # int32 [P]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY   # per request
    stop_token: int | None = None
    seed: int = 0                       # the request's sampling stream: same seed -> same tokens
    logprobs: int | None = None         # k in [0, MAX_LOGPROBS]: report each token's log-prob and the k best (None: no)
    prompt_logprobs: bool = False       # with logprobs: the prompt tokens' too (in the first event)


def checked_prompt(rid: int, request: Request, vocab_size: int) -> np.ndarray:
    """The request's prompt as int32 [P], after checking its fields (a ValueError or TypeError
    naming request `rid` and the field); whether it fits the context and the pool is the engine's
    to check."""
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or (prompt.size and not np.issubdtype(prompt.dtype, np.integer)):
        raise ValueError(f"request {rid}: the prompt must be a 1-D sequence of token ids, got shape "
                         f"{prompt.shape} of {prompt.dtype}")
    if prompt.size and (prompt.min() < 0 or prompt.max() >= vocab_size):
        raise ValueError(f"request {rid}: token ids must be in [0, {vocab_size}), got "
                         f"{int(prompt.min())}..{int(prompt.max())}")
    if not isinstance(request.max_new_tokens, (int, np.integer)) or request.max_new_tokens < 1:
        raise ValueError(f"request {rid}: max_new_tokens must be an integer >= 1, got {request.max_new_tokens!r}")
    if not isinstance(request.sampling, SamplingParams):
        raise TypeError(f"request {rid}: sampling must be a SamplingParams, got {type(request.sampling).__name__}")
    if request.logprobs is not None and not (isinstance(request.logprobs, (int, np.integer))
                                             and 0 <= request.logprobs <= MAX_LOGPROBS):
        raise ValueError(f"request {rid}: logprobs must be None or an integer from 0 to {MAX_LOGPROBS}, got "
                         f"{request.logprobs!r}")
    if request.prompt_logprobs and request.logprobs is None:
        raise ValueError(f"request {rid}: prompt_logprobs needs logprobs (how many alternatives to report)")
    return prompt.astype(np.int32)


class TokenLogprob(NamedTuple):
    """One position's log-probabilities under the model (log_softmax of the raw logits, before
    temperature and the sampling filters)."""

    logprob: float                      # the position's token's (drawn, or the prompt's)
    top: tuple[tuple[int, float], ...]  # (token id, log-prob) of the k most likely tokens, most likely first


@dataclasses.dataclass
class Event:
    request_id: int
    tokens: list[int]                   # tokens emitted since the last event for this request
    finished: bool
    error: str | None = None            # set (and finished=True) when the request failed alone
    logprobs: list[TokenLogprob] | None = None          # one per token of `tokens`, if the request asked
    prompt_logprobs: list[TokenLogprob] | None = None   # in the first event, if asked: prompt tokens 1..P-1


@dataclasses.dataclass
class Result:
    tokens: list[int] | None = None     # new tokens (up to max_new_tokens, cut at the stop token)
    error: str | None = None


class StepTime(NamedTuple):
    """One engine step's timing, per decode call (a NamedTuple: cheap to build once per step)."""

    context: int          # longest sequence among the decoding slots before the call
    host_s: float         # the step's host work: wall time minus the time blocked on the device
    step_s: float         # the step's wall time (with overlap, about one device call)
    rows: int = 0         # slots that drew a token in the call
    prefill: int = 0      # prompt tokens prefilled in the step (before its decode call)
    cpu_s: float = 0.0    # CPU time of the engine's thread in the step (host work; blocking waits excluded)
    steps: int = 1        # decode steps the call ran (a block: decode_steps)


@dataclasses.dataclass(eq=False)
class Run:
    """One request inside the engine (host bookkeeping)."""

    id: int
    request: Request
    context: np.ndarray                  # int32 [T]: what to prefill (prompt + tokens emitted before a preemption)
    emitted: list[int] = dataclasses.field(default_factory=list)   # tokens read back so far
    slot: int | None = None
    order: int = 0                       # admission number: the highest is the youngest
    prefilled: int = 0                   # context tokens in the cache
    length: int = 0                      # cache rows once the dispatched steps have run
    drawn: int = 0                       # tokens drawn, counting steps in flight
    synced_pages: int = 0                # pages the device's page-table row holds
    scored: int = 0                      # prompt positions whose log-probs are dispatched (prompt_logprobs)
    prompt_scores: list[TokenLogprob] = dataclasses.field(default_factory=list)   # read back so far
    stopped: bool = False                # drew its stop token (seen on read-back)
    gone: bool = False                   # finished or cancelled: tokens still in flight are dropped

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.prefilled == len(self.context)

    @property
    def draws(self) -> bool:
        """Takes part in the next decode call."""
        return self.decoding and not self.stopped and self.drawn < self.request.max_new_tokens

    def steps_in(self, steps: int) -> int:
        """The steps it runs of a call of `steps` decode steps: as many as it has tokens left to draw."""
        return min(steps, self.request.max_new_tokens - self.drawn)

    def wants_prompt_scores(self, end: int) -> bool:
        """Whether a prefill chunk ending at context position `end` scores prompt positions not
        scored yet (positions 0..P-2: the logits at position i score prompt token i + 1)."""
        return self.request.prompt_logprobs and self.scored < min(end, len(self.request.prompt) - 1)


@dataclasses.dataclass
class ScoredChunk:
    """A prefill chunk dispatched with targets to score: its Scores [R, C] on the device and,
    per scored row, (row, run, first context position of the chunk, tokens in the chunk)."""

    scores: Scores
    rows: list[tuple[int, Run, int, int]]


@dataclasses.dataclass
class Launched:
    """A decode call in flight: what `_drain` reads back."""

    draws: jax.Array                     # int32 [B, S, 2 + 2K]: the drawn tokens and their Scores (`pack_draws`)
    runs: list[tuple[int, Run, int]]    # (slot, run, steps it ran) of each slot that drew
    logprobs: bool                       # some drawing request asked for log-probs
    scored_chunks: list[ScoredChunk]    # prefill chunks scored since the previous decode call


def scores_to_host(scores: Scores) -> Scores:
    return Scores(*(to_host(x) for x in scores))


def token_logprob(scores: Scores, index, k: int) -> TokenLogprob:
    """The TokenLogprob at `index` of host Scores, with its k most likely tokens."""
    top = zip(scores.top_ids[index][:k].tolist(), scores.top_logprobs[index][:k].tolist())
    return TokenLogprob(float(scores.logprob[index]), tuple(top))


def record_prompt_scores(scores: Scores, rows: list[tuple[int, Run, int, int]]) -> None:
    """A scored prefill chunk's host Scores [R, C] -> each row's run's prompt_scores, in order:
    position i (the logits after context token i) scores prompt token i + 1."""
    for row, run, start, n in rows:
        end = min(start + n, len(run.request.prompt) - 1)
        for position in range(max(start, len(run.prompt_scores)), end):
            run.prompt_scores.append(token_logprob(scores, (row, position - start), run.request.logprobs))


def merged_events(events: list[Event]) -> list[Event]:
    """One event per request: tokens (and log-probs) concatenated in order, finished / error from
    the last, prompt log-probs from the one that has them. `events` itself when no request has
    two (the usual step)."""
    if len({e.request_id for e in events}) == len(events):
        return events
    out: dict[int, Event] = {}
    for e in events:
        prev = out.get(e.request_id)
        if prev is None:
            out[e.request_id] = dataclasses.replace(e, tokens=list(e.tokens))
            continue
        logprobs = None if prev.logprobs is None and e.logprobs is None else (prev.logprobs or []) + (e.logprobs or [])
        prompt_logprobs = prev.prompt_logprobs if prev.prompt_logprobs is not None else e.prompt_logprobs
        out[e.request_id] = Event(e.request_id, prev.tokens + e.tokens, e.finished, e.error, logprobs, prompt_logprobs)
    return list(out.values())
