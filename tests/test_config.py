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
