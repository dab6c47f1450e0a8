"""Model directories: config.yaml + tokenizer.json + params/ (an orbax checkpoint of the weights)
+ params.files.json (params/'s files and their sizes, checked before a restore reads them).

`save_model_dir` writes one, `load_model_dir` rebuilds the model from it. A directory made by
train.py also holds checkpoints/ (the training state, see glm_jax.training.checkpointing);
the exported params/ is what decoding needs. `load_model` reads a model directory or a Hugging
Face checkpoint (glm_jax.convert), whichever a `ModelSource` names.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax import faults
from glm_jax.checkpoint_damage import (MANIFEST_NAME, DamagedFilesError, check_file_manifest, damage_summary,
                                      restoring, write_file_manifest)
from glm_jax.config import GLMConfig, load_config, save_config
from glm_jax.convert import load_hf_checkpoint
from glm_jax.extras import require
from glm_jax.model import GLMModel, abstract_model
from glm_jax.multihost import barrier, is_main_process

ocp = require("orbax.checkpoint")


class CheckpointMismatchError(ValueError):
    """A checkpoint that was written for a different configuration."""


class CheckpointDamagedError(ValueError):
    """A checkpoint whose files cannot be read back (truncated, overwritten, half written)."""


def config_differences(a: GLMConfig, b: GLMConfig) -> list[str]:
    """Keys whose values change the model and differ, as 'key: a != b' (`GLMConfig.differences`)."""
    return a.differences(b)


def check_same_config(checkpoint_cfg: GLMConfig, requested: GLMConfig, where: str) -> None:
    diffs = config_differences(checkpoint_cfg, requested)
    if diffs:
        raise CheckpointMismatchError(
            f"{where} was written for config {checkpoint_cfg.name!r}, which differs from the requested "
            f"{requested.name!r} in: {'; '.join(diffs[:8])}{' ...' if len(diffs) > 8 else ''}. "
            "Drop --config to use the checkpoint's own, or point at a checkpoint of this config.")


def save_model_dir(directory: str | Path, model: GLMModel, *, dtype: str | None = None,
                   tokenizer_file: str | Path | None = None) -> Path:
    """Write config.yaml, params/ (cast to `dtype` if given), params.files.json and a copy of
    tokenizer.json.

    With several processes every one calls it (each writes its shards of the params); process 0
    writes the other files."""
    directory = Path(directory).absolute()
    params = nnx.to_pure_dict(nnx.state(model))
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    if is_main_process():
        directory.mkdir(parents=True, exist_ok=True)
        save_config(model.cfg, directory / "config.yaml")
        (directory / MANIFEST_NAME).unlink(missing_ok=True)      # describes the params/ replaced here
        if (directory / "params").exists():
            shutil.rmtree(directory / "params")
        if tokenizer_file is not None and Path(tokenizer_file).resolve() != (directory / "tokenizer.json").resolve():
            shutil.copy(tokenizer_file, directory / "tokenizer.json")
    barrier("params/ removed")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", params)
        faults.reached("export")                # the files being written (asynchronously)
    barrier("params/ written")
    if is_main_process():
        write_file_manifest(directory / "params")
    return directory


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights are: a model directory (config.yaml, params/, tokenizer.json; what
    train.py writes) or, with `hf`, a Hugging Face checkpoint directory (config.json,
    *.safetensors, tokenizer.json if it has one)."""

    path: Path
    hf: bool = False

    @property
    def config_file(self) -> Path:
        return self.path / ("config.json" if self.hf else "config.yaml")

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"

    @classmethod
    def of(cls, *, checkpoint: str | None = None, hf_checkpoint: str | None = None) -> "ModelSource | None":
        """The source a front end names: a Hugging Face checkpoint, else a model directory, else None."""
        if hf_checkpoint:
            return cls(Path(hf_checkpoint), hf=True)
        return cls(Path(checkpoint)) if checkpoint else None


def load_model(source: ModelSource, *, config: GLMConfig | None = None, dtype: str | None = None) -> GLMModel:
    """The model of `source`, on this process's first device.

    config: the model to build. A model directory's config.yaml must equal it; a Hugging Face
    checkpoint is read with it in place of its config.json (e.g. another IndexShare pattern), and
    its tensors must fit it. dtype: the compute dtype in place of the config's."""
    if source.hf:
        return load_hf_checkpoint(source.path, config=config, dtype=dtype)
    return load_model_dir(source.path, config=config, dtype=dtype)


def load_model_dir(directory: str | Path, *, config: GLMConfig | None = None, dtype: str | None = None) -> GLMModel:
    """Rebuild the model saved in `directory`; `config`, if given, must match the saved one;
    `dtype`: the compute dtype in place of the saved config's."""
    directory = Path(directory).absolute()
    if (directory / "checkpoints").is_dir() and not (directory / "params").exists():
        raise FileNotFoundError(f"{directory} holds a training run that has not exported its weights yet (no "
                                f"params/): from the project root, {sys.executable} scripts/export_checkpoint.py "
                                f"{directory} writes its newest checkpoint's; or continue it with train.py --resume")
    if not (directory / "config.yaml").exists() or not (directory / "params").exists():
        raise FileNotFoundError(f"{directory} is not a model directory (expected config.yaml and params/; "
                                "train.py writes them, and checkpoints/default ships one)")
    cfg = load_config(directory / "config.yaml")
    if config is not None:
        check_same_config(cfg, config, str(directory))
    try:
        check_file_manifest(directory / "params")
    except DamagedFilesError as e:
        raise CheckpointDamagedError(f"{directory}/params is damaged: {e}; copy the model directory again "
                                     "(or re-export it from its training run)") from e
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    abstract = abstract_model(cfg)
    graphdef, abstract_state = nnx.split(abstract)
    # Restore onto this process's default device, whatever machine the checkpoint was written on.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(abstract_state))
    with restoring(), ocp.StandardCheckpointer() as ckptr:
        try:
            meta = ckptr.metadata(directory / "params")
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            raise CheckpointDamagedError(f"{directory}/params cannot be read: {damage_summary(e)}; "
                                         "copy the model directory again (or re-export it)") from e
        _check_tree_shapes(meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta, target, directory)
        try:
            restored = ckptr.restore(directory / "params", target)
        except Exception as e:  # noqa: BLE001
            raise CheckpointDamagedError(f"{directory}/params is damaged: {damage_summary(e)}; copy the model "
                                         "directory again (or re-export it from its training run)") from e
    restored = jax.tree.map(lambda x, t: jnp.asarray(x, t.dtype), restored, target)
    nnx.replace_by_pure_dict(abstract_state, restored)
    return nnx.merge(graphdef, abstract_state)


def _check_tree_shapes(saved, target, directory) -> None:
    """Raise CheckpointMismatchError naming every tensor whose presence or shape differs."""
    def flat(tree):
        out = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            out["/".join(str(getattr(p, "key", p)) for p in path)] = tuple(getattr(leaf, "shape", ()) or ())
        return out
    try:
        have, want = flat(saved), flat(target)
    except Exception:  # metadata format of another orbax version: let restore speak
        return
    problems = [f"missing {k}" for k in want if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want]
    problems += [f"{k}: saved {have[k]} vs model {want[k]}" for k in want if k in have and have[k] != want[k]]
    if problems:
        raise CheckpointMismatchError(f"{directory}/params does not match its config.yaml: "
                                      + "; ".join(problems[:10]))
