"""The FP8 cache in decoding (`--kv-cache-dtype fp8`): the plain, speculative and engine paths
run on FP8 stores and agree with each other; the logits stay near those of the model's dtype
(the agreement of greedy tokens with it is printed, not asserted: near-ties of a random micro
model); LayerSplit sends FP8 rows and gives the one-device tokens; the engine's pool, sized from
a byte budget, admits >= 1.7x the sequences in FP8; bad values are refused in one line.

The micro model here has kv_lora 128 (the FP8 layout scales 128 latent values at a time), at
which a token's cache bytes fall 1.83x from bf16 (1,424 -> 780)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import decode
from conftest import ROOT, micro_config, simulated_devices_env
from glm_jax.cache import fp8 as cache_fp8, page_bytes
from glm_jax.config import load_config
from glm_jax.decoding.builders import engine_with_room, pool_pages
from glm_jax.decoding.engine import Request
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.speculative import SpeculativeGenerator
from glm_jax.model import GLMModel

PROMPTS = [np.arange(3, 14), (np.arange(20) * 7) % 97]
NEW = 12


def fp8_model() -> GLMModel:
    return GLMModel(micro_config(kv_lora_rank=128, max_position_embeddings=256), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model() -> GLMModel:
    return fp8_model()


def plain_tokens(model, kv_cache_dtype: str, prefill_chunk: int = 8, mesh=None) -> list[list[int]]:
    """Greedy tokens [prompt][NEW] of the plain Generator."""
    gen = Generator(model, batch=len(PROMPTS), prefill_chunk=prefill_chunk, block_size=4,
                    kv_cache_dtype=kv_cache_dtype, mesh=mesh)
    return np.concatenate(list(gen.generate(PROMPTS, max_new_tokens=NEW)), axis=1)[:, :NEW].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_every_decoding_path_runs_on_fp8_stores_and_agrees(model):
    """Plain, speculative (greedy) and the serving engine give the same tokens over FP8 stores:
    every path writes the same quantized rows (per token) and reads them the same way."""
    gen = Generator(model, batch=2, kv_cache_dtype="fp8")
    cache = gen.new_cache(2, 128)
    assert gen.cache_layout == "fp8" and cache.layout == "fp8"
    assert isinstance(cache.latent, cache_fp8.Fp8Latent) and isinstance(cache.index_keys, cache_fp8.Fp8Keys)
    assert cache.latent.values.dtype == jnp.float8_e4m3fn and cache.index_keys.values.dtype == jnp.float8_e4m3fn

    plain = plain_tokens(model, "fp8")
    spec = SpeculativeGenerator(model, batch=2, prefill_chunk=8, num_draft=2, kv_cache_dtype="fp8")
    assert spec.cache_layout == "fp8"
    assert spec.generate(PROMPTS, max_new_tokens=NEW).tolist() == plain
    engine = engine_with_room(model, slots=2, longest=40, max_context=256, prefill_chunk=8, page_size=8,
                              kv_cache_dtype="fp8")
    assert engine.cache.layout == "fp8" and engine.pool.describe().startswith("KV cache fp8, ")
    assert [r.tokens for r in engine.serve([Request(p, NEW) for p in PROMPTS])] == plain

    reference = plain_tokens(model, "auto")
    print("greedy FP8 vs float32, first differing token per prompt:",
          [first_difference(a, b) for a, b in zip(plain, reference)], plain, reference)


def test_fp8_logits_stay_near_the_models_dtype():
    """The prefill's last logits with an FP8 cache against float32's: not equal (the rows are
    quantized), further than bf16's (3 mantissa bits against 8) and within a quarter of the
    logits' spread. The indexer here selects every row (index_topk 16 >= 11 tokens), so the
    error is the cache's precision alone: at index_topk 4 FP8 keys flip near-tied selections,
    and the error grows to ~0.75 of the spread (the random micro model's indexer scores are
    near ties)."""
    model = GLMModel(micro_config(kv_lora_rank=128, max_position_embeddings=256, index_topk=16), rngs=nnx.Rngs(0))
    padded = np.stack([p[:11] for p in PROMPTS]).astype(np.int32)
    lengths = np.array([11, 11], np.int32)
    logits = {}
    for kv in ("auto", "bf16", "fp8"):
        gen = Generator(model, batch=2, prefill_chunk=8, kv_cache_dtype=kv)
        logits[kv] = np.asarray(gen.prefill(gen.new_cache(2, 128), padded, lengths)[0], np.float64)
    spread = logits["auto"].std()
    err = {kv: np.abs(logits[kv] - logits["auto"]).max() / spread for kv in ("bf16", "fp8")}
    print("max |logit error| / logit std:", err)        # measured: bf16 0.013, fp8 0.16
    assert 0 < err["bf16"] < err["fp8"] < 0.25


def test_layer_split_sends_fp8_rows_and_gives_the_one_device_tokens(tmp_path):
    """On 2 simulated devices (data=1,layer=2): FP8 greedy tokens equal the one-device FP8
    tokens, with prefill chunks that gather selected rows ("rows") and whole slices ("slice"),
    and from the serving engine on that mesh."""
    out = tmp_path / "tokens.json"
    script = ("import json, sys; sys.path.insert(0, 'tests'); import test_fp8_decode as t; "
              f"open({str(out)!r}, 'w').write(json.dumps(t.split_and_one_device_tokens()))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=simulated_devices_env(2, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for chunk in ("4", "64"):
        assert result[chunk]["split"] == result[chunk]["one"], result
    assert result["engine"] == result["4"]["one"]


def split_and_one_device_tokens() -> dict:
    """Run in a process of 2 devices: {prefill chunk: {"one": tokens, "split": tokens}, "engine":
    the engine's tokens on the mesh} (FP8)."""
    from glm_jax.sharding import make_mesh

    model, mesh = fp8_model(), make_mesh("data=1,layer=2")
    result = {str(chunk): {name: plain_tokens(model, "fp8", chunk, on) for name, on in (("one", None), ("split", mesh))}
              for chunk in (4, 64)}
    engine = engine_with_room(model, slots=2, longest=40, max_context=256, prefill_chunk=8, page_size=8,
                              kv_cache_dtype="fp8", mesh=mesh)
    result["engine"] = [r.tokens for r in engine.serve([Request(p, NEW) for p in PROMPTS])]
    return result


def test_engine_admits_more_sequences_at_the_same_byte_budget(model):
    """Two engines of 20 slots whose pools hold the same bytes (20 bf16 pages of 8 tokens): 20
    requests of 2 pages each (15 prompt tokens + the first new one) arrive; after one step the
    FP8 engine has admitted >= 1.7x those the bf16 one has (9 of 19 usable pages, against 17 of
    35: a micro token takes 1,424 bytes in bf16, 780 in FP8)."""
    budget = 20 * page_bytes(model.cfg, 8, jnp.bfloat16)
    admitted = {}
    for kv in ("bf16", "fp8"):
        engine = engine_with_room(model, slots=20, longest=64, max_context=256, prefill_chunk=8, page_size=8,
                                  kv_cache_dtype=kv, cache_bytes=budget)
        assert engine.pool.num_pages * engine.pool.bytes_per_page <= budget
        for i in range(20):
            engine.submit(Request((np.arange(15) + i) % 97, 1))
        engine.step()                   # admits while pages last, prefills one chunk of the first
        admitted[kv] = len(engine.pool.held)
    assert admitted == {"bf16": 9, "fp8": 17}
    assert admitted["fp8"] >= 1.7 * admitted["bf16"]


def test_serve_sizes_the_pool_from_kv_cache_memory_bytes(model, capsys):
    """decode.py --serve --kv-cache-memory-bytes: the engine's pool is the pages the bytes hold
    in the layout (`build_engine` as the server calls it); too few bytes: one line."""
    from glm_jax.serving.engine_setup import build_engine

    budget = 20 * page_bytes(model.cfg, 8, jnp.bfloat16)
    for kv, pages in (("bf16", 20), ("fp8", 36)):        # 1,424 / 780 bytes a token
        engine = build_engine(model, slots=2, page_size=8, max_context=256, prefill_chunk=8, kv_cache_dtype=kv,
                              cache_bytes=budget)
        assert engine.pool.num_pages == pages
    assert decode.main(["--serve", "--kv-cache-memory-bytes", "1000", "--kv-cache-dtype", "fp8"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: a KV cache of 1000 bytes holds 0 pages of 27264 bytes (16 tokens, fp8); the pool needs at least 2"]


def test_pool_pages_at_glm52_shape_fall_1_77x():
    """The engine's page accounting at GLM-5.2's shape: 95,232 bytes a token in bf16, 53,940 in
    FP8 (IndexShare keys on the 21 Full layers), so a byte budget holds 1.77x the pages."""
    cfg = load_config(ROOT / "configs" / "glm-5.2.yaml")
    assert page_bytes(cfg, 1, jnp.bfloat16) == 95_232 and page_bytes(cfg, 1) == 95_232
    assert page_bytes(cfg, 1, jnp.float8_e4m3fn) == 53_940
    budget = 64 * 2**30
    bf16, fp8 = (pool_pages(cfg, budget, 64, kv) for kv in ("bf16", "fp8"))
    assert bf16 == budget // (64 * 95_232) and fp8 == budget // (64 * 53_940)
    assert 1.76 < fp8 / bf16 < 1.77


@pytest.mark.parametrize("argv, message", [
    (["--kv-cache-dtype", "fp16"], "error: --kv-cache-dtype must be one of auto, bf16, fp8, got 'fp16'"),
    (["--kv-cache-dtype", "fp8", "--attention-impl", "pallas_tpu"],
     "error: --kv-cache-dtype fp8: --attention-impl pallas_tpu does not read FP8 pages; the implementations that "
     "do: reference, xla, pallas_gpu, cuda (or auto)"),
    (["--compile-only", "--kv-cache-dtype", "fp8"],
     "error: --compile-only compiles the cache in the model's dtype; leave out --kv-cache-dtype"),
])
def test_bad_values_are_refused_in_one_line(argv, message, capsys):
    assert decode.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [message]


def test_fp8_is_refused_where_the_model_cannot_take_it():
    """kv_lora 16 is no multiple of the 128 values a scale covers: one line, before any cache."""
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype fp8 needs kv_lora_rank a multiple of 128 .* has 16: "
                                         r"use auto or bf16$"):
        Generator(GLMModel(micro_config(), rngs=nnx.Rngs(0)), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="must be one of auto, bf16, fp8, got 'float8'"):
        cache_fp8.store_dtype("float8")
