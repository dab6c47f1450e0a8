"""benchmarks/bits_per_byte.py on checkpoints/default: the model's bits against a direct forward
pass summed by hand, the compressors' bits, the windows (every token after the first scored
once), the file selection and the command line."""

from __future__ import annotations

import gzip
import json
import lzma
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import bits_per_byte as bpb
from glm_jax.checkpoint import load_model_dir
from glm_jax.data.tokenizer import eos_id, load_tokenizer
from glm_jax.forward_options import ForwardOptions
from conftest import ROOT

MODEL = ROOT / "checkpoints" / "default"
CONTEXT = 64
TEXTS = {
    ("pkg-a", "a/short.py"): "def add(a, b):\n    return a + b\n",
    ("pkg-a", "a/long.py"): "import os\n\n\nclass Walker:\n    \"\"\"Walk a tree of files.\"\"\"\n\n"
                            + "".join(f"    def step_{i}(self, path):\n        return os.path.join(path, '{i}')\n\n"
                                      for i in range(6)),
    ("pkg-b", "b/mod.py"): "# a module\nVALUES = [1, 2, 3]\nprint(sum(VALUES))\n",
}


@pytest.fixture(scope="module")
def model():
    return load_model_dir(MODEL, dtype="float32")  # float32: batched and one-window sums agree to 1e-4


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def docs():
    return bpb.select_documents([bpb.Document(p, f, t) for (p, f), t in TEXTS.items()], max_bytes=None)


@pytest.fixture(scope="module")
def result(model, tok, docs):
    return bpb.measure(model, tok, docs, context=CONTEXT, batch_size=4)


