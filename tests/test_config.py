import json

import pytest

from glm_jax.config import ConfigError, GLMConfig, load_config
from glm_jax.model import abstract_model, count_params
from conftest import ROOT


def test_glm52_full_layers():
    cfg = load_config(ROOT / "configs/glm-5.2.yaml")
    assert cfg.full_layers == (0, 1, 2) + tuple(range(6, 75, 4))
    assert len(cfg.full_layers) == 21
    assert cfg.qk_head_dim == 256 and cfg.latent_dim == 576


def test_glm52_parameter_count_from_abstract_init():
    cfg = load_config(ROOT / "configs/glm-5.2.yaml")
    assert count_params(abstract_model(cfg)) == 753_329_921_024


def test_presets_load():
    for name in ("glm-5", "deepseek-v3.2", "tiny"):
        cfg = load_config(ROOT / f"configs/{name}.yaml")
        assert cfg.layer_is_full[0]
    assert all(load_config(ROOT / "configs/glm-5.yaml").layer_is_full)


def test_pattern_string_overrides_freq():
    cfg = GLMConfig(num_hidden_layers=4, index_topk_pattern="FSFF")
    assert cfg.full_layers == (0, 2, 3)


@pytest.mark.parametrize("changes, key", [
    ({"index_topk_pattern": "S" + "F" * 77}, "index_topk_pattern"),
    ({"index_topk_pattern": "FFX"}, "index_topk_pattern"),
    ({"index_topk": 0}, "index_topk"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"n_group": 3}, "n_group"),
    ({"index_skip_topk_offset": 0, "index_topk_freq": 4, "num_hidden_layers": 8}, None),
])
def test_bad_config_names_the_key(changes, key):
    with pytest.raises(ConfigError) as err:
        GLMConfig(**changes)
    if key:
        assert f"`{key}`" in str(err.value)


def test_unknown_yaml_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text((ROOT / "configs/tiny.yaml").read_text() + "num_hiden_layers: 4\n")
    with pytest.raises(ConfigError, match="num_hiden_layers"):
        load_config(path)


def test_hf_config_json(tmp_path):
    cfg = load_config(ROOT / "configs/glm-5.2.yaml")
    values = cfg.to_dict()
    values.pop("name")
    values.update(architectures=["GlmMoeDsaForCausalLM"], transformers_version="5.0.0", torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(values))
    loaded = GLMConfig.from_hf_json(tmp_path)
    assert loaded.replace(name=cfg.name) == cfg


HF_CONFIGS = ROOT / "tests" / "data" / "hf_configs"


def test_transformers_written_config_loads():
    """A config.json as transformers 5.x writes it: per-layer indexer_types / layer_types /
    mlp_layer_types, qk_head_dim, mlp_bias, output_router_logits, head_dim rewritten."""
    loaded = GLMConfig.from_hf_json(HF_CONFIGS / "glm-5.2-transformers-5.25.json")
    preset = load_config(ROOT / "configs/glm-5.2.yaml")
    assert loaded.pattern == preset.pattern
    assert loaded.index_topk_pattern is None            # kept as freq/offset: both agree
    assert loaded.head_dim == 64                        # as written; not compared
    # transformers wrote its own default token ids (0, 1); everything else is the preset
    assert loaded.replace(bos_token_id=None, eos_token_id=None).differences(preset) == []


def test_transformers_indexer_types_become_the_pattern():
    loaded = GLMConfig.from_hf_json(HF_CONFIGS / "tiny-pattern-transformers-5.25.json")
    assert loaded.index_topk_pattern == "FSFSSS"
    assert loaded.full_layers == (0, 2)


def _edited(tmp_path, **changes):
    raw = json.loads((HF_CONFIGS / "glm-5.2-transformers-5.25.json").read_text())
    raw.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    # layer 3 marked full, but freq 4 / offset 3 make it shared
    (lambda raw: {"indexer_types": raw["indexer_types"][:3] + ["full"] + raw["indexer_types"][4:]},
     r"`indexer_types` disagrees with index_topk_freq / index_skip_topk_offset at layer\(s\) \[3\]"),
    (lambda raw: {"indexer_types": raw["indexer_types"][:-1]}, r"`indexer_types` must list one of"),
    (lambda raw: {"layer_types": ["full_attention"] * 78}, r"`layer_types` must list one of \['indexed_attention'\]"),
    (lambda raw: {"mlp_layer_types": ["dense"] * 4 + ["sparse"] * 74},
     r"`mlp_layer_types` disagrees with first_k_dense_replace=3 at layer\(s\) \[3\]"),
    (lambda raw: {"mlp_bias": True}, r"`mlp_bias` is true"),
    (lambda raw: {"qk_head_dim": 192}, r"`qk_head_dim` 192 != qk_nope_head_dim 192 \+ qk_rope_head_dim 64"),
])
def test_transformers_keys_are_checked(tmp_path, changes, message):
    raw = json.loads((HF_CONFIGS / "glm-5.2-transformers-5.25.json").read_text())
    with pytest.raises(ConfigError, match=message):
        GLMConfig.from_hf_json(_edited(tmp_path, **changes(raw)))


def test_differences_compare_the_schedule_not_its_spelling():
    by_rule = load_config(ROOT / "configs/glm-5.2.yaml")
    by_pattern = by_rule.replace(index_topk_pattern=by_rule.pattern)
    assert by_rule.differences(by_pattern) == []
    assert by_rule.differences(by_rule.replace(index_topk_freq=2, index_skip_topk_offset=1)) != []


def test_default_model_config_is_glm52_shaped_and_fits_the_repository():
    cfg = load_config(ROOT / "configs" / "default-py.yaml")
    assert cfg.pattern == "FSSSFSSS" and cfg.num_nextn_predict_layers == 1 and cfg.n_routed_experts > 0
    assert cfg.max_position_embeddings >= 4096 and cfg.dtype == "bfloat16"
    assert 2 * count_params(abstract_model(cfg)) <= 36e6        # bf16 bytes: the tree stays under 40 MiB
