"""SamplingParams: temperature -> top_k -> top_p -> min_p, validation, one program for every
setting, and rejection sampling exact under each filter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode
from glm_jax.decoding import SamplingParams, rejection_sample, sample_tokens, sampling_probs
from glm_jax.decoding.sampling import SamplingError, filtered_logits

PROBS = jnp.log(jnp.array([0.1, 0.4, 0.05, 0.3, 0.15]))     # ranked: 1, 3, 4, 0, 2


def kept(params: SamplingParams, logits=PROBS) -> set[int]:
    return set(np.flatnonzero(np.isfinite(np.asarray(filtered_logits(logits, params)))).tolist())


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), {0, 1, 2, 3, 4}),
    (SamplingParams(temperature=1.0, top_k=2), {1, 3}),
    (SamplingParams(temperature=1.0, top_k=1), {1}),
    (SamplingParams(temperature=1.0, top_p=0.7), {1, 3}),          # mass before token 4: 0.7
    (SamplingParams(temperature=1.0, top_p=0.71), {1, 3, 4}),
    (SamplingParams(temperature=1.0, min_p=0.3), {1, 3, 4}),       # p >= 0.3 * 0.4 = 0.12
    (SamplingParams(temperature=1.0, min_p=0.9), {1}),
    # top_p applies to the distribution top_k left: over {1, 3, 4} the mass before token 4 is
    # 0.7 / 0.85 = 0.82, so 0.8 keeps two tokens (on the whole distribution it would keep three)
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.8), {1, 3}),
    (SamplingParams(temperature=1.0, top_k=4, min_p=0.3, top_p=0.95), {1, 3, 4}),
])
def test_filters(params, expected):
    assert kept(params) == expected


def test_temperature_zero_is_greedy_and_one_program_serves_every_setting():
    logits = jnp.stack([PROBS, PROBS[::-1]])
    fn = jax.jit(sample_tokens)
    greedy = fn(logits, jax.random.key(0), SamplingParams(top_k=3).as_arrays())
    np.testing.assert_array_equal(greedy, [1, 3])
    np.testing.assert_array_equal(sampling_probs(logits, SamplingParams()).argmax(-1), [1, 3])
    for params in (SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=2.0, min_p=0.99)):
        np.testing.assert_array_equal(fn(logits, jax.random.key(1), params.as_arrays()), [1, 3])
    assert fn._cache_size() == 1


def test_per_row_settings_and_keys_equal_each_row_alone_in_one_program():
    logits = jax.random.normal(jax.random.key(3), (3, 50))
    keys = jax.vmap(jax.random.key)(jnp.arange(3))
    fn = jax.jit(lambda logits, keys, params: sample_tokens(logits, keys, params))   # its own program cache
    mixes = [[SamplingParams(), SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=0.7, top_p=0.5)],
             [SamplingParams(temperature=2.0, min_p=0.1), SamplingParams(), SamplingParams(temperature=1.0)]]
    for mix in mixes:
        rows = fn(logits, keys, jax.tree.map(jnp.asarray, SamplingParams.stack(mix)))
        alone = [int(fn(logits[b:b + 1], keys[b:b + 1], p.as_arrays())[0]) for b, p in enumerate(mix)]
        assert rows.tolist() == alone
    assert fn._cache_size() == 2                   # one program per shape, whatever the settings
    stacked = SamplingParams.stack(mixes[0])
    assert stacked.top_k.tolist() == [0, 4, 0] and stacked.temperature.dtype == np.float32
    with pytest.raises(ValueError, match="at least one"):
        SamplingParams.stack([])


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1.0, "temperature must be >= 0 (0 = greedy), got -1.0"),
    ("top_p", 2.0, "top_p must be in (0, 1] (1 = off), got 2.0"),
    ("top_p", 0.0, "top_p must be in (0, 1] (1 = off), got 0.0"),
    ("top_k", -3, "top_k must be an integer >= 0 (0 = off), got -3"),
    ("min_p", 1.0, "min_p must be in [0, 1) (0 = off), got 1.0"),
])
def test_each_field_is_validated_by_name(field, value, message):
    with pytest.raises(SamplingError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "error: --temperature must be >= 0 (0 = greedy), got -1.0"),
    (["--top-p", "2"], "error: --top-p must be in (0, 1] (1 = off), got 2.0"),
    (["--min-p", "1.5"], "error: --min-p must be in [0, 1) (0 = off), got 1.5"),
])
def test_decode_names_the_wrong_sampling_flag(argv, message, capsys):
    assert decode.main(argv) == 2
    assert capsys.readouterr().err.strip() == message


DRAWS = 40_000
TV_TOL = 0.02          # total variation over 8 tokens with 40k draws: standard deviation ~0.006


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=3),
                                    SamplingParams(temperature=1.3, min_p=0.2),
                                    SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05)],
                         ids=["top_k", "min_p", "all"])
def test_rejection_sampling_stays_exact_under_each_filter(params):
    """Drafts drawn from the draft model's filtered distribution and verified against the
    target's: the first emitted token follows the target's filtered distribution exactly."""
    k, v = 2, 8
    kt, kd, ks, kdraw = jax.random.split(jax.random.key(7), 4)
    target = sampling_probs(2.0 * jax.random.normal(kt, (1, k + 1, v)), params)
    draft = sampling_probs(2.0 * jax.random.normal(kd, (1, k, v)), params)
    assert int((target[0, 0] > 0).sum()) < v                       # the filter removed tokens

    def one(dkey, key):
        drafts = jax.random.categorical(dkey, jnp.log(draft[0]), axis=-1).astype(jnp.int32)[None]
        return rejection_sample(target, draft, drafts, key)[0][0, 0]

    first = np.asarray(jax.vmap(one)(jax.random.split(kdraw, DRAWS), jax.random.split(ks, DRAWS)))
    freq = np.bincount(first, minlength=v) / DRAWS
    assert 0.5 * np.abs(freq - np.asarray(target[0, 0])).sum() < TV_TOL
    assert freq[np.asarray(target[0, 0]) == 0].sum() == 0           # nothing outside the filter
