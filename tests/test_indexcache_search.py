"""IndexCache greedy pattern search on a micro model: re-patterned weights, the greedy choice,
resuming from the state file, and a pattern GLMConfig accepts."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config
from glm_jax import indexcache_search, ops
from glm_jax.frontends import indexcache_search as search_cli
from glm_jax.checkpoint import save_model_dir
from glm_jax.convert.repattern import with_pattern
from glm_jax.data.tokenizer import save_tokenizer, train_bpe
from glm_jax.convert.load import assemble_model
from glm_jax.convert.names import param_specs
from glm_jax.forward_options import ForwardOptions

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 4


def _random_model(cfg, seed):
    """GLMModel(cfg) with random weights, built without the (slow, eager) module initialisers."""
    rng = np.random.default_rng(seed)
    arrays = {spec.path: jnp.asarray(rng.standard_normal(spec.shape) * spec.shape[-1] ** -0.5, spec.dtype)
              for spec in param_specs(cfg)}
    return assemble_model(cfg, arrays)


@nnx.jit(static_argnames="mode")
def _logits(model, tokens, mode):
    return model(tokens, options=ForwardOptions(mode=mode)).logits


def test_with_pattern_moves_weights_and_changes_only_index_selection():
    model = _random_model(micro_config(num_hidden_layers=4, index_topk_pattern="FFFF"), 0)
    shared = with_pattern(model, "FSFS")
    assert shared.cfg.pattern == "FSFS" and [len(p.kinds) for p in shared.plan] == [2, 2]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 12)), jnp.int32)
    np.testing.assert_allclose(_logits(shared, tokens, "dense"), _logits(model, tokens, "dense"),
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(_logits(shared, tokens, "sparse"), _logits(model, tokens, "sparse"), atol=1e-4)
    with pytest.raises(ValueError, match=r"makes layers \[1\] Full"):
        with_pattern(shared, "FFFS")


def _search_args(tmp_path, cfg) -> list[str]:
    """The command line of a search over a model directory of `cfg` (random weights) and TEXT."""
    tok = train_bpe([TEXT], vocab_size=300)
    save_tokenizer(tok, tmp_path)
    save_model_dir(tmp_path / "model", _random_model(cfg, 1), tokenizer_file=tmp_path / "tokenizer.json")
    (tmp_path / "calib.txt").write_text(TEXT)
    return ["--checkpoint", str(tmp_path / "model"), "--text-file", str(tmp_path / "calib.txt"), "--seq-len", "12",
            "--batch-size", "2", "--batches", "1", "--state", str(tmp_path / "search.json")]


def test_search_cli_flips_greedily_and_resumes(tmp_path, capsys):
    cfg = micro_config(num_hidden_layers=3, index_topk_pattern="FFF", vocab_size=300)
    args = _search_args(tmp_path, cfg)
    state = tmp_path / "search.json"
    assert search_cli.main(args + ["--flips", "1"]) == 0
    first = json.loads(state.read_text())
    assert search_cli.main(args + ["--flips", "2"]) == 0
    out = capsys.readouterr().out
    second = json.loads(state.read_text())
    assert "resuming" in out and second["steps"][0] == first["steps"][0]
    assert [len(s["candidates"]) for s in second["steps"]] == [2, 1]   # resumed: step 1 not redone
    for step in second["steps"]:
        assert step["loss"] == min(step["candidates"].values())
        assert step["candidates"][str(step["layer"])] == step["loss"]
    pattern = out.strip().splitlines()[-1].removeprefix("index_topk_pattern: ")
    assert pattern == second["steps"][-1]["pattern"] and pattern == "FSS"
    assert cfg.replace(index_topk_pattern=pattern).pattern == pattern


def test_search_cli_evaluates_with_the_kernels_of_its_flags(tmp_path, monkeypatch):
    seen = []
    evaluate = indexcache_search.eval_step
    monkeypatch.setattr(indexcache_search, "eval_step", lambda *a, **k: seen.append(k["options"].kernels) or evaluate(*a, **k))
    args = _search_args(tmp_path, micro_config(num_hidden_layers=2, index_topk_pattern="FF", vocab_size=300))
    assert search_cli.main(args + ["--flips", "0", "--attention-impl", "xla", "--indexer-impl", "xla"]) == 0
    assert seen == [ops.KernelChoice(indexer_topk="xla", sparse_mla="xla")]