def _by_hand(model, ids: np.ndarray, context: int) -> float:
    """-sum log2 p(ids[t] | ids[window start .. t-1]) over t = 1 .. n-1, windows of `context`
    inputs from 0, each run alone at its own length; float64 softmax on the host."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, options=ForwardOptions(
        mode="sparse", form="absorbed")).logits)
    total = 0.0
    for start in range(0, ids.size - 1, context):
        inputs = ids[start:min(start + context, ids.size - 1)]
        targets = ids[start + 1:start + 1 + inputs.size]
        logits = np.asarray(forward(state, jnp.asarray(inputs[None])), np.float64)[0]       # [n, V]
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        total += float(np.sum(logz - logits[np.arange(targets.size), targets])) / math.log(2)
    return total


def test_documents_are_sorted_by_package_then_path(docs):
    assert [(d.package, d.path) for d in docs] == sorted((p, f) for p, f in TEXTS)


def test_model_bits_equal_a_direct_forward_pass_summed_by_hand(model, tok, docs, result):
    for doc, row in zip(docs, result["per_file"]):
        ids = np.asarray(tok.encode(doc.text).ids + [eos_id(tok)], np.int32)   # as train.py's pipeline
        assert row["tokens"] == ids.size
        expected = _by_hand(model, ids, CONTEXT) + math.log2(model.cfg.vocab_size)
        assert row["model_bits"] == pytest.approx(expected, rel=1e-4)
    total = sum(r["model_bits"] for r in result["per_file"])
    n_bytes = sum(len(d.text.encode()) for d in docs)
    assert result["bytes"] == n_bytes
    assert result["measures"]["model"]["bits_per_byte"] == pytest.approx(total / n_bytes)
    assert result["measures"]["model"]["bits_per_token"] == pytest.approx(total / result["tokens"])


def test_compressor_bits_are_each_file_compressed_on_its_own(docs, result):
    for doc, row in zip(docs, result["per_file"]):
        data = doc.text.encode("utf-8")
        assert row["gzip -9"] == 8 * len(gzip.compress(data, 9))
        assert row["xz -9e"] == 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    one, data = result["per_file"][0], docs[0].text.encode()
    assert one["gzip -9"] / one["bytes"] == 8 * len(gzip.compress(data, 9)) / len(data)
    for name in ("gzip -9", "xz -9e"):
        assert result["measures"][name]["bits_per_byte"] == sum(r[name] for r in result["per_file"]) / result["bytes"]
    joined = b"".join(d.text.encode("utf-8") for d in docs)
    assert result["measures"]["gzip -9, files joined"]["bits"] == 8 * len(gzip.compress(joined, 9))


def test_every_token_after_the_first_is_scored_once(model, result):
    """Scored tokens: tokens - 1 per file (the first is charged log2(V) bits instead), also when
    the file spans several windows."""
    long = next(r for r in result["per_file"] if r["path"] == "a/long.py")
    assert long["tokens"] > 2 * CONTEXT + 1                          # three windows
    for row in result["per_file"]:
        assert row["scored_tokens"] == row["tokens"] - 1
        assert row["first_token_bits"] == math.log2(model.cfg.vocab_size) == 13.0   # 8192 tokens
    assert result["scored_tokens"] == result["tokens"] - result["files"]


@pytest.mark.parametrize("num_ids,context,stride", [(1, 8, 8), (2, 8, 8), (9, 8, 8), (10, 8, 8), (30, 8, 8),
                                                    (30, 8, 3), (30, 8, 1), (5, 8, 2), (17, 4, 4)])
def test_windows_cover_each_target_once(num_ids, context, stride):
    windows = bpb.plan_windows(num_ids, context, stride)
    targets = [w.start + 1 + i for w in windows for i in range(w.first_scored, w.length)]
    assert targets == list(range(1, num_ids))
    for w in windows:
        assert 0 < w.length <= context and w.start + w.length <= num_ids - 1 and w.start % stride == 0
        assert w.length - w.first_scored <= (context if w.start == 0 else stride)
    if stride == context:                                           # train.py's pieces
        assert all(w.first_scored == 0 for w in windows)


def test_overlapping_windows_score_the_same_tokens(model, tok, docs, result):
    ids = [np.asarray(tok.encode(d.text).ids + [eos_id(tok)], np.int32) for d in docs]
    bits, scored = bpb.score_documents(model, ids, context=CONTEXT, stride=CONTEXT // 2, batch_size=4)
    assert scored.tolist() == [r["scored_tokens"] for r in result["per_file"]]
    short = [i for i, x in enumerate(ids) if x.size <= CONTEXT + 1]  # one window either way
    assert short and all(bits[i] + 13.0 == pytest.approx(result["per_file"][i]["model_bits"], rel=1e-5)
                         for i in short)
    with pytest.raises(ValueError, match="stride"):
        bpb.plan_windows(10, 4, 5)


def test_selection_limits(docs):
    assert len(bpb.select_documents(docs, max_files=2)) == 2
    first = len(docs[0].text.encode())
    assert len(bpb.select_documents(docs, max_bytes=first)) == 1              # stops once reached
    assert len(bpb.select_documents(docs, max_bytes=first + 1)) == 2          # the crossing file is kept
    assert bpb.select_documents([bpb.Document("p", "x.py", "")]) == []


def test_command_line(tmp_path, docs, result, capsys):
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": d.text, "package": d.package, "path": d.path}) + "\n"
                               for d in reversed(docs)))
    out = tmp_path / "bpb.json"
    assert bpb.main(["--model", str(MODEL), "--heldout-jsonl", str(heldout), "--context", str(CONTEXT),
                     "--batch-size", "4", "--dtype", "float32", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| measure | bits/byte | vs gzip -9 |" in table and "| gzip -9 |" in table and "| xz -9e |" in table
    saved = json.loads(out.read_text())
    assert saved["files"] == 3 and saved["packages"] == ["pkg-a", "pkg-b"]
    assert saved["measures"]["model"]["bits_per_byte"] == pytest.approx(
        result["measures"]["model"]["bits_per_byte"], rel=1e-6)

    assert bpb.main(["--model", str(tmp_path / "missing"), "--heldout-jsonl", str(heldout)]) == 2
    assert "model directory" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert bpb.main(["--model", str(MODEL), "--heldout-jsonl", str(empty)]) == 2
    assert "no held-out files" in capsys.readouterr().err


# ---------------------------------------------------------------------- benchmarks/fp8_bits_per_byte.py
def fp8_micro_model():
    """kv_lora 128 (the FP8 layout's scale group); top-k 64 >= every position, so every row is
    selected and the FP8 keys cannot change a selection."""
    from conftest import micro_config
    from glm_jax.model import GLMModel

    return GLMModel(micro_config(kv_lora_rank=128, index_topk=64), rngs=nnx.Rngs(0))


def prefill_scores(model, rows: np.ndarray, layout: str, chunk: int) -> np.ndarray:
    from benchmarks import fp8_bits_per_byte
    from glm_jax.decoding.runtime import DecodeRuntime

    runtime = DecodeRuntime(model, batch=2, max_len=rows.shape[1] - 1, prefill_chunk=chunk, kv_cache_dtype=layout)
    return fp8_bits_per_byte.score_rows(runtime, rows)


def test_fp8_scores_read_the_quantized_cache_in_every_chunk():
    """Scored through the prefill program: auto's scores are a direct forward pass's ln p of
    each next token; FP8's differ from them (finite, close), and are the same whether the 48
    positions run as one chunk or three, so later chunks read what earlier ones wrote quantized."""
    model = fp8_micro_model()
    rows = (np.arange(3 * 49).reshape(3, 49) * 7 % 97).astype(np.int32)     # 3 rows: one call of 2, one padded
    auto = prefill_scores(model, rows, "auto", 16)
    logits = model(jnp.asarray(rows[:, :-1]), options=ForwardOptions(mode="sparse", form="absorbed")).logits
    direct = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1), rows[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(auto, np.asarray(direct), atol=2e-4)
    fp8_chunks, fp8_whole = prefill_scores(model, rows, "fp8", 16), prefill_scores(model, rows, "fp8", 48)
    np.testing.assert_allclose(fp8_chunks, fp8_whole, atol=2e-4)
    gap = np.abs(fp8_chunks - auto)
    print(f"|fp8 - auto| nats: mean {gap.mean():.4f}, max {gap.max():.4f}; mean ln p {auto.mean():.4f} (auto), "
          f"{fp8_chunks.mean():.4f} (fp8)")
    assert np.isfinite(fp8_chunks).all() and 1e-3 < gap.mean() < 0.2
    assert abs(fp8_chunks.mean() / auto.mean() - 1) < 0.02


def test_fp8_bits_per_byte_smoke_gives_both_layouts_close(tmp_path, capsys):
    """--smoke on checkpoints/default: a row per layout, finite bits, FP8 within 2% of auto."""
    from benchmarks import fp8_bits_per_byte

    out = tmp_path / "bpb.json"
    assert fp8_bits_per_byte.main(["--smoke", "--context", "64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["layout"], r["cache"]) for r in rows] == [(64, "auto", "bfloat16"), (64, "fp8", "fp8")]
    assert all(r["finite"] and 0 < r["bits_per_byte"] < 8 for r in rows)
    assert abs(rows[1]["relative_to_auto"]) < 0.02 and rows[1]["bits_per_byte"] != rows[0]["bits_per_byte"]
    assert fp8_bits_per_byte.main(["--smoke", "--context", "8192"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --context 8192 exceeds the model's max_position_embeddings (4096)")
