"""Batch-invariant decoding (`KernelChoice(batch_invariant=True)`): a prompt gets the same
logits, bit for bit, and so the same tokens, alone or in a batch, in prefill chunks of any size,
in a speculative verify step or a plain one, and in the serving engine among other requests.

The model is the micro config cut to 2 layers, widened to 128, in bfloat16 with a MoE layer, where the default
path's logits differ between a batch and a prompt alone (checked beside the invariant path's
equalities, so those are not vacuous)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config
from glm_jax import ops
from glm_jax.cache import create_cache
from glm_jax.decoding.engine import Request, ServingEngine
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.sampling import SamplingParams
from glm_jax.decoding.speculative import SpeculativeGenerator
from glm_jax.forward_options import ForwardOptions
from glm_jax.model import GLMModel
from glm_jax.row_chunks import in_row_chunks

INVARIANT = ForwardOptions(kernels=ops.KernelChoice(batch_invariant=True, invariant_rows=16))
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, 97, n).astype(np.int32) for n in (21, 9, 30, 14, 5, 26, 17, 11)]
NEW = 12


@pytest.fixture(scope="module", autouse=True)
def release_programs():
    """This file compiles many programs; the test worker lives on after it."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="module")
def model():
    cfg = micro_config(dtype="bfloat16", max_position_embeddings=128, hidden_size=128, intermediate_size=128,
                       moe_intermediate_size=48, kv_lora_rank=32, q_lora_rank=48, num_hidden_layers=2,
                       index_topk_pattern="FS")
    return GLMModel(cfg, rngs=nnx.Rngs(3))


# ---------------------------------------------------------------- row chunks
def test_in_row_chunks_equals_the_whole_call_and_keeps_shapes():
    x = jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 3)
    pos = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    fn = lambda x, p: {"y": x * 2 + p[..., None], "s": jnp.sum(x, -1)}
    out = in_row_chunks(fn, x, pos, rows=4)          # 10 tokens: 3 chunks, 2 padding rows
    want = fn(x, pos)
    assert out["y"].shape == (2, 5, 3) and out["s"].shape == (2, 5)
    np.testing.assert_array_equal(out["y"], want["y"])
    np.testing.assert_array_equal(out["s"], want["s"])
    assert in_row_chunks(fn, x, pos, rows=None)["y"] is not None


def test_in_row_chunks_refuses_bad_rows_and_mismatched_arrays():
    x = jnp.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="rows must be a positive int"):
        in_row_chunks(lambda x: x, x, rows=0)
    with pytest.raises(ValueError, match=r"\[B, S, \.\.\.\]"):
        in_row_chunks(lambda x, y: x, x, jnp.zeros((2, 4)), rows=4)
    with pytest.raises(ValueError, match="invariant_rows"):
        ops.KernelChoice(batch_invariant=True, invariant_rows=0)
    with pytest.raises(TypeError, match="batch_invariant"):
        ops.KernelChoice(batch_invariant=1)


# ---------------------------------------------------------------- the cached forward, bit for bit
_forward = nnx.jit(lambda model, tokens, cache, options: model.forward_cached(tokens, cache, options=options),
                   static_argnames="options")


def _prefill_then_steps(model, rows, options, chunk: int, steps: int = 3):
    """Prefill rows (equal lengths) in chunks of `chunk`, then `steps` greedy steps
    -> [prefill logits [B, P, V], step logits...] (numpy)."""
    tokens = np.stack(rows)
    cache = create_cache(model.cfg, len(rows), 64)
    parts = []
    for start in range(0, tokens.shape[1], chunk):
        logits, _, cache = _forward(model, jnp.asarray(tokens[:, start:start + chunk]), cache, options)
        parts.append(np.asarray(logits))
    out = [np.concatenate(parts, axis=1)]
    for _ in range(steps):
        nxt = jnp.argmax(jnp.asarray(out[-1])[:, -1], -1).astype(jnp.int32)[:, None]
        logits, _, cache = _forward(model, nxt, cache, options)
        out.append(np.asarray(logits))
    return out


