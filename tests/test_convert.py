"""Hugging Face checkpoint conversion: logits against an independent numpy forward, fp8
dequantisation, bit-exact export -> import round trip, and the all-at-once mismatch report."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import hf_fixtures as hf
from conftest import simulated_devices_env
from glm_jax.checkpoint import config_differences
from glm_jax.config import GLMConfig
from glm_jax.convert import CheckpointConversionError, export_hf_checkpoint, load_hf_checkpoint

TOKENS = np.array([3, 17, 42, 5, 29, 11, 60, 8, 23, 1], np.int32)   # longer than index_topk = 4


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm")
    return d, hf.write_checkpoint(d, hf.GLM, fp8_layer=1)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek")
    return d, hf.write_checkpoint(d, hf.DEEPSEEK, seed=1, fp8_layer=2, block=(8, 16), mtp_copies=True)


def _flat(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, (getattr(k, "key", k) for k in path))): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))}


@nnx.jit
def _logits_and_mtp_logits(model, tokens, next_tokens):
    """tokens, next_tokens int32 [B, S] -> (the model's logits, its MTP layer's on the next tokens), one program."""
    out = model(tokens)
    return out.logits, model.mtp_forward(out.hidden, next_tokens)[0].logits


@pytest.mark.parametrize("which", ["glm", "deepseek"])
def test_logits_match_numpy_forward(which, glm_dir, deepseek_dir):
    directory, values = glm_dir if which == "glm" else deepseek_dir
    c = hf.GLM if which == "glm" else hf.DEEPSEEK
    model = load_hf_checkpoint(directory, dtype="float32", progress=False)
    assert model.cfg.pattern == ("FFSFS" if which == "glm" else "FFFFF")
    next_tokens = np.roll(TOKENS, -1)
    logits, mtp_logits = _logits_and_mtp_logits(model, jnp.asarray(TOKENS)[None], jnp.asarray(next_tokens)[None])
    want_logits, want_hidden = hf.forward(c, values, TOKENS)
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(mtp_logits[0]), hf.mtp_forward(c, values, want_hidden, next_tokens),
                               rtol=2e-4, atol=2e-4)


def test_fp8_weights_are_dequantised(glm_dir):
    directory, values = glm_dir
    params = _flat(load_hf_checkpoint(directory, dtype="float32", progress=False))
    # layer 1 is stored fp8 with 16 x 16 blocks (ragged at the edges); stack 1 holds the groups
    # (1, 2) and (3, 4), so layer 1 is group 0, member 0 there
    np.testing.assert_array_equal(params["stacks/1/layers/0/self_attn/q_a_proj/kernel"][0],
                                  values["model.layers.1.self_attn.q_a_proj.weight"].T)
    np.testing.assert_array_equal(params["stacks/1/layers/0/mlp/gate_proj"][0, 3],
                                  values["model.layers.1.mlp.experts.3.gate_proj.weight"].T)


def test_export_import_round_trip_is_bit_exact(glm_dir, tmp_path):
    directory, values = glm_dir
    model = load_hf_checkpoint(directory, progress=False)            # bfloat16, as published
    out = export_hf_checkpoint(model, tmp_path / "export", num_shards=3, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert set(index["weight_map"]) == set(hf.all_tensors(hf.GLM))
    for file in set(index["weight_map"].values()):
        with safe_open(str(out / file), "numpy") as f:          # readable by the safetensors package
            for name in f.keys():
                got = f.get_tensor(name)
                want = values[name].astype(np.float32 if name.endswith("correction_bias") else hf.BF16)
                assert got.dtype == want.dtype, name
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)
    again = load_hf_checkpoint(out, progress=False)
    assert not config_differences(again.cfg, model.cfg)
    a, b = _flat(model), _flat(again)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key].view(np.uint8), b[key].view(np.uint8)), key


def test_deepseek_export_keeps_mtp_copies(deepseek_dir, tmp_path):
    directory, _ = deepseek_dir
    model = load_hf_checkpoint(directory, progress=False)
    out = export_hf_checkpoint(model, tmp_path / "ds", progress=False)
    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("model.layers.5.shared_head.head.weight"),
                                      f.get_tensor("lm_head.weight"))
        assert "model.layers.5.embed_tokens.weight" in f.keys()
    assert GLMConfig.from_hf_json(out).indexer_rope_interleave is False


def test_every_mismatch_is_reported_at_once(tmp_path):
    def damage(tensors):
        del tensors["model.layers.3.mlp.experts.2.up_proj.weight"]
        tensors["model.layers.2.self_attn.indexer.wk.weight"] = np.zeros((16, 32), hf.BF16)
        tensors["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((40, 8), hf.BF16)
        del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
        tensors["model.layers.4.mlp.experts.4.up_proj.weight"] = np.zeros((12, 32), hf.BF16)

    hf.write_checkpoint(tmp_path, hf.GLM, fp8_layer=1, edit=damage)
    with pytest.raises(CheckpointConversionError) as info:
        load_hf_checkpoint(tmp_path, progress=False)
    message = str(info.value)
    for expected in ["missing: model.layers.3.mlp.experts.2.up_proj.weight",
                     "unexpected: model.layers.2.self_attn.indexer.wk.weight",
                     "shape: model.layers.0.self_attn.kv_b_proj.weight is [40, 8] in the checkpoint, "
                     "the config needs [40, 16]",
                     "missing: model.layers.1.self_attn.o_proj.weight_scale_inv",
                     "unexpected: model.layers.4.mlp.experts.4.up_proj.weight",
                     "the checkpoint has experts 0..4, but n_routed_experts is 4",
                     "pattern FFFFS, the config's IndexShare pattern is FFSFS"]:
        assert expected in message
    assert len(info.value.problems) == 7


def test_config_that_disagrees_with_tensors(glm_dir):
    directory, _ = glm_dir
    cfg = GLMConfig.from_hf_json(directory)
    with pytest.raises(CheckpointConversionError) as info:
        load_hf_checkpoint(directory, config=cfg.replace(hidden_size=48, index_topk_pattern="FFFFF"), progress=False)
    message = str(info.value)
    assert "shape: model.embed_tokens.weight is [61, 32] in the checkpoint, the config needs [61, 48]" in message
    assert "missing: model.layers.2.self_attn.indexer.wk.weight" in message
    # a sparser pattern than the checkpoint's loads when the extra indexers may be dropped
    model = load_hf_checkpoint(directory, config=cfg.replace(index_topk_pattern="FSSFS"),
                               drop_unused_indexers=True, progress=False)
    assert model.cfg.full_layers == (0, 3)


def test_decode_cli_with_hf_checkpoint(glm_dir, capsys):
    import decode

    directory, _ = glm_dir
    args = ["--hf-checkpoint", str(directory), "--max-new-tokens", "3", "--temperature", "0", "--speculative", "0",
            "--quiet"]
    assert decode.main(args + ["--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "holds no tokenizer.json" in err and "--prompt-ids" in err
    assert decode.main(args + ["--prompt-ids", "3,17,42"]) == 0
    printed = capsys.readouterr().out.strip()
    new = [int(t) for t in printed.removeprefix("3,17,42").split(",") if t]
    assert printed.startswith("3,17,42,") and len(new) == 3 and all(0 <= t < 61 for t in new)


def test_train_cli_refuses_a_checkpoint_that_does_not_fit(tmp_path, capsys):
    import train

    hf.write_checkpoint(tmp_path / "ckpt", hf.GLM, edit=lambda t: t.pop("model.norm.weight"))
    assert train.main(["--init-from-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run"),
                       "--seq-len", "64"]) == 2
    assert "missing: model.norm.weight" in capsys.readouterr().err


_MESH_SCRIPT = r"""
import sys
import jax, numpy as np
from flax import nnx
from jax.sharding import Mesh
from glm_jax.convert import load_hf_checkpoint
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
model = load_hf_checkpoint(sys.argv[1], mesh=mesh, dtype="float32", progress=False)
experts = model.stacks[1].layers[0].mlp.gate_proj[...]           # [groups 2, experts 4, 32, 12]
assert experts.sharding.spec[2] == ("data", "model"), experts.sharding.spec  # largest dim 4 divides
assert len({s.index for s in experts.addressable_shards}) == 4
logits = nnx.jit(lambda model, tokens: model(tokens).logits)(model, jax.numpy.asarray([[3, 17, 42, 5, 29, 11]]))
np.save(sys.argv[2], np.asarray(logits))
"""


def test_load_onto_a_mesh_shards_the_arrays(glm_dir, tmp_path):
    import subprocess
    import sys

    directory, values = glm_dir
    env = simulated_devices_env(4)
    done = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(directory), str(tmp_path / "logits.npy")],
                          env=env, capture_output=True, text=True, cwd=str(hf.Path(__file__).parents[1]))
    assert done.returncode == 0, done.stderr[-3000:]
    want, _ = hf.forward(hf.GLM, values, np.array([3, 17, 42, 5, 29, 11]))
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy")[0], want, rtol=2e-4, atol=2e-4)
