"""Load a Hugging Face `glm_moe_dsa` / `deepseek_v32` checkpoint into GLMModel, tensor by tensor.

    model = load_hf_checkpoint("GLM-5.2-FP8/")                          # one device
    model = load_hf_checkpoint(dir, mesh=mesh)                          # default layout on a mesh
    model = load_hf_checkpoint(dir, shardings=lambda key, shape: ...)   # your layout

Every tensor name and shape is checked against the config from the headers alone, before any
data is read; all mismatches are raised together in one CheckpointConversionError. Then each
model array is assembled per device shard from the checkpoint tensors it needs (fp8 weights
dequantised, [out, in] transposed to [in, out], experts and IndexShare groups stacked) and put
straight onto its device(s), so host memory holds one shard at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from glm_jax.config import GLMConfig
from glm_jax.convert.check import CheckpointConversionError, find_problems
from glm_jax.convert.files import CheckpointFiles
from glm_jax.convert.names import ParamSpec, nest, param_specs
from glm_jax.convert.progress import Progress

ShardingChoice = Callable[[str, tuple[int, ...]], Sharding] | Mapping[str, Sharding] | None


def default_mesh_sharding(mesh: Mesh) -> Callable[[str, tuple[int, ...]], Sharding]:
    """A simple fully-sharded layout: each array's largest dimension that the mesh size divides is
    split over all mesh axes; arrays with no such dimension are replicated."""
    axes = tuple(mesh.axis_names)

    def choose(key: str, shape: tuple[int, ...]) -> Sharding:
        dims = sorted((d for d in range(len(shape)) if shape[d] % mesh.size == 0), key=lambda d: -shape[d])
        spec = [None] * len(shape)
        if dims:
            spec[dims[0]] = axes
        return NamedSharding(mesh, PartitionSpec(*spec))

    return choose


def load_hf_checkpoint(directory: str | Path, *, config: GLMConfig | None = None, dtype: str | None = None,
                       shardings: ShardingChoice = None, mesh: Mesh | None = None,
                       drop_unused_indexers: bool = False, progress: bool = True):
    """-> GLMModel with the checkpoint's weights.

    config: defaults to the directory's config.json; dtype overrides its `dtype` (activations
    and most weights). shardings: a mapping or a function (param key 'stacks/2/layers/0/mlp/
    gate_proj', shape) -> jax.sharding.Sharding; else `mesh` with default_mesh_sharding; else
    the first local device. drop_unused_indexers: accept (and skip) indexer tensors of layers
    the config makes Shared, to load an all-Full checkpoint with a sparser IndexShare pattern."""
    directory = Path(directory)
    ckpt = CheckpointFiles(directory)
    cfg = config or GLMConfig.from_hf_json(directory / "config.json")
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    specs = param_specs(cfg)
    problems = find_problems(cfg, specs, ckpt, drop_unused_indexers=drop_unused_indexers)
    if problems:
        raise CheckpointConversionError(str(directory), problems)
    choose = _sharding_chooser(shardings, mesh)
    total = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in specs)
    bar = Progress(f"loading {directory.name}", total, enabled=progress)
    arrays = {}
    for spec in specs:
        arrays[spec.path] = build_array(spec, ckpt.read, choose(spec.key, spec.shape))
        bar.advance(int(np.prod(spec.shape)) * spec.dtype.itemsize, spec.key)
    bar.close()
    return assemble_model(cfg, arrays)


def assemble_model(cfg: GLMConfig, arrays: dict[tuple, jax.Array]):
    """GLMModel(cfg) holding `arrays` ({state path: array}, every variable), without initialising."""
    from glm_jax.model import abstract_model

    graphdef, state = nnx.split(abstract_model(cfg))
    nnx.replace_by_pure_dict(state, nest(arrays))
    return nnx.merge(graphdef, state)


def _sharding_chooser(shardings: ShardingChoice, mesh: Mesh | None):
    if callable(shardings):
        return shardings
    if shardings is not None:
        return lambda key, shape: shardings[key]
    if mesh is not None:
        return default_mesh_sharding(mesh)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return lambda key, shape: device


def build_array(spec: ParamSpec, read: Callable[[str], np.ndarray], sharding: Sharding) -> jax.Array:
    """Assemble one model array in `sharding`, reading only the tensors each distinct shard needs."""
    by_index: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(spec.shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        by_index.setdefault(key, [index]).append(device)
    pieces = []
    for index, *devices in by_index.values():
        block = host_block(spec, index, read)
        pieces += [jax.device_put(block, d) for d in devices]
        del block
    return jax.make_array_from_single_device_arrays(spec.shape, sharding, pieces)


def host_block(spec: ParamSpec, index: tuple[slice, ...], read: Callable[[str], np.ndarray]) -> np.ndarray:
    """The part `index` (slices of spec.shape) of the model array, as numpy in spec.dtype."""
    lead, slot = index[: spec.names.ndim], index[spec.names.ndim:]
    names = spec.names[lead] if lead else spec.names
    slot_shape = tuple(len(range(*s.indices(n))) for s, n in zip(slot, spec.slot_shape))
    block = np.empty(np.shape(names) + slot_shape, spec.dtype)
    for pos in np.ndindex(np.shape(names)):
        tensor = read(names[pos])
        tensor = tensor.T if spec.transpose else tensor
        block[pos] = np.asarray(tensor[slot]).astype(spec.dtype)
    return block

