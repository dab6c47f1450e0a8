"""decode.py's tokens are those of the code before the decoding paths shared one runtime:
tests/data/decode_reference.json holds the completions that code wrote for the default model
(checkpoints/default), greedy and seeded at temperature 0.7, plain (one prompt and a batch),
speculative (a batch), through the serving engine (--max-batch) and as the server's engine
decodes them (`serving.engine_setup.build_engine`). Recorded on the CPU with this test's XLA
flags and the jax version named in the file; another version or backend may round
differently, and the test is then skipped. GLM_WRITE_DECODE_REFERENCE=1 writes the file.

Another CPU's vector width (e.g. AVX2 against AVX-512) rounds the bfloat16 model's logits
differently, which can flip a draw that was a near-tie, and after a flipped draw the rest of the
sequence legitimately goes its own way. So the file also holds, per recorded token, how far its
draw was from choosing another token (`margins`, in logits: `NEAR_TIE`) and the completions'
token ids (`token_ids`): an output must equal the recorded one, or its tokens may first differ
from the recorded ones at a token whose draw was within NEAR_TIE of a tie, and are not compared
after it. Where the outputs were recorded they are equal. The served tokens' log-probs
(`logprobs`) are compared to within `LOGPROB_ATOL` too: they catch a change of the model too
small to flip more than near-ties."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
from glm_jax.frontends import decode as frontend
from glm_jax.frontends.decode import DEFAULT_CHECKPOINT

REFERENCE = Path(__file__).parent / "data" / "decode_reference.json"
PROMPTS = ["def f(x):", "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):", "x = [1, 2,"]
MAX_NEW = 10
COMMON = ["--max-new-tokens", str(MAX_NEW), "--prefill-chunk", "16", "--max-len", "96", "--quiet", "--top-k", "40"]
SAMPLINGS = {"greedy": ["--temperature", "0"], "seeded": ["--temperature", "0.7", "--seed", "3"]}
TEMPERATURE = {"greedy": 0.0, "seeded": 0.7}
MODES = {"plain1": (1, ["--speculative", "0"]), "plain": (3, ["--speculative", "0"]),
         "speculative": (3, ["--speculative", "2"]), "max_batch": (3, ["--max-batch", "2"])}
#: How near a tie (in logits: the least change of the logits that changes the draw) a recorded
#: draw must have been for another CPU's vector width (e.g. AVX2 against AVX-512) to flip it.
#: The model computes in bfloat16, so its logits are bfloat16 values (a step is 0.0625 for
#: |logit| in [8, 16)): with the rounding changed (XNNPACK fusions off) the prompts' top-5
#: logits moved by up to 0.0625 and the gap between the two most likely by up to 0.125 (two
#: steps). 0.25 is twice that; a real change of the computation moves the logits by more and
#: flips draws that were not near-ties (the tokens are still compared exactly up to there).
NEAR_TIE = 0.25
#: The served tokens also come with the log-probs the engine reports (log_softmax of the raw
#: logits): each token's own and the LOGPROBS most likely tokens', compared to within
#: LOGPROB_ATOL. With the rounding changed as above they moved by up to 0.12 (0.017 on average);
#: a change of the model too small to flip more than near-ties moves them by more (the routed
#: experts' weights 5% larger: up to 0.37), which the tokens alone would let through.
LOGPROBS = 20
LOGPROB_ATOL = 0.25


def _completions(tmp_path, prompts, flags, monkeypatch) -> tuple[list[str], list[list[int]]]:
    """decode.py's completions of `prompts` -> (their texts as written, their token ids)."""
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    written, write = [], frontend._write_output
    with monkeypatch.context() as m:       # the ids behind the texts: where a text differs, which token did
        m.setattr(frontend, "_write_output", lambda path, prompts, completions, tok: (
            written.append([list(map(int, row)) for row in completions]), write(path, prompts, completions, tok)))
        assert decode.main(["--prompts-file", str(path), "--output", str(out), *COMMON, *flags]) == 0
    assert len(written) == 1
    return [json.loads(line)["completion"] for line in out.read_text().splitlines()], written[0]


