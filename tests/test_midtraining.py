"""Long-context mid-training: the context extension of train.py (--context-length, YaRN), long
documents with held-out packages, the sparse stage from a checkpoint, an exact resume with the
extended context, the long-context evaluation and moving a run in parts."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

import train
from conftest import ROOT, micro_config
from glm_jax.config import ConfigError, extend_context, load_config, save_config
from glm_jax.layers.rope import rope_inv_freq, softmax_scale_factor


@pytest.fixture(scope="module", autouse=True)
def release_programs():
    """This file compiles many programs; the test worker lives on after it."""
    yield
    jax.clear_caches()


def _script(name: str):
    """scripts/NAME.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- the RoPE extension
def yarn_inv_freq(dim: int, theta: float, factor: float, original: int, beta_fast: float, beta_slow: float):
    """The YaRN paper's "NTK-by-parts" frequencies (Peng et al. 2023, eq. 17-19), written out
    here: dimension pair d turns r(d) = original / wavelength(d) times over the original context;
    pairs with r > beta_fast keep their frequency, pairs with r < beta_slow are interpolated
    (divided by the factor), and between them the blend ramps linearly over the pair index from
    the (rounded-out) pair where r = beta_fast to the one where r = beta_slow, as the published
    implementation rounds them."""
    theta_d = [theta ** (-2 * d / dim) for d in range(dim // 2)]

    def pair_where_turns(rotations):        # solve original * theta_d / (2 pi) = rotations for d
        return dim / 2 * math.log(original / (2 * math.pi * rotations)) / math.log(theta)

    low = max(math.floor(pair_where_turns(beta_fast)), 0)
    high = min(math.ceil(pair_where_turns(beta_slow)), dim - 1)
    out = []
    for d, f in enumerate(theta_d):
        turns = original * f / (2 * math.pi)
        if turns > beta_fast and d <= low:
            gamma = 1.0                                  # extrapolated: kept
        elif turns < beta_slow and d >= high:
            gamma = 0.0                                  # interpolated: f / factor
        else:
            gamma = 1.0 - min(max((d - low) / (high - low), 0.0), 1.0)
        out.append(gamma * f + (1 - gamma) * f / factor)
    return np.array(out)


def test_extension_writes_yarn_and_matches_the_formula():
    base = load_config(ROOT / "checkpoints/default/config.yaml")
    ext = extend_context(base, 32768)
    scaling = ext.rope_scaling_dict
    assert ext.max_position_embeddings == 32768
    assert scaling == {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    for dim in (base.qk_rope_head_dim, 64):
        expected = yarn_inv_freq(dim, base.rope_theta, 8, 4096, 32, 1)
        np.testing.assert_allclose(rope_inv_freq(dim, base.rope_theta, scaling), expected, rtol=1e-12)
        plain = rope_inv_freq(dim, base.rope_theta)
        assert expected[0] == plain[0] and expected[-1] == pytest.approx(plain[-1] / 8)   # both ends
    # the attention temperature: sqrt(1/t) = 0.1 ln(s) + 1, on the softmax scale squared
    assert softmax_scale_factor(scaling) == pytest.approx((0.1 * math.log(8) + 1) ** 2)


def test_a_second_extension_counts_from_the_original_length():
    base = load_config(ROOT / "checkpoints/default/config.yaml")
    twice = extend_context(extend_context(base, 32768), 131072)
    once = extend_context(base, 131072)
    assert twice == once
    assert twice.rope_scaling_dict["factor"] == 32
    assert twice.rope_scaling_dict["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("length,message", [
    (4096, "the model already has 4096 positions"),
    (2048, "the model already has 4096 positions"),
    (10000, "not a multiple of the model's original 4096 positions"),
])
def test_nonsense_lengths_are_refused(length, message):
    with pytest.raises(ConfigError, match=message):
        extend_context(load_config(ROOT / "checkpoints/default/config.yaml"), length)


@pytest.mark.parametrize("flags,message", [
    (["--context-length", "4096"], "error: --context-length 4096: the model already has 4096 positions"),
    (["--context-length", "6000"], "error: --context-length 6000: not a multiple of the model's original 4096"),
    (["--context-length", "8192", "--seq-len", "16384"],
     "error: --seq-len 16384 is longer than the model's 8192 positions"),
    (["--seq-len", "8192"], "error: --seq-len 8192 is longer than the model's 4096 positions"),
    (["--context-length", "8192", "--hf-checkpoint", "x"], "error: --hf-checkpoint and --checkpoint both"),
])
def test_train_refuses_nonsense_in_one_line_before_any_work(tmp_path, capsys, flags, message):
    code = train.main(["--checkpoint", str(ROOT / "checkpoints/default"), "--out", str(tmp_path / "run"), *flags]) \
        if "--hf-checkpoint" not in flags else \
        train.main(["--run-config", str(_both_sources(tmp_path)), "--out", str(tmp_path / "run"), *flags])
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "run").exists()


def _both_sources(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(f"model:\n  checkpoint: {ROOT / 'checkpoints/default'}\n")
    return path


# ---------------------------------------------------------------------- long documents
def _source_tree(root, packages: dict[str, int]):
    """Packages of `files` .py files each (and a single-file module, left out)."""
    for name, files in packages.items():
        for i in range(files):
            path = root / name / ("sub" if i % 2 else "") / f"m{i}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# {name} module {i}\n" + f"def {name}_{i}(x):\n    return x + {i}\n" * 40)
    (root / "single.py").write_text("x = 1\n" * 500)


def test_long_documents_hold_out_whole_packages(tmp_path):
    long_documents = _script("long_documents")
    from glm_jax.data import sources

    tree = tmp_path / "src"
    _source_tree(tree, {"alpha": 6, "beta": 2, "gamma": 5, "delta": 4, "eps": 1})    # eps: too short
    out, held = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    args = ["--root", str(tree), "--min-chars", "2000", "--out", str(out), "--heldout-packages", "2",
            "--heldout-min-chars", "4000", "--heldout-out", str(held)]
    assert long_documents.main(args) == 0
    train_texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    held_texts = [json.loads(line)["text"] for line in held.read_text().splitlines()]

    def names(texts):
        return {t.split("# file: ", 1)[1].split("/", 1)[0] for t in texts}

    assert len(held_texts) == 2 and names(held_texts) | names(train_texts) == {"alpha", "beta", "gamma", "delta"}
    assert not names(held_texts) & names(train_texts)             # disjoint: whole packages
    assert all(len(t) >= 4000 for t in held_texts)
    assert all(t.count("# file: ") > 1 for t in train_texts + held_texts)  # a package is one document
    # the choice hangs on the names alone: a package more in the tree leaves it as it was
    _source_tree(tree, {"zeta": 3})
    assert long_documents.main(args) == 0
    assert [json.loads(line)["text"] for line in held.read_text().splitlines()] == held_texts
    # what train.py reads
    assert len(sources.open_documents((str(out),))) == 3 and len(sources.open_documents((str(held),))) == 2


def test_recall_pairs_define_each_name_once_and_use_it_later(tmp_path):
    import re

    import numpy as np

    long_documents = _script("long_documents")
    from benchmarks import long_context_eval as lce

    text = "".join(f"line {i} of the document\n" for i in range(4000))
    out = long_documents.with_recall_pairs(text, 10_000, np.random.default_rng(0))
    defined = re.findall(r"^([A-Z]+_[A-Z]+_[0-9A-F]{4}) = \d+$", out, re.M)
    used = re.findall(r"^check\(([A-Z]+_[A-Z]+_[0-9A-F]{4})\)$", out, re.M)
    assert len(defined) >= len(text) // 10_000 // 2 and sorted(defined) == sorted(used)
    gaps = [out.index(f"check({n})") - out.index(f"{n} = ") for n in defined]
    assert min(gaps) >= 2000 and max(gaps) > 20_000                 # from 2K characters to far across the document
    kept = [line for line in out.splitlines(keepends=True) if not re.match(r"^[A-Z]+_|^check\(", line)]
    assert "".join(kept) == text                                    # only whole lines inserted
    assert not {w.upper() for w in lce._WORDS} & {w for n in defined for w in n.split("_")[:2]}   # not the probe's names
    # through main: training documents get pairs, held-out ones none
    tree = tmp_path / "src"
    _source_tree(tree, {"alpha": 6, "beta": 2, "gamma": 5})
    args = ["--root", str(tree), "--min-chars", "2000", "--out", str(tmp_path / "t.jsonl"), "--heldout-packages", "1",
            "--heldout-min-chars", "4000", "--heldout-out", str(tmp_path / "h.jsonl"), "--recall-every", "2000"]
    assert long_documents.main(args) == 0
    assert "check(" in (tmp_path / "t.jsonl").read_text() and "check(" not in (tmp_path / "h.jsonl").read_text()


def test_long_documents_refuse_a_held_out_split_that_cannot_be(tmp_path, capsys):
    long_documents = _script("long_documents")

    tree = tmp_path / "src"
    _source_tree(tree, {"alpha": 6, "beta": 2})
    args = ["--root", str(tree), "--min-chars", "1000", "--out", str(tmp_path / "t.jsonl"), "--heldout-out",
            str(tmp_path / "h.jsonl"), "--heldout-packages"]
    assert long_documents.main(args + ["3"]) == 2
    assert long_documents.main(args + ["2"]) == 2     # nothing left to train on
    assert all(line.startswith("error: ") for line in capsys.readouterr().err.splitlines())


# ---------------------------------------------------------------------- the stage from a checkpoint
_COMMON = ["--batch-size", "2", "--warmup-steps", "1", "--lr", "1e-2", "--max-files", "4", "--log-every", "1",
           "--eval-every", "100", "--eval-batches", "1", "--save-every", "100"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A micro model of 32 positions (two layers: one IndexShare group, and the MTP layer), trained
    and exported (what checkpoints/default is to the real stage)."""
    out = tmp_path_factory.mktemp("base")
    cfg_path = out.parent / "micro32.yaml"
    save_config(micro_config(vocab_size=320, max_position_embeddings=32, num_hidden_layers=2, index_topk_pattern="FS"),
                cfg_path)
    assert train.main(["--config", str(cfg_path), "--out", str(out), "--steps", "2", "--dense-steps", "2",
                       "--seq-len", "32", *_COMMON]) == 0
    return out


#: The steps of the stage at 64 tokens: the extended run stops after 3 of them, and the moved run
#: continues it to the end. Every run of the stage has these flags, so its learning-rate schedule
#: (and with it the step program) is the same in all of them: the step compiles once in this file.
STAGE_STEPS = 4


def _stage(base, length: int, steps: int = STAGE_STEPS) -> list[str]:
    """The flags of a mid-training stage from `base`'s weights at `length` tokens."""
    return ["--checkpoint", str(base), "--context-length", str(length), "--seq-len", str(length),
            "--dense-steps", "0", "--steps", str(steps), *_COMMON]


@pytest.fixture(scope="module")
def extended_run(base_run, tmp_path_factory):
    """The first 3 steps of the stage at 64 tokens (twice the base's positions), uninterrupted,
    stopped with its checkpoint and export."""
    out = tmp_path_factory.mktemp("extended")
    assert train.main(_stage(base_run, 64) + ["--out", str(out), "--stop-after", "3"]) == 0
    return out


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_stage_starts_sparse_with_the_extension_recorded(base_run, extended_run):
    records = _records(extended_run)
    assert [r["stage"] for r in records] == ["sparse"] * 3            # sparse from the first step
    assert [r["step"] for r in records if r.get("compiled")] == [1]    # one stage: one compilation
    assert all(0 < r["indexer_kl"] < 100 and np.isfinite(r["loss"]) for r in records)   # the selected-set KL
    for cfg in (load_config(extended_run / "config.yaml"), load_config(extended_run)):  # the run's, the export's
        assert cfg.max_position_embeddings == 64
        assert cfg.rope_scaling_dict == {"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 32,
                                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert (extended_run / "tokenizer.json").read_bytes() == (base_run / "tokenizer.json").read_bytes()


def test_stage_resumes_bit_exactly_and_keeps_its_extension(base_run, extended_run, tmp_path, capsys):
    out = ["--out", str(tmp_path / "b")]
    assert train.main(_stage(base_run, 64) + out + ["--stop-after", "2"]) == 0
    capsys.readouterr()
    assert train.main(_stage(base_run, 128) + out + ["--resume"]) == 2     # another extension
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--resume cannot change model.context_length (--context-length) 64 -> 128" in err[0]
    assert train.main(_stage(base_run, 64) + out + ["--resume", "--stop-after", "1"]) == 0
    assert [r["step"] for r in _records(tmp_path / "b")] == [1, 2, 3]
    assert [r["loss"] for r in _records(tmp_path / "b")] == [r["loss"] for r in _records(extended_run)]   # bit for bit


def test_the_next_stage_counts_from_the_original_length(extended_run, tmp_path):
    """train.py's setup of a stage from the extended run (everything before its first step: the
    extended checkpoint read, its config extended again and written): the config of the run and
    of the model it trains extends the base's 32 positions, not the extended run's 64."""
    from glm_jax.training import run

    state = run.setup(train.train_config(train.parse_args(_stage(extended_run, 128, steps=1)
                                                          + ["--out", str(tmp_path / "c")])))
    state.mngr.close()
    for cfg in (load_config(tmp_path / "c" / "config.yaml"), state.cfg, state.model.cfg):
        scaling = cfg.rope_scaling_dict
        assert (cfg.max_position_embeddings, scaling["factor"], scaling["original_max_position_embeddings"]) == \
            (128, 4, 32)


# ---------------------------------------------------------------------- moving a run in parts
def _files(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_checkpoint_parts_round_trip_and_resume(base_run, extended_run, tmp_path, capsys):
    parts_script = _script("checkpoint_parts")
    parts, moved = tmp_path / "parts", tmp_path / "moved"
    assert parts_script.main(["pack", str(extended_run), str(parts), "--part-mib", "0.05"]) == 0
    manifest = json.loads((parts / "manifest.json").read_text())
    assert manifest["step"] == 3 and len(manifest["parts"]) > 3
    assert all((parts / p["name"]).stat().st_size <= 0.05 * 2**20 for p in manifest["parts"])
    # a changed or missing part is found before anything is written
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for p in parts.iterdir():
        (damaged / p.name).write_bytes(p.read_bytes())
    second = damaged / manifest["parts"][1]["name"]
    second.write_bytes(b"x" + second.read_bytes()[1:])
    assert parts_script.main(["unpack", str(damaged), str(tmp_path / "no")]) == 2
    (damaged / manifest["parts"][0]["name"]).unlink()
    assert parts_script.main(["unpack", str(damaged), str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: part {manifest['parts'][1]['name']} differs from the packed one (sha256); copy it again",
                   f"error: part {manifest['parts'][0]['name']} is missing from {damaged}; copy it again"]
    assert not (tmp_path / "no").exists()

    assert parts_script.main(["unpack", str(parts), str(moved)]) == 0
    original = _files(extended_run)
    assert _files(moved) == {k: v for k, v in original.items() if k.startswith("checkpoints/3/")
                             or k in ("config.yaml", "run_config.yaml", "tokenizer.json", "metrics.jsonl")}
    assert parts_script.main(["unpack", str(parts), str(moved)]) == 2        # not into a run in use
    capsys.readouterr()
    # the moved run continues to the end of its stage (its flags; the weights it started from are read too)
    assert train.main(_stage(base_run, 64) + ["--out", str(moved), "--resume"]) == 0
    assert "resume: continuing from step 3" in capsys.readouterr().out
    assert [r["step"] for r in _records(moved)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------- the evaluation
def test_definition_reach_counts_the_definitions_tokens_in_the_top_k_and_ranks_it(extended_run):
    """With a top-k as long as the row every earlier key is selected: the whole definition; with the
    model's top-4 at most 4 of its tokens a query. The rank does not depend on the top-k, and a
    query's top-4 holds a definition token exactly when its best one ranks within 4."""
    import dataclasses

    from flax import nnx

    from benchmarks import long_context_eval as lce
    from glm_jax.checkpoint import load_model_dir
    from glm_jax.data.tokenizer import load_tokenizer
    from glm_jax.model import abstract_model

    model, tok = load_model_dir(str(extended_run)), load_tokenizer(str(extended_run))
    stream = np.arange(3, 3 + 200, dtype=np.int32) % 300
    rows, first, counts, spans = lce.probe_rows(tok, stream, 1, 64, 32, seed=0)
    start, end = spans[0]
    assert 0 < start < end <= first[0] and end - start > 4
    few, few_rank = lce.definition_reach(model, rows[0::2], spans[0::2], first[0::2], counts[0::2])
    assert len(few) == 1 and 0 <= few[0] <= 4 / (end - start)
    graphdef, _ = nnx.split(abstract_model(dataclasses.replace(model.cfg, index_topk=64)))
    every, every_rank = lce.definition_reach(nnx.merge(graphdef, nnx.state(model)), rows[0::2], spans[0::2],
                                             first[0::2], counts[0::2])
    assert every == [1.0] and every_rank == few_rank and 1 <= few_rank[0] <= first[0] + counts[0]

    queries = np.arange(first[0], first[0] + counts[0], dtype=np.int32)[None]
    sel, scores = (np.asarray(a) for a in lce.group_selections(*nnx.split(model), jax.numpy.asarray(rows[:1, :-1]),
                                                                jax.numpy.asarray(queries)))
    assert scores.shape == (1, 1, counts[0], 64) and np.isneginf(scores[0, 0, 0, first[0] + 1:]).all()
    chosen = ((sel >= start) & (sel < end)).any(axis=-1)[0, 0]                      # [Q]
    ranks = 1 + (scores[0, 0] > scores[0, 0, :, start:end].max(axis=-1, keepdims=True)).sum(axis=-1)
    np.testing.assert_array_equal(chosen, ranks <= 4)


def test_long_context_eval_scores_buckets_and_the_probe(base_run, extended_run, tmp_path, capsys):
    from benchmarks import long_context_eval as lce

    assert lce.clipped_bounds(lce.BUCKETS, 32768) == [4096, 16384, 32768]
    logp = np.log(np.full((2, 8), 0.5))
    logp[:, 4:] = np.log(0.25)
    assert lce.bucket_bits(logp, [4, 8]) == [1.0, 2.0]
    out = tmp_path / "eval.json"
    assert lce.main(["--model", str(extended_run), "--length", "64", "--buckets", "16,32,64", "--distance", "32", "24",
                     "--chunk", "16", "--rows", "1", "--probes", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["length"] == 64 and result["bounds"] == [16, 32, 64] and len(result["bits_per_token"]) == 3
    assert all(0 < b < 20 for b in result["bits_per_token"])
    assert [p["distance"] for p in result["probe"]] == [24, 32]
    assert lce.probe_distances([100_000, 2048, 2048], 32768) == [2048, 24576]     # clipped to 3/4 of the row
    assert all(np.isfinite(p["gain"]) and p["probe_logp"] < 0 for p in result["probe"])
    assert all(len(p["definition_selected"]) == 1 and 0 <= p["definition_selected"][0] <= 1
               for p in result["probe"])                          # one IndexShare group
    assert "| bits/token 0-16 | bits/token 16-32 | bits/token 32-64 |" in capsys.readouterr().out


def test_index_topk_sets_the_runs_top_k_over_the_extension():
    import dataclasses

    from glm_jax.config import load_config
    from glm_jax.training.run import run_model_config
    from glm_jax.training.run_config import TrainConfig

    source = load_config("tiny")
    base = TrainConfig()
    settings = dataclasses.replace(base, model=dataclasses.replace(base.model, context_length=2 * source.max_position_embeddings,
                                                                   index_topk=3 * source.index_topk))
    cfg = run_model_config(source, settings)
    assert cfg.index_topk == 3 * source.index_topk and cfg.max_position_embeddings == 2 * source.max_position_embeddings
    assert run_model_config(source, base).index_topk == source.index_topk