def test_cached_forward_logits_equal_alone_in_a_batch_and_in_any_prefill_chunk(model):
    rows = [p[:9] for p in PROMPTS if len(p) >= 9][:5]
    batch = _prefill_then_steps(model, rows, INVARIANT, chunk=9)
    default = _prefill_then_steps(model, rows, ForwardOptions(), chunk=9)
    differs = False
    for i, row in enumerate(rows):
        for chunk in (9, 4):
            alone = _prefill_then_steps(model, [row], INVARIANT, chunk=chunk)
            for a, b in zip(alone, batch):
                np.testing.assert_array_equal(a[0], b[i])
        default_alone = _prefill_then_steps(model, [row], ForwardOptions(), chunk=9)
        differs |= any(not np.array_equal(a[0], b[i]) for a, b in zip(default_alone, default))
    assert differs, "the default path gave the same bits too: this model no longer tests invariance"


# ---------------------------------------------------------------- generators
def _plain(model, rows, chunk=8):
    gen = Generator(model, batch=len(rows), max_len=64, prefill_chunk=chunk, block_size=8, forward=INVARIANT)
    return np.concatenate(list(gen.generate(list(rows), max_new_tokens=NEW)), axis=1)[:, :NEW]


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy tokens decoded alone (prefill chunks of 4)."""
    return np.stack([_plain(model, [p], chunk=4)[0] for p in PROMPTS])


@pytest.mark.parametrize("batch", [2, 5, 8])
def test_greedy_tokens_equal_alone_in_batches_of_mixed_lengths(model, alone, batch):
    out = np.concatenate([_plain(model, PROMPTS[i:i + batch]) for i in range(0, len(PROMPTS), batch)])
    np.testing.assert_array_equal(out, alone[:len(out)])


@pytest.mark.parametrize("batch,num_draft", [(1, 7), (8, 1), (8, 3)])   # every draft count, both batches
def test_speculative_greedy_equals_plain(model, alone, num_draft, batch):
    gen = SpeculativeGenerator(model, batch=batch, max_len=64, num_draft=num_draft, prefill_chunk=16,
                               forward=INVARIANT)
    out = np.concatenate([gen.generate(list(PROMPTS[i:i + batch]), max_new_tokens=NEW)
                          for i in range(0, len(PROMPTS), batch)])
    np.testing.assert_array_equal(out, alone)


# ---------------------------------------------------------------- serving engine
def _engine(model):
    return ServingEngine(model, slots=8, num_pages=41, page_size=8, max_context=64, prefill_chunk=8,
                         forward=INVARIANT)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)],
                         ids=["greedy", "seeded"])
def test_engine_serves_a_prompt_alone_and_among_seven_arriving_later(model, alone, sampling):
    target = Request(PROMPTS[2], NEW, sampling, seed=11)
    by_itself = _engine(model).serve([target])[0].tokens
    if sampling.temperature == 0:
        assert by_itself == alone[2].tolist()
    engine = _engine(model)
    others = [i for i in range(len(PROMPTS)) if i != 2]
    tokens: dict[int, list[int]] = {}
    target_id, step = None, 0
    while others or target_id is None or engine.has_work():
        if step in (0, 1, 3, 4, 6, 7, 9) and others:       # one more request at each of these steps
            i = others.pop(0)
            engine.submit(Request(PROMPTS[i], NEW, sampling, seed=i))
        if step == 2:
            target_id = engine.submit(target)
        for e in engine.step():
            tokens.setdefault(e.request_id, []).extend(e.tokens)
        step += 1
    assert tokens[target_id] == by_itself


def test_decode_flag_turns_the_mode_on():
    import decode

    assert not decode.decode_config(decode.parse_args([])).forward().kernels.batch_invariant
    assert decode.decode_config(decode.parse_args(["--batch-invariant"])).forward().kernels.batch_invariant
