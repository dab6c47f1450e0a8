"""Document sources: random-access collections of texts (one training document per index).

    docs = open_documents(["notes.txt", "web.jsonl", "shard-00000.array_record"])
    len(docs); docs[i] -> str

Formats, by file name:
  *.jsonl / *.json   one document per line, a JSON object {"text": "..."} (blank lines skipped)
  *.array_record     one document per record: the UTF-8 text, or a JSON object {"text": ...}
  anything else      plain text, the whole file one document
A directory stands for every file under it (sorted, hidden files skipped).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from glm_jax.extras import require


class DataError(ValueError):
    """Training data that cannot be used: missing file, no text, malformed record."""


class TextFiles:
    """Each file one document."""

    def __init__(self, files: Sequence[Path]):
        self.files = [Path(f) for f in files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> str:
        return self.files[i].read_text(encoding="utf-8", errors="replace")


def _text_of(obj, where: str) -> str:
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise DataError(f"{where}: expected a JSON object with a string \"text\" field")
    return obj["text"]


class JsonLines:
    """One document per non-blank line of a JSON-lines file; lines are found once, read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offsets: list[tuple[int, int]] = []  # (byte offset, line number)
        offset = 0
        with self.path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    self.offsets.append((offset, number))
                offset += len(line)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> str:
        offset, number = self.offsets[i]
        with self.path.open("rb") as f:
            f.seek(offset)
            line = f.readline()
        where = f"{self.path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg})") from None
        return _text_of(obj, where)


class ArrayRecords:
    """Records of array_record files (UTF-8 text, or JSON objects with a "text" field)."""

    def __init__(self, path: Path):
        grain = require("grain")

        self.path = Path(path)
        self.source = grain.sources.ArrayRecordDataSource([str(self.path)])

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> str:
        text = bytes(self.source[i]).decode("utf-8", errors="replace")
        if text.lstrip().startswith("{"):
            try:
                return _text_of(json.loads(text), f"{self.path} record {i}")
            except json.JSONDecodeError:
                pass
        return text


class Concat:
    """Several sources as one: indices run through them in order."""

    def __init__(self, parts: Sequence):
        self.parts = [p for p in parts if len(p)]
        self.ends, total = [], 0
        for p in self.parts:
            total += len(p)
            self.ends.append(total)

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = next(k for k, end in enumerate(self.ends) if i < end)
        return self.parts[k][i - (self.ends[k - 1] if k else 0)]


class Subset:
    """The documents of `source` at `indices`, in that order."""

    def __init__(self, source, indices: Sequence[int]):
        self.source, self.indices = source, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> str:
        return self.source[self.indices[i]]


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise DataError(f"data directory {p} has no files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"data file {p} does not exist")
    return files


def _open_file(path: Path):
    name = path.name.lower()
    if name.endswith((".jsonl", ".json")):
        return JsonLines(path)
    if name.endswith(".array_record") or ".array_record-" in name:
        return ArrayRecords(path)
    return TextFiles([path])


def open_documents(paths: Sequence[str | Path]):
    """Files and directories -> one random-access source of documents (see the module docstring).

    Raises DataError for a path that does not exist or data without any text."""
    if not paths:
        raise DataError("no data files given")
    files = _expand(paths)
    parts = []
    for f in files:
        part = _open_file(f)
        if isinstance(part, TextFiles) and f.stat().st_size == 0:
            continue
        parts.append(part)
    docs = Concat(parts)
    if len(docs) == 0:
        raise DataError(f"no text in {', '.join(str(f) for f in files)}")
    return docs


def split_documents(source, *, heldout_fraction: float = 0.05, seed: int = 0):
    """Deterministic train / held-out split by a stable hash of (seed, index) -> (train, heldout).

    Keeps at least one document on each side when there are two or more."""
    train, heldout = [], []
    for i in range(len(source)):
        h = int.from_bytes(hashlib.sha1(f"{seed}:{i}".encode()).digest()[:8], "big") / 2 ** 64
        (heldout if h < heldout_fraction else train).append(i)
    if not heldout and len(train) > 1:
        heldout.append(train.pop())
    if not train:
        train.append(heldout.pop())
    return Subset(source, train), Subset(source, heldout)
