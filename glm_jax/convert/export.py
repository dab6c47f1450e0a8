"""Write a GLMModel as a Hugging Face checkpoint in the layout it was loaded from.

    export_hf_checkpoint(model, "out/", num_shards=4)

writes config.json, the tensors in `dtype` (bf16 by default; the routing correction biases stay
float32 as in the published checkpoints) split into num_shards files of about equal size named
model-0000k-of-0000n.safetensors with model.safetensors.index.json (one file: model.safetensors),
streaming one tensor at a time from the devices to disk.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from glm_jax.config import GLMConfig
from glm_jax.convert.check import natural_key
from glm_jax.convert.files import INDEX_FILE
from glm_jax.convert.names import ParamSpec, lookup, mtp_copies, param_specs
from glm_jax.convert.progress import Progress
from glm_jax.convert.safetensors_io import write_file

_ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
_KEEP_FLOAT32 = ("e_score_correction_bias",)


def hf_config(cfg: GLMConfig, dtype: str) -> dict:
    """config.json contents: every config key plus architectures and torch_dtype."""
    values = {k: v for k, v in cfg.to_dict().items() if k not in ("name", "dtype")}
    return {"architectures": [_ARCHITECTURES.get(cfg.model_type, "GlmMoeDsaForCausalLM")],
            "torch_dtype": dtype, **values}


def export_hf_checkpoint(model, directory: str | Path, *, dtype: str = "bfloat16", num_shards: int = 1,
                         write_mtp_copies: bool | None = None, tokenizer_file: str | Path | None = None,
                         progress: bool = True) -> Path:
    """Write `model` to `directory`. write_mtp_copies: also store the embedding and lm_head under
    the MTP layer (default: for deepseek_v32, whose checkpoints carry them). -> the directory."""
    cfg = model.cfg
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = nnx.to_pure_dict(nnx.state(model))
    out_dtype = np.dtype(jax.numpy.dtype(dtype))
    entries: dict[str, tuple[ParamSpec, tuple, np.dtype]] = {}
    for spec in param_specs(cfg):
        keep = spec.path[-1] in _KEEP_FLOAT32
        for pos in np.ndindex(spec.names.shape):
            entries[spec.names[pos]] = (spec, pos, np.dtype(np.float32) if keep else out_dtype)
    if write_mtp_copies if write_mtp_copies is not None else cfg.model_type == "deepseek_v32":
        entries.update({copy: entries[original] for copy, original in mtp_copies(cfg).items()})
    names = sorted(entries, key=natural_key)

    def nbytes(name):
        spec, _, dt = entries[name]
        return int(np.prod(spec.checkpoint_shape)) * dt.itemsize

    def produce(name):
        spec, pos, dt = entries[name]
        value = lookup(state, spec.path)
        tensor = np.asarray(jax.device_get(value[pos] if pos else value))
        tensor = tensor.T if spec.transpose else tensor
        bar.advance(tensor.size * dt.itemsize, name)
        return tensor.astype(dt)

    shards = split_evenly(names, [nbytes(n) for n in names], num_shards)
    total = sum(map(nbytes, names))
    bar = Progress(f"exporting to {directory.name}", total, enabled=progress)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = "model.safetensors" if num_shards == 1 else f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        write_file(directory / file, [(n, entries[n][2], entries[n][0].checkpoint_shape) for n in shard], produce,
                   metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    bar.close()
    if num_shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    if tokenizer_file is not None:
        shutil.copy(tokenizer_file, directory / "tokenizer.json")
    return directory


def split_evenly(names: list[str], sizes: list[int], parts: int) -> list[list[str]]:
    """Cut the ordered names into `parts` contiguous non-empty runs of about equal total size."""
    if parts > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {parts} shards")
    total, runs, current, acc = sum(sizes), [], [], 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        current.append(name)
        acc += size
        remaining_names, remaining_runs = len(names) - i - 1, parts - len(runs) - 1
        if remaining_runs and (acc >= total * (len(runs) + 1) / parts or remaining_names == remaining_runs):
            runs.append(current)
            current = []
    runs.append(current)
    return runs