def _served() -> dict:
    """The server's engine (build_engine) on the prompts' token ids -> per sampling, (tokens, and
    per token the log-probs the engine reports with it: its own, then the LOGPROBS most likely
    tokens')."""
    from glm_jax.checkpoint import load_model_dir
    from glm_jax.data.tokenizer import load_tokenizer
    from glm_jax.decoding.engine import Request
    from glm_jax.decoding.sampling import SamplingParams
    from glm_jax.serving.engine_setup import build_engine

    model = load_model_dir(DEFAULT_CHECKPOINT)
    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    engine = build_engine(model, slots=2, page_size=16, max_context=96, prefill_chunk=16)
    events, step = [], engine.step      # the log-probs come with the events `serve` steps through
    engine.step = lambda: (lambda stepped: events.extend(stepped) or stepped)(step())
    ids = [np.asarray(tok.encode(p).ids, np.int32) for p in PROMPTS]
    out = {}
    for name, sampling in (("greedy", SamplingParams(temperature=0.0)),
                           ("seeded", SamplingParams(temperature=TEMPERATURE["seeded"], top_k=40))):
        events.clear()
        results = engine.serve([Request(row, MAX_NEW, sampling, None, 3 + i, logprobs=LOGPROBS)
                                for i, row in enumerate(ids)])
        by_request: dict = {}              # request ids count up in the order of the requests
        for event in events:
            tokens, logprobs = by_request.setdefault(event.request_id, ([], []))
            tokens += event.tokens
            logprobs += [[t.logprob, *(p for _, p in t.top)] for t in event.logprobs]
        streams = [by_request[rid] for rid in sorted(by_request)]
        assert [tokens for tokens, _ in streams] == [r.tokens for r in results]
        out[name] = [r.tokens for r in results], [logprobs for _, logprobs in streams]
    return out


def _decoded(tmp_path, monkeypatch) -> tuple[dict, dict, dict]:
    """-> (key -> the outputs: completion texts, or the served token ids; key -> their token ids;
    served key -> the log-probs of `_served`)."""
    got, ids, logprobs = {}, {}, {}
    for mode, (n, flags) in MODES.items():
        for name, sampling in SAMPLINGS.items():
            key = f"{mode}/{name}"
            got[key], ids[key] = _completions(tmp_path, PROMPTS[:n], flags + sampling, monkeypatch)
    for name, (tokens, scores) in _served().items():
        got[f"served/{name}"] = ids[f"served/{name}"] = tokens
        logprobs[f"served/{name}"] = scores
    return got, ids, logprobs


