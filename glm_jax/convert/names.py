"""How the model's parameters map to the tensor names of `glm_moe_dsa` / `deepseek_v32` checkpoints.

Checkpoint layout (per decoder layer i, `model.layers.{i}.` prefix; the MTP layer is index
num_hidden_layers and adds enorm, hnorm, eh_proj, shared_head.norm):

    input_layernorm.weight, post_attention_layernorm.weight                      [H]
    self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}.weight  [out, in]
    self_attn.{q_a_layernorm, kv_a_layernorm}.weight
    self_attn.indexer.{wq_b, wk, weights_proj}.weight, self_attn.indexer.k_norm.{weight, bias}
                                                                     (Full layers only)
    mlp.{gate_proj, up_proj, down_proj}.weight                          (dense layers)
    mlp.gate.weight [E, H], mlp.gate.e_score_correction_bias [E],
    mlp.experts.{e}.{gate_proj, up_proj, down_proj}.weight, mlp.shared_experts.*  (MoE layers)
plus model.embed_tokens.weight [V, H], model.norm.weight, lm_head.weight [V, H].

Ours: Linear kernels are [in, out] (checkpoint weights transposed), routed experts are stacked
[E, in, out], and the layers of a stack of IndexShare groups carry a leading group axis (see
layers/decoder.plan_groups). A `ParamSpec` says, for one of our arrays, which checkpoint tensor
fills each slot of its leading (group, expert) axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from glm_jax.config import GLMConfig
from glm_jax.layers.decoder import plan_groups


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One model array. names: object array [*lead] of checkpoint names; each checkpoint tensor
    (transposed when `transpose`) is one [*shape[len(lead):]] slot of the array [*shape]."""

    path: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    names: np.ndarray
    transpose: bool

    @property
    def key(self) -> str:
        return "/".join(map(str, self.path))

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return self.shape[self.names.ndim:]

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """Shape of each checkpoint tensor ([out, in] for Linear weights)."""
        return self.slot_shape[::-1] if self.transpose else self.slot_shape


def _layer_tensor(rest: tuple[str, ...]) -> tuple[str, bool, bool]:
    """Path inside a decoder layer -> (name suffix with `{e}` for an expert, transpose, per expert)."""
    if rest[0] == "indexer":
        rest = ("self_attn",) + rest
    if rest[:2] == ("mlp", "router"):
        return "mlp.gate.weight", False, False
    if rest[:2] == ("mlp", "e_score_correction_bias"):
        return "mlp.gate.e_score_correction_bias", False, False
    if len(rest) == 2 and rest[0] == "mlp" and rest[1] in ("gate_proj", "up_proj", "down_proj"):
        return f"mlp.experts.{{e}}.{rest[1]}.weight", True, True
    if rest[-1] == "kernel":
        return ".".join(rest[:-1]) + ".weight", True, False
    return ".".join(rest), False, False


def _top_tensor(path: tuple[str, ...], mtp_layer: int) -> tuple[str, bool]:
    """Path outside the decoder stacks -> (checkpoint name, transpose)."""
    fixed = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", False),
             ("norm", "weight"): ("model.norm.weight", False),
             ("lm_head", "kernel"): ("lm_head.weight", True)}
    if path in fixed:
        return fixed[path]
    if path[0] == "mtp":
        transpose = path[-1] == "kernel"
        inner = path[1:-1] + ("weight",) if transpose else path[1:]
        return f"model.layers.{mtp_layer}." + ".".join(inner), transpose
    raise KeyError(f"no checkpoint name for parameter {'/'.join(path)}")


def _path(keys) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keys)


def abstract_state(cfg: GLMConfig) -> dict:
    """The model's variables as a nested dict of ShapeDtypeStructs (no memory)."""
    from glm_jax.model import abstract_model

    model = abstract_model(cfg)
    return nnx.to_pure_dict(nnx.state(model))


def param_specs(cfg: GLMConfig) -> list[ParamSpec]:
    """Every variable of GLMModel(cfg), with the checkpoint tensors that fill it."""
    plan = plan_groups(cfg)
    specs = []
    for keys, leaf in jax.tree_util.tree_leaves_with_path(abstract_state(cfg)):
        path = _path(keys)
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        if path[0] == "stacks" or path[:2] == ("mtp", "block"):
            if path[0] == "stacks":
                stack = plan[path[1]]
                layers = [stack.first_layer + g * len(stack.kinds) + path[3] for g in range(stack.count)]
                rest = path[4:]
            else:
                layers, rest = [cfg.num_hidden_layers], path[4:]
            suffix, transpose, per_expert = _layer_tensor(tuple(map(str, rest)))
            experts = range(cfg.n_routed_experts) if per_expert else [None]
            names = np.array([[f"model.layers.{i}." + suffix.format(e=e) for e in experts] for i in layers],
                             dtype=object)
            names = names if per_expert else names[:, 0]
            if path[0] == "mtp":
                names = names.reshape(names.shape[1:])
        else:
            name, transpose = _top_tensor(tuple(map(str, path)), cfg.num_hidden_layers)
            names = np.array(name, dtype=object)
        specs.append(ParamSpec(path, shape, dtype, names, transpose))
    return specs


def mtp_copies(cfg: GLMConfig) -> dict[str, str]:
    """Copies of the embedding and lm_head some checkpoints keep in the MTP layer (DeepSeek's
    do): their name -> the name of the tensor they copy. The model reuses its own."""
    if not cfg.num_nextn_predict_layers:
        return {}
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return {prefix + "embed_tokens.weight": "model.embed_tokens.weight",
            prefix + "shared_head.head.weight": "lm_head.weight"}


def lookup(tree: dict, path: tuple):
    """tree[path[0]][path[1]]... (a leaf of a nested state dict)."""
    for key in path:
        tree = tree[key]
    return tree


def nest(flat: dict[tuple, Any]) -> dict:
    """{path tuple: leaf} -> the nested dict nnx.replace_by_pure_dict takes."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
