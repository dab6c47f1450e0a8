"""Logical axes: every parameter of the layers names its dimensions (Flax NNX sharding
metadata), one rules table maps them to any mesh, the library's own mesh gets the shardings it
always had, and misuse is one line naming the argument. The model of docs/using-the-layers.md
on 4 simulated devices (library mesh, jax.make_mesh's Explicit axes, a batch/model mesh with
rules of its own) gives the single-device losses, and GLMModel its logits
(`logical_axes_checks.py`, in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from conftest import simulated_devices_env
from glm_jax import load_config
from glm_jax.layers import (DecoderLayer, Embed, ForwardOptions, GroupOutput, IndexShareGroup, Indexer, LayerKind,
                            Linear, MLAProjection, MLP, MoE, MTPLayer, RMSNorm)
from glm_jax.logical_axes import LOGICAL_AXES, param
from glm_jax.model import abstract_model, init_model
from glm_jax.sharding import (LOGICAL_AXIS_RULES, TRAINING_RULES, ShardingError, _path_str, logical_spec, make_rules,
                              param_shardings, use_rules)

HERE = Path(__file__).resolve().parent
LIBRARY_MESH = AbstractMesh((2, 1, 2, 2), ("data", "context", "tensor", "layer"))
FULL, SHARED = LayerKind(is_full=True, is_moe=False), LayerKind(is_full=False, is_moe=False)


def _specs(module) -> dict[str, P]:
    return {_path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(nnx.get_partition_spec(nnx.state(module)))}


def test_every_parameter_of_the_layers_names_its_dimensions():
    cfg = load_config("tiny")                                         # MoE, shared experts, MTP
    assert any(cfg.layer_is_moe) and cfg.num_nextn_predict_layers and cfg.n_shared_experts
    model = abstract_model(cfg)
    shapes = {_path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))}
    specs = _specs(model)
    assert specs.keys() == shapes.keys()
    for path, spec in specs.items():
        assert len(spec) == len(shapes[path]) and all(n in LOGICAL_AXES for n in spec), (path, spec)
    assert specs["stacks/0/layers/0/self_attn/q_b_proj/kernel"] == P("stack", "q_lora", "heads")
    assert specs["embed_tokens/embedding"] == P("vocab", "embed")
    assert specs["mtp/block/layers/0/mlp/gate_proj"] == P("experts", "embed", "expert_mlp")
    small = load_config("tiny-attention")                             # the compiled init keeps the names
    assert _specs(init_model(small)) == _specs(abstract_model(small))
    rngs = nnx.Rngs(0)
    for layer in (IndexShareGroup(cfg, (FULL, SHARED), rngs=rngs), DecoderLayer(cfg, FULL, rngs=rngs),
                  MLAProjection(cfg, rngs=rngs), Indexer(cfg, rngs=rngs), MoE(cfg, rngs=rngs), MTPLayer(cfg, rngs=rngs),
                  MLP(8, 16, rngs=rngs), RMSNorm(8), Embed(10, 8, rngs=rngs)):
        assert all(len(s) for s in _specs(layer).values()), type(layer).__name__


def test_the_library_mesh_gets_the_shardings_it_always_had():
    """tests/data/param_specs_tiny.json: every parameter's PartitionSpec on data=2,tensor=2,layer=2
    by LOGICAL_AXIS_RULES and TRAINING_RULES, as the path-matched table gave them before the
    parameters carried their names."""
    want = json.loads((HERE / "data" / "param_specs_tiny.json").read_text())
    state = nnx.state(abstract_model(load_config("tiny")))
    got = {}
    for name, rules in (("default", LOGICAL_AXIS_RULES), ("train", TRAINING_RULES)):
        for p, s in jax.tree_util.tree_leaves_with_path(param_shardings(state, LIBRARY_MESH, rules)):
            got[f"{name}|{_path_str(p)}"] = str(s.spec)
    assert got == want


class _UserHead(nnx.Module):
    """A layer of a user's own, annotated the Flax way and with `param`."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"), eager_sharding=False)
        self.w = nnx.Param(init(rngs.params(), (8, 12)))
        self.b = param(jnp.zeros((12,)), ("vocab",))
        self.plain = nnx.Param(jnp.zeros((3,)))