def _first_difference(a: list, b: list) -> int:
    """The first position where token lists a and b differ (the shorter one's end counts)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _assert_recorded_but_for_a_near_tie(key: str, got: list, got_ids: list, want: list, want_ids: list,
                                        margins: list) -> None:
    """Each output equals the recorded one, or their tokens agree up to one whose recorded draw
    was within NEAR_TIE of a tie (and are not compared after it)."""
    assert len(got) == len(want), key
    for row, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        a, b = got_ids[row], want_ids[row]
        first = _first_difference(a, b)
        margin = margins[row][first] if first < len(margins[row]) else math.inf
        assert margin <= NEAR_TIE, (
            f"{key}, sequence {row}: token {first} is {a[first:first + 1]}, recorded {b[first:first + 1]}, whose "
            f"draw was {margin:.3f} logits from a tie (more than NEAR_TIE = {NEAR_TIE}): {g!r} != {w!r}")


def _assert_logprobs_recorded(key: str, got_ids: list, got: list, want_ids: list, want: list) -> None:
    """The served tokens' log-probs (their own and the most likely tokens') are the recorded ones to
    within LOGPROB_ATOL, at every token before the first that differs from the recorded one."""
    assert len(got) == len(want), key
    for row, (a, b, g, w) in enumerate(zip(got_ids, want_ids, got, want)):
        n = _first_difference(a, b)
        assert len(g) >= n and len(w) >= n, (key, row)
        np.testing.assert_allclose(g[:n], w[:n], rtol=0, atol=LOGPROB_ATOL, err_msg=f"{key}, sequence {row}")


def test_decode_outputs_are_those_of_the_code_before(tmp_path, monkeypatch):
    got, ids, logprobs = _decoded(tmp_path, monkeypatch)
    if os.environ.get("GLM_WRITE_DECODE_REFERENCE"):
        margins = _recorded_margins(tmp_path, monkeypatch, ids)
        REFERENCE.write_text(_reference_text({
            "jax": jax.__version__, "backend": jax.default_backend(), **got,
            "token_ids": {key: ids[key] for key in got if not key.startswith("served/")}, "margins": margins,
            "logprobs": {key: [[[round(x, 4) for x in position] for position in row] for row in rows]
                         for key, rows in logprobs.items()}}))
    want = json.loads(REFERENCE.read_text())
    if (want["jax"], want["backend"]) != (jax.__version__, jax.default_backend()):
        pytest.skip(f"outputs recorded with jax {want['jax']} on {want['backend']}")
    for key, value in got.items():
        want_ids = want["token_ids"].get(key, want[key])
        _assert_recorded_but_for_a_near_tie(key, value, ids[key], want[key], want_ids, want["margins"][key])
        if key in logprobs:
            _assert_logprobs_recorded(key, ids[key], logprobs[key], want_ids, want["logprobs"][key])


# ---------------------------------------------------------------- recording the margins
# Only with GLM_WRITE_DECODE_REFERENCE=1: every decoding path runs again with its draws watched
# (jax.debug.callback from wrappers of the functions that draw), and must draw the same tokens.
# A margin is in logits: a greedy draw's is the gap between the two largest logits; a sampled
# draw's (argmax of Gumbel noise + tempered logits, or an acceptance test u * q < p) is its gap
# in tempered units times the temperature.

def _gap(x):
    """[..., V] -> [...]: the largest value minus the second largest."""
    top = jax.lax.top_k(x, 2)[0]
    return top[..., 0] - top[..., 1]


def _gumbel_gap(key, x):
    """The draw `jax.random.categorical(key, x, axis=-1)` makes (argmax of Gumbel noise + x; one
    key, or [B] keys one per row as `sample_tokens` takes them) -> (its gap, in x's units; the
    draw, to check that this is the noise it used)."""
    if key.ndim == 1 and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        noisy = x + jax.vmap(lambda k, row: jax.random.gumbel(k, row.shape, row.dtype))(key, x)
    else:
        noisy = x + jax.random.gumbel(key, x.shape, x.dtype)
    return _gap(noisy), jnp.argmax(noisy, axis=-1).astype(jnp.int32)


def _watched(monkeypatch, calls: list):
    """Wraps the functions the decoding paths draw with, so that each draw appends (kind, numpy
    values) to `calls`."""
    from glm_jax.decoding import engine_programs, generate, speculative
    from glm_jax.decoding.sampling import filtered_logits

    def emit(kind, *values):
        jax.debug.callback(lambda *v: calls.append((kind, *map(np.asarray, v))), *values, ordered=True)

    def sample_tokens(original, kind):        # the plain generator's and the engine's draws
        def watched(logits, key, params):
            token = original(logits, key, params)
            t = jnp.broadcast_to(jnp.asarray(params.temperature, jnp.float32), token.shape)
            gap, drawn = _gumbel_gap(key, filtered_logits(logits, params))
            keys = jax.random.key_data(key)
            emit(kind, token, jnp.where(t > 0, drawn, token), jnp.where(t > 0, gap * t, _gap(logits)),
                 jnp.broadcast_to(keys, token.shape + keys.shape[-1:]), t)
            return token
        return watched

    def sampling_probs(logits, sampling):     # speculative: greedy draws are argmaxes of these logits
        emit("probs", jnp.where(jnp.asarray(sampling.temperature) > 0, jnp.inf, _gap(logits)))
        return speculative_probs(logits, sampling)

    def draw(key, probs):                     # speculative: the first token and the drafts
        token = speculative_draw(key, probs)
        gap, drawn = _gumbel_gap(key, jnp.log(probs))
        emit("draw", token, drawn, gap)
        return token

    def verify(target_probs, draft_probs, draft_tokens, key):
        tokens, accepted = speculative_verify(target_probs, draft_probs, draft_tokens, key)
        # rejection_sample's random numbers again: the acceptance tests u * q(x) < p(x), then the
        # corrected (or bonus) token drawn from the residual max(0, p - q) (p where that is 0)
        b, k = draft_tokens.shape
        accept_key, resample_key = jax.random.split(key)
        u = jax.random.uniform(accept_key, (b, k))
        p = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
        q = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
        q_ext = jnp.concatenate([draft_probs, jnp.zeros((b, 1, draft_probs.shape[-1]), draft_probs.dtype)], axis=1)
        at = jnp.take_along_axis(jnp.maximum(target_probs - q_ext, 0.0), accepted[:, None, None], axis=1)[:, 0]
        at = jnp.where(jnp.sum(at, -1, keepdims=True) > 0, at,
                       jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0])
        gap, drawn = _gumbel_gap(resample_key, jnp.log(at))
        emit("verify", tokens, accepted, u * q < p, jnp.abs(jnp.log(u * q) - jnp.log(p)), drawn, gap)
        return tokens, accepted

    speculative_probs, speculative_draw = speculative.sampling_probs, speculative._sample
    speculative_verify = speculative.rejection_sample
    monkeypatch.setattr(generate, "sample_tokens", sample_tokens(generate.sample_tokens, "plain"))
    monkeypatch.setattr(engine_programs, "sample_tokens", sample_tokens(engine_programs.sample_tokens, "engine"))
    monkeypatch.setattr(speculative, "sampling_probs", sampling_probs)
    monkeypatch.setattr(speculative, "_sample", draw)
    monkeypatch.setattr(speculative, "rejection_sample", verify)


def _plain_margins(calls, rows: int, t: float) -> list[list[float]]:
    """One generator run's draws: step i draws token i of every row."""
    draws = [c for c in calls if c[0] == "plain"]
    assert all((token == drawn).all() and (temperature == np.float32(t)).all()
               for _, token, drawn, _, _, temperature in draws)
    return [[float(margin[r]) for _, _, _, margin, _, _ in draws[:MAX_NEW]] for r in range(rows)]


