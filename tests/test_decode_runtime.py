"""One decode runtime behind the generators and the serving engine (`decoding.runtime`): one
prefill program (`decoding.prefill`), one program builder, one stop rule, one cut rule, one stats shape."""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config
from glm_jax.decoding import engine_programs, prefill, programs, runtime
from glm_jax.decoding.engine import Request, ServingEngine
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.runtime import DecodeRuntime, DecodeStats, cut, stops
from glm_jax.decoding.speculative import SpeculativeGenerator
from glm_jax.model import GLMModel

COMPILED = re.compile(r"Finished XLA compilation of jit\((\w+)\)")
#: The programs of a decode (what runs the model), among everything jit compiles (small ops too).
DECODE_PROGRAMS = {"prefill_chunk", "decode_block", "_speculate", "decode"}


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record):
        m = COMPILED.search(record.getMessage())
        if m and m.group(1) in DECODE_PROGRAMS:
            self.names.append(m.group(1))


@pytest.fixture
def compiles(monkeypatch):
    handler = _Compiles()
    logger = logging.getLogger("jax")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    jax.config.update("jax_log_compiles", True)
    yield handler
    jax.config.update("jax_log_compiles", False)
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def model() -> GLMModel:
    """A model of this file's own (configs/tiny.yaml's shape, micro_config): no program is compiled
    for it before the first test, whose decodes' programs the later tests' engines reuse."""
    return GLMModel(micro_config(vocab_size=89), rngs=nnx.Rngs(0))


def test_plain_speculative_and_engine_decodes_share_their_prefill(model, compiles, monkeypatch):
    traced = []
    forward = prefill.chunk_forward

    def spy(model, tokens, cache, num_valid, kernels):
        traced.append(tokens.shape)
        return forward(model, tokens, cache, num_valid, kernels)

    monkeypatch.setattr(prefill, "chunk_forward", spy)
    prompt = np.arange(1, 8, dtype=np.int32)
    plain = Generator(model, max_len=48, prefill_chunk=8, block_size=4)
    spec = SpeculativeGenerator(model, max_len=48, prefill_chunk=8, num_draft=2)
    engine = ServingEngine(model, slots=2, num_pages=12, page_size=8, max_context=48, prefill_chunk=8,
                           cuda_graphs=False)
    decodes = {"plain": lambda: list(plain.generate(prompt, max_new_tokens=6)),
               "speculative": lambda: spec.generate(prompt, max_new_tokens=6),
               "engine": lambda: engine.serve([Request(prompt, 6)])}
    jitted = plain.program(prefill.prefill_chunk)
    entries = jitted._cache_size()
    programs_of, traces = {}, {}
    for name, run in decodes.items():
        compiles.names.clear()
        traced.clear()
        run()
        programs_of[name], traces[name] = sorted(compiles.names), len(traced)
    # Each decode compiles two programs: the one prefill program (the speculative generator's
    # trace adds the MTP layer, the engine's the page-table rows and slots) and its own decode.
    assert programs_of == {"plain": ["decode_block", "prefill_chunk"],
                           "speculative": ["_speculate", "prefill_chunk"],
                           "engine": ["decode", "prefill_chunk"]}
    assert traces == {"plain": 1, "speculative": 1, "engine": 1}
    # One jitted prefill: the engine's is the generators' object, whose cache gained one entry per decode.
    assert engine.programs.prefill is jitted and spec.program(prefill.prefill_chunk) is jitted
    assert jitted._cache_size() == entries + 3
    # One program builder: the generators' programs and the engine's come from `programs.jit`
    # with the runtime's options, the engine's prefill being the generators'.
    built = []
    jit = programs.jit
    monkeypatch.setattr(programs, "jit", lambda fn, options=(), **kw: built.append(fn.__name__) or jit(fn, options, **kw))
    monkeypatch.setattr(engine_programs, "jit", programs.jit)
    options = (("xla_embed_ir_in_executable", False),)
    monkeypatch.setattr(runtime, "compiler_options", lambda backend, cuda_graphs: options if cuda_graphs else ())
    gen = Generator(model, max_len=48, prefill_chunk=8, cuda_graphs=True)
    with_options = gen.program(prefill.prefill_chunk)
    engine_programs.engine_programs.cache_clear()
    engine = ServingEngine(model, slots=2, num_pages=12, page_size=8, max_context=48, prefill_chunk=8,
                           cuda_graphs=True)
    assert gen.options == options and sorted(built) == ["decode", "prefill_chunk"]
    assert engine.programs.prefill is with_options


def test_one_stop_rule_and_one_cut_rule():
    assert cut([5, 6, 2, 7], 2) == [5, 6] and cut(np.array([5, 6, -1, -1]), None) == [5, 6]
    assert cut([5, 6], 2) == [5, 6] and cut([], 2) == []
    assert stops(np.array([5, 2]), 2) and not stops([5, 6], 2) and not stops([5, 6], None)


def test_every_policy_reports_one_stats_shape(model):
    prompts = np.array([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], np.int32)
    plain = Generator(model, batch=2, max_len=48, prefill_chunk=8, block_size=4)
    list(plain.generate(prompts, max_new_tokens=8))
    spec = SpeculativeGenerator(model, batch=2, max_len=48, prefill_chunk=8, num_draft=2)
    spec.generate(prompts, max_new_tokens=8)
    for gen in (plain, spec):
        s = gen.stats
        assert isinstance(s, DecodeStats) and isinstance(gen, DecodeRuntime)
        assert s.prompt_tokens == 10 and s.new_tokens == 16 and s.decode_s >= s.steady_s >= 0
    engine = ServingEngine(model, slots=2, num_pages=12, page_size=8, max_context=48, prefill_chunk=8)
    engine.serve([Request(p, 8) for p in prompts])
    assert isinstance(engine, DecodeRuntime) and engine.stats.prompt_tokens == 10 and engine.stats.new_tokens == 16
    assert plain.stats.steady_tokens == 2 * 4 and plain.stats.verify_steps == 0
    assert spec.stats.steady_tokens == 16 and spec.stats.verify_steps > 0


def test_every_policy_answers_one_completions_call(model):
    """decode.py's one call: plain, speculative and engine greedy completions agree, cut before the stop token."""
    prompts = [np.array([3, 5, 7, 9, 11], np.int32), np.array([2, 4, 6], np.int32)]
    plain = Generator(model, batch=2, max_len=48, prefill_chunk=8, block_size=4)
    full = [sum(pieces, []) for pieces in zip(*plain.completions(prompts, max_new_tokens=10))]
    assert [len(row) for row in full] == [10, 10]
    stop = full[0][6]
    call = dict(max_new_tokens=10, stop_token=stop)
    policies = {"plain": plain, "speculative": SpeculativeGenerator(model, batch=2, max_len=48, prefill_chunk=8,
                                                                    num_draft=2),
                "engine": ServingEngine(model, slots=2, num_pages=12, page_size=8, max_context=48, prefill_chunk=8)}
    want = [cut(row, stop) for row in full]
    assert len(want[0]) <= 6
    for name, policy in policies.items():
        got = [sum(pieces, []) for pieces in zip(*policy.completions(prompts, **call))]
        assert got == want, name