def test_a_users_layer_is_sharded_by_its_own_annotation():
    state = nnx.state(_UserHead(nnx.Rngs(0)))
    shardings = param_shardings(state, LIBRARY_MESH)
    assert (shardings["w"].get_value().spec, shardings["b"].get_value().spec, shardings["plain"].get_value().spec) \
        == (P(None, "tensor"), P("tensor"), P(None))
    mesh = AbstractMesh((2, 2), ("batch", "model"))
    rules = make_rules(batch="batch", vocab="model")
    assert param_shardings(state, mesh, rules)["w"].get_value().spec == P(None, "model")
    with use_rules(rules):
        assert param_shardings(state, mesh)["b"].get_value().spec == P("model")
        assert logical_spec(("batch", "vocab")) == P("batch", "model")
    assert logical_spec(("batch", "vocab")) == P("data", "tensor")


def test_rules_errors_name_the_axis_and_the_fix():
    state = nnx.state(_UserHead(nnx.Rngs(0)))
    mesh = AbstractMesh((2, 2), ("batch", "model"))
    with pytest.raises(ShardingError, match=r"parameter \w: logical axis 'vocab' maps to mesh axis 'tensor', which the "
                                            r"mesh lacks \(its axes: batch, model\); map 'vocab' to one of them"):
        param_shardings(state, mesh)                                   # the library's rules on a mesh of other names
    with pytest.raises(ShardingError, match=r"logical axis 'vocab' has no rule; add 'vocab': <mesh axis or None>"):
        param_shardings(state, mesh, {"embed": None})
    with pytest.raises(ShardingError, match=r"'vocab' maps to mesh axis 'modle', which the mesh lacks"):
        param_shardings(state, mesh, make_rules(vocab="modle"))
    with pytest.raises(ValueError, match=r"make_rules: 'head' is not a logical axis; the logical axes are batch"):
        make_rules(head="model")
    with pytest.raises(ShardingError, match=r"mesh axis 'model' would split both 'embed' and 'vocab'"):
        param_shardings(state, mesh, make_rules(embed="model", vocab="model"))
    with pytest.raises(TypeError, match=r"rules: 'vocab' maps to 2; a rule's value is a mesh axis name"):
        use_rules({"vocab": 2})
    assert isinstance(ShardingError("x"), ValueError)


def test_misuse_is_one_line_naming_the_layers_argument():
    cfg = load_config("tiny-attention")
    group = IndexShareGroup(cfg, (FULL, SHARED), rngs=nnx.Rngs(0))
    x = jnp.zeros((2, 8, cfg.hidden_size))
    with pytest.raises(ValueError, match=rf"IndexShareGroup: x has hidden size 32 \(shape \(2, 8, 32\)\), but "
                                         rf"cfg.hidden_size is {cfg.hidden_size}"):
        group(jnp.zeros((2, 8, 32)))
    with pytest.raises(ValueError, match=r"IndexShareGroup: positions must have shape \(2, 8\), got shape \(8,\)"):
        group(x, jnp.arange(8, dtype=jnp.int32))
    with pytest.raises(TypeError, match=r"IndexShareGroup: options must be a ForwardOptions .*got str 'sparse'"):
        group(x, options="sparse")
    with pytest.raises(ValueError, match=r"IndexShareGroup: kv_len must have shape \(2,\), got shape \(\)"):
        group(x, kv_len=jnp.int32(8))
    with pytest.raises(ValueError, match=r"Linear: x has shape \(4, 5\), but the layer takes in_features=6"):
        Linear(6, 3, rngs=nnx.Rngs(0))(jnp.zeros((4, 5)))
    with pytest.raises(TypeError, match=r"MLAProjection: cfg must be a GLMConfig"):
        MLAProjection(cfg.to_dict(), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"Linear: param_dtype must be a floating dtype .*got 'int8'"):
        Linear(2, 2, rngs=nnx.Rngs(0), param_dtype="int8")
    with pytest.raises(ValueError, match=r"RMSNorm: x has shape \(2, 5\), but the layer normalises a last dimension of 4"):
        RMSNorm(4)(jnp.ones((2, 5)))
    with pytest.raises(ValueError, match=r"Embed: ids must hold integers"):
        Embed(4, 2, rngs=nnx.Rngs(0))(jnp.zeros((2,)))
    model = abstract_model(cfg)
    with pytest.raises(TypeError, match=r"GLMModel: options must be a ForwardOptions .*got str 'dense'"):
        model(jnp.zeros((1, 4), jnp.int32), options="dense")
    with pytest.raises(ValueError, match=r"GLMModel: tokens must be token ids int32 \[batch, sequence\], got int32 \(4,\)"):
        model(jnp.zeros((4,), jnp.int32))