def _engine_margins(calls, ids: list[list[int]], first_seed: int, t: float) -> list[list[float]]:
    """One engine run's draws (at temperature t): row b's key is fold_in(key(seed), n) for its
    request's seed and token n; a slot with no request draws too (greedy, from zero logits), and a
    slot past its steps draws its next token again (the same draw), so a token's draws are those
    of its key and temperature that drew it."""
    stream = {tuple(np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(s), n)))): (s, n)
              for s in range(first_seed, first_seed + len(ids)) for n in range(MAX_NEW)}
    found: dict = {}
    for _, token, drawn, margin, keys, temperature in (c for c in calls if c[0] == "engine"):
        assert (token == drawn).all()
        for r in range(len(token)):
            s, n = stream.get(tuple(keys[r]), (None, None))
            if s is not None and temperature[r] == np.float32(t) and n < len(ids[s - first_seed]) \
                    and token[r] == ids[s - first_seed][n]:
                found[s, n] = min(found.get((s, n), math.inf), float(margin[r]))
    return [[found[first_seed + i, n] for n in range(len(row))] for i, row in enumerate(ids)]


def _speculative_margins(calls, rows: int, t: float, k: int = 2) -> list[list[float]]:
    """One speculative run's draws: the first token, then per verify step K drafts and the
    verification, which emits tokens count .. count + accepted of each row still decoding. Every
    draw of a step may change all the tokens it emits: each gets the least margin among them
    (greedy: the target's argmaxes at the emitted positions; the drafts only change how many)."""
    calls = [c for c in calls if c[0] in ("probs", "draw", "verify")]
    (_, probs), (_, first, drawn, gap) = calls[:2]
    assert (first == drawn).all()
    margins = [[float(probs[r]) if t == 0 else float(gap[r]) * t] for r in range(rows)]
    step: list = []
    for call in calls[2:]:
        step.append(call)
        if call[0] != "verify":
            continue
        drafts = [c for c in step if c[0] == "draw"]
        (_, target_gaps), (_, tokens, accepted, passed, accept_gaps, drawn, gap) = step[-2:]
        assert len(drafts) == k and target_gaps.shape == (rows, k + 1) and all((d[1] == d[2]).all() for d in drafts)
        for r in range(rows):
            a = int(accepted[r])
            assert a == int(np.cumprod(passed[r]).sum()) and drawn[r] == tokens[r, a]
            if len(margins[r]) >= MAX_NEW:
                continue
            if t == 0:
                m = float(target_gaps[r, :a + 1].min())
            else:
                m = t * float(min(min(d[3][r] for d in drafts), accept_gaps[r, :min(a + 1, k)].min(), gap[r]))
            margins[r] += [m] * (a + 1)
        step = []
    assert not step
    return [row[:MAX_NEW] for row in margins]


