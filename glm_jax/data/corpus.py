"""A corpus every machine has: the Python standard library's own source files, found at run time."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip",
              "__pycache__", "turtledemo"}
MAX_FILE_BYTES = 200_000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """The stdlib's .py files (no tests, no site-packages, UTF-8, <= 200 KB), sorted by relative path."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(path)
    if not files:
        raise FileNotFoundError(f"no Python source files found under {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path], *, heldout_fraction: float = 0.05, seed: int = 0,
                root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Deterministic train / held-out split by a stable hash of each file's relative path."""
    root = root or stdlib_root()
    train, heldout = [], []
    for path in files:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
        h = int.from_bytes(hashlib.sha1(f"{seed}:{rel}".encode()).digest()[:8], "big") / 2 ** 64
        (heldout if h < heldout_fraction else train).append(path)
    return train, heldout


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in files]