def test_the_group_is_called_like_a_flax_module():
    cfg = load_config("tiny-attention")
    group = IndexShareGroup(cfg, (FULL, SHARED), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.hidden_size))
    out = group(x)                                            # positions, lengths and options defaulted
    assert isinstance(out, GroupOutput) and out.x.shape == x.shape and out.indices.shape == (2, 8, cfg.index_topk)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    again = group.forward(x, positions, jnp.full((2,), 8, jnp.int32), ForwardOptions())
    np.testing.assert_array_equal(again.x, out.x)
    x_out, kl, latent, indices = out                          # still unpacks as the 4-tuple it was
    assert latent.shape == (2, 8, cfg.kv_lora_rank + cfg.qk_rope_head_dim) and kl.shape == ()
    layer = group.layers[0]                                    # finer grain: ForwardOptions defaulted
    h, q_resid, _, _, _ = layer.attention_inputs(x, positions)
    keys = layer.indexer.keys(h, positions)
    np.testing.assert_array_equal(layer.indexer.select(h, q_resid, positions, keys, jnp.full((2,), 8, jnp.int32)),
                                  indices)
    assert RMSNorm(4).eps == 1e-6 and group.layers[0].input_layernorm.eps == cfg.rms_norm_eps


def test_dtype_computes_and_param_dtype_stores():
    cfg = load_config("tiny-attention")
    group = IndexShareGroup(cfg, (FULL,), rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(group, nnx.Param))} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
    assert group.layers[0].self_attn.q_b_proj.kernel.dtype == jnp.bfloat16
    assert group.layers[0].indexer.weights_proj.kernel.dtype == jnp.float32      # kept float32, as before
    linear = Linear(4, 3, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert linear.kernel.dtype == jnp.float32 and linear(jnp.ones((2, 4))).dtype == jnp.bfloat16
    assert Linear(4, 3, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)(jnp.ones((2, 4))).dtype == jnp.bfloat16
    f32 = IndexShareGroup(cfg, (FULL,), rngs=nnx.Rngs(0))
    assert f32.layers[0].self_attn.q_b_proj.kernel.dtype == jnp.dtype(cfg.dtype)


@pytest.fixture(scope="module")
def mesh_losses() -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "logical_axes_checks.py")], env=simulated_devices_env(4),
                          capture_output=True, text=True, timeout=600, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_users_model_on_any_mesh_gives_the_single_device_losses(mesh_losses):
    assert mesh_losses["devices"] == 4
    cases = mesh_losses["cases"]
    single = cases.pop("single")
    assert single[-1] == 0 and single[-2] < single[0]
    assert set(cases) == {"library mesh", "jax.make_mesh explicit", "batch/model explicit", "batch/model auto"}
    for name, got in cases.items():
        assert isinstance(got, list), (name, got)
        assert got[-1] > 0, (name, "no parameter was split")
        np.testing.assert_allclose(got[:-1], single[:-1], rtol=2e-5, err_msg=name)


def test_the_model_on_any_mesh_gives_the_one_device_logits(mesh_losses):
    diffs = mesh_losses["model"]
    assert set(diffs) == {"library mesh", "jax.make_mesh explicit", "batch/model explicit"}
    assert all(d < 1e-4 for d in diffs.values()), diffs
