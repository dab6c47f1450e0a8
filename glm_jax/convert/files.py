"""A Hugging Face checkpoint directory: config.json, model.safetensors.index.json and shards.

    ckpt = CheckpointFiles("GLM-5.2-FP8/")
    ckpt.names                  # every tensor name, from the headers (no data read)
    ckpt.shape(name)            # as stored
    ckpt.read(name)             # float32 for fp8 block-quantised weights, else the stored dtype

Without an index file every `*.safetensors` file of the directory is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from glm_jax.convert import fp8
from glm_jax.convert.safetensors_io import DTYPES, TensorInfo, read_header, read_tensor

INDEX_FILE = "model.safetensors.index.json"


class CheckpointFiles:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / "config.json").exists():
            raise FileNotFoundError(f"{self.directory} holds no config.json: not a Hugging Face checkpoint directory")
        self.raw_config = json.loads((self.directory / "config.json").read_text())
        quant = self.raw_config.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size", fp8.DEFAULT_BLOCK))
        self.problems: list[str] = []   # inconsistencies between the index and the files
        self.tensors: dict[str, TensorInfo] = {}
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            weight_map = {}
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.directory} holds neither {INDEX_FILE} nor *.safetensors files")
        for file in files:
            if not (self.directory / file).exists():
                self.problems.append(f"missing file: {file} (named by {INDEX_FILE})")
                continue
            for name, info in read_header(self.directory / file).items():
                if weight_map and weight_map.get(name) != file:
                    self.problems.append(f"index: {name} is in {file} but {INDEX_FILE} says "
                                         f"{weight_map.get(name, 'nothing')}")
                self.tensors[name] = info
        self.problems += [f"index: {name} listed in {INDEX_FILE} but absent from {file}"
                          for name, file in weight_map.items()
                          if name not in self.tensors and (self.directory / file).exists()]

    @property
    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def is_quantized(self, name: str) -> bool:
        return self.tensors[name].dtype == DTYPES["F8_E4M3"]

    def quantization_problem(self, name: str) -> str | None:
        """Why the fp8 weight `name` cannot be dequantised, or None."""
        scale = name + fp8.SCALE_SUFFIX
        if len(self.shape(name)) != 2:
            return f"{name}: fp8 tensor of rank {len(self.shape(name))}; only 2-D block-quantised weights load"
        if scale not in self.tensors:
            return f"missing: {scale} (the block scales of the fp8 weight {name})"
        want = fp8.scale_shape(self.shape(name), self.block)
        if self.shape(scale) != want:
            return f"shape: {scale} is {list(self.shape(scale))}, blocks of {list(self.block)} need {list(want)}"
        return None

    def read(self, name: str) -> np.ndarray:
        """The tensor's values: dequantised float32 for fp8 weights, else a memory map of the stored array."""
        info = self.tensors[name]
        values = read_tensor(info)
        if self.is_quantized(name):
            return fp8.dequantize(values, read_tensor(self.tensors[name + fp8.SCALE_SUFFIX]), self.block)
        return values