def _recorded_margins(tmp_path, monkeypatch, ids: dict) -> dict:
    """Every path again with its draws watched -> key -> per sequence, per token: its margin."""
    from glm_jax.decoding import engine_programs, runtime

    def fresh():        # the programs traced again (with the wrappers, then without them)
        jax.clear_caches()
        runtime._compiled.cache_clear()
        engine_programs.engine_programs.cache_clear()

    margins: dict = {}
    calls: list = []
    fresh()
    try:
        with monkeypatch.context() as m:
            _watched(m, calls)
            for mode, (n, flags) in MODES.items():
                for name, sampling in SAMPLINGS.items():
                    key, t = f"{mode}/{name}", TEMPERATURE[name]
                    calls.clear()
                    _, watched_ids = _completions(tmp_path, PROMPTS[:n], flags + sampling, monkeypatch)
                    jax.effects_barrier()
                    assert watched_ids == ids[key], key
                    margins[key] = (_plain_margins(calls, n, t) if mode.startswith("plain") else
                                    _speculative_margins(calls, n, t) if mode == "speculative" else
                                    _engine_margins(calls, ids[key], 3 if name == "seeded" else 0, t))
            calls.clear()
            served = _served()
            jax.effects_barrier()
            for name in SAMPLINGS:
                tokens, _ = served[name]
                assert tokens == ids[f"served/{name}"], name
                margins[f"served/{name}"] = _engine_margins(calls, tokens, 3, TEMPERATURE[name])
    finally:
        fresh()
    return {key: [[round(m, 4) for m in row] for row in rows] for key, rows in margins.items()}


def _reference_text(record: dict) -> str:
    """The file: as json.dumps(indent=1), but each sequence of `token_ids`, `margins` and `logprobs`
    on one line."""
    lined = ("token_ids", "margins", "logprobs")
    text = json.dumps({k: v for k, v in record.items() if k not in lined}, indent=1)
    extra = [f' "{name}": {{\n' + ",\n".join(
        f'  "{key}": [\n   ' + ",\n   ".join(json.dumps(row) for row in rows) + "\n  ]"
        for key, rows in record[name].items()) + "\n }" for name in lined]
    return text[:-2] + ",\n" + ",\n".join(extra) + "\n}"
