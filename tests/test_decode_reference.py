"""decode.py's tokens are those of the code before the decoding paths shared one runtime:
tests/data/decode_reference.json holds the completions that code wrote for the default model
(checkpoints/default), greedy and seeded at temperature 0.7, plain (one prompt and a batch),
speculative (a batch), through the serving engine (--max-batch) and as the server's engine
decodes them (`serving.engine_setup.build_engine`). Recorded on the CPU with this test's XLA
flags and the jax version named in the file; another version or backend may round
differently, and the test is then skipped. GLM_WRITE_DECODE_REFERENCE=1 writes the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

import decode
from glm_jax.frontends.decode import DEFAULT_CHECKPOINT

REFERENCE = Path(__file__).parent / "data" / "decode_reference.json"
PROMPTS = ["def f(x):", "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):", "x = [1, 2,"]
COMMON = ["--max-new-tokens", "10", "--prefill-chunk", "16", "--max-len", "96", "--quiet", "--top-k", "40"]
SAMPLINGS = {"greedy": ["--temperature", "0"], "seeded": ["--temperature", "0.7", "--seed", "3"]}
MODES = {"plain1": (1, ["--speculative", "0"]), "plain": (3, ["--speculative", "0"]),
         "speculative": (3, ["--speculative", "2"]), "max_batch": (3, ["--max-batch", "2"])}


def _completions(tmp_path, prompts, flags) -> list[str]:
    path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    assert decode.main(["--prompts-file", str(path), "--output", str(out), *COMMON, *flags]) == 0
    return [json.loads(line)["completion"] for line in out.read_text().splitlines()]


def _served() -> dict:
    """The server's engine (build_engine) on the prompts' token ids -> tokens per sampling."""
    from glm_jax.checkpoint import load_model_dir
    from glm_jax.data.tokenizer import load_tokenizer
    from glm_jax.decoding.engine import Request
    from glm_jax.decoding.sampling import SamplingParams
    from glm_jax.serving.engine_setup import build_engine

    model = load_model_dir(DEFAULT_CHECKPOINT)
    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    engine = build_engine(model, slots=2, page_size=16, max_context=96, prefill_chunk=16)
    ids = [np.asarray(tok.encode(p).ids, np.int32) for p in PROMPTS]
    out = {}
    for name, sampling in (("greedy", SamplingParams(temperature=0.0)),
                           ("seeded", SamplingParams(temperature=0.7, top_k=40))):
        results = engine.serve([Request(row, 10, sampling, None, 3 + i) for i, row in enumerate(ids)])
        out[name] = [r.tokens for r in results]
    return out


def test_decode_outputs_are_those_of_the_code_before(tmp_path):
    got = {}
    for mode, (n, flags) in MODES.items():
        for name, sampling in SAMPLINGS.items():
            got[f"{mode}/{name}"] = _completions(tmp_path, PROMPTS[:n], flags + sampling)
    for name, tokens in _served().items():
        got[f"served/{name}"] = tokens
    if os.environ.get("GLM_WRITE_DECODE_REFERENCE"):
        REFERENCE.write_text(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), **got}, indent=1))
    want = json.loads(REFERENCE.read_text())
    if (want["jax"], want["backend"]) != (jax.__version__, jax.default_backend()):
        pytest.skip(f"outputs recorded with jax {want['jax']} on {want['backend']}")
    for key, value in got.items():
        assert value == want[key], key
