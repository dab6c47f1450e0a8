"""Compare a checkpoint's tensors with what a config needs; collect every mismatch at once."""

from __future__ import annotations

import re

from glm_jax.config import GLMConfig
from glm_jax.convert import fp8
from glm_jax.convert.files import CheckpointFiles
from glm_jax.convert.names import ParamSpec, mtp_copies

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_MAX_LISTED = 200


class CheckpointConversionError(ValueError):
    """A checkpoint that does not fit its config; `.problems` lists every mismatch by tensor name."""

    def __init__(self, where: str, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:_MAX_LISTED])
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more (see .problems)" if len(problems) > _MAX_LISTED else ""
        super().__init__(
            f"{where} does not match the model config: {len(problems)} problem(s)\n  {shown}{more}\n"
            "Fix config.json (or the config passed in) to describe these tensors, or point at the "
            "checkpoint written for this config.")


def shared_layer_indexers(cfg: GLMConfig, names: set[str]) -> set[str]:
    """Indexer tensors the checkpoint carries on layers the config makes Shared."""
    shared = {i for i, full in enumerate(cfg.layer_is_full) if not full}
    out = set()
    for name in names:
        m = _LAYER.fullmatch(name)
        if m and int(m.group(1)) in shared and m.group(2).startswith("self_attn.indexer."):
            out.add(name)
    return out


def find_problems(cfg: GLMConfig, specs: list[ParamSpec], ckpt: CheckpointFiles, *,
                  drop_unused_indexers: bool = False) -> list[str]:
    """Missing, unexpected and wrongly shaped tensors, and config keys the tensors contradict."""
    problems = list(ckpt.problems)
    have = ckpt.names
    used: set[str] = set()
    for spec in specs:
        for name in spec.names.flat:
            used.add(name)
            if name not in have:
                problems.append(f"missing: {name} (for {spec.key})")
                continue
            if ckpt.is_quantized(name):
                used.add(name + fp8.SCALE_SUFFIX)
                issue = ckpt.quantization_problem(name)
                if issue:
                    problems.append(issue)
            if ckpt.shape(name) != spec.checkpoint_shape:
                problems.append(f"shape: {name} is {list(ckpt.shape(name))} in the checkpoint, the config "
                                f"needs {list(spec.checkpoint_shape)}")
    shapes = {spec.names.flat[0]: spec.checkpoint_shape for spec in specs if spec.names.ndim == 0}
    for copy, original in mtp_copies(cfg).items():
        if copy in have:
            used.add(copy)
            if ckpt.shape(copy) != shapes[original]:
                problems.append(f"shape: {copy} is {list(ckpt.shape(copy))}, a copy of {original} "
                                f"needs {list(shapes[original])}")
    if drop_unused_indexers:
        dropped = shared_layer_indexers(cfg, have)
        used |= dropped | {n + fp8.SCALE_SUFFIX for n in dropped}
    unexpected = sorted(have - used, key=natural_key)
    problems += [f"unexpected: {name}" for name in unexpected]
    return problems + config_hints(cfg, have, drop_unused_indexers)


def config_hints(cfg: GLMConfig, names: set[str], drop_unused_indexers: bool) -> list[str]:
    """Config keys the set of tensor names contradicts, each with the value the tensors imply."""
    layers: dict[int, set[str]] = {}
    for name in names:
        m = _LAYER.fullmatch(name)
        if m:
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
    hints = []
    expected_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    if layers and max(layers) + 1 != expected_layers:
        hints.append(f"config: the checkpoint has layers 0..{max(layers)}, but num_hidden_layers "
                     f"{cfg.num_hidden_layers} + num_nextn_predict_layers {cfg.num_nextn_predict_layers} "
                     f"= {expected_layers} layers")
    decoder = [layers.get(i, set()) for i in range(cfg.num_hidden_layers)]
    found = "".join("F" if any(s.startswith("self_attn.indexer.") for s in sub) else "S" for sub in decoder)
    wants_indexer_where_missing = any(f and p == "S" for f, p in zip(cfg.layer_is_full, found))
    if found != cfg.pattern and (wants_indexer_where_missing or not drop_unused_indexers):
        hints.append(f"config: the checkpoint carries indexers in pattern {found}, the config's IndexShare "
                     f"pattern is {cfg.pattern} (set index_topk_pattern, or index_topk_freq / "
                     "index_skip_topk_offset; a pattern with fewer Full layers loads with "
                     "drop_unused_indexers=True)")
    dense = [i for i, sub in enumerate(decoder) if "mlp.gate_proj.weight" in sub]
    implied = len(dense) if dense == list(range(len(dense))) else None
    if dense and implied != cfg.first_k_dense_replace:
        hints.append(f"config: dense MLP tensors on layers {dense}, but first_k_dense_replace is "
                     f"{cfg.first_k_dense_replace}")
    experts = {int(m.group(1)) for sub in decoder for s in sub if (m := re.match(r"mlp\.experts\.(\d+)\.", s))}
    if experts and max(experts) + 1 != cfg.n_routed_experts:
        hints.append(f"config: the checkpoint has experts 0..{max(experts)}, but n_routed_experts is "
                     f"{cfg.n_routed_experts}")
    return hints


def natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
