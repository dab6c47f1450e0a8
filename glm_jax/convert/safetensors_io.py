"""Reading and writing `.safetensors` files one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}} (offsets relative to the end of the header) and the raw bytes.
Reading memory-maps the file, so a tensor costs host memory only while it is used; writing
lays out the header first (sizes are known in advance) and then streams each tensor's bytes,
so exporting never holds more than one tensor. The `safetensors` package reads these files;
this module exists because its numpy reader cannot return float8 tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ALIGN = 8


class TensorInfo:
    """Where one tensor lives: file, dtype, shape and byte range (no data read)."""

    __slots__ = ("file", "dtype", "shape", "begin", "end")

    def __init__(self, file: Path, dtype: np.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.file, self.dtype, self.shape, self.begin, self.end = file, dtype, shape, begin, end


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one file, from its header only."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    start = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        out[name] = TensorInfo(path, DTYPES[entry["dtype"]], tuple(entry["shape"]), start + begin, start + end)
    return out


def read_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor as a read-only memory map (no copy until it is used)."""
    count = int(np.prod(info.shape, dtype=np.int64))
    if count == 0:
        return np.zeros(info.shape, info.dtype)
    return np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.begin, shape=info.shape)


def write_file(path: Path, entries: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
               produce: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> int:
    """Write one file: `entries` lists (name, dtype, shape) in order; `produce(name)` is called
    once per tensor, right before its bytes are written. -> bytes of tensor data written."""
    entries = list(entries)
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in entries:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in entries:
            array = np.ascontiguousarray(produce(name))
            if array.dtype != np.dtype(dtype) or array.shape != tuple(shape):
                raise ValueError(f"{name}: produced {array.dtype}{list(array.shape)}, "
                                 f"expected {np.dtype(dtype)}{list(shape)}")
            f.write(array.tobytes())
    return offset
