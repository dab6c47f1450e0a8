"""Benchmark scripts import the library's public names and the shared helpers benchmarks/_*.py,
never another script nor a private name (walked over every import statement, those inside
functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "benchmarks").glob("*.py"))


def imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_benchmark_imports_helpers_and_public_names_only(path):
    bad = []
    for module, name in imports(path):
        parts = module.split(".")
        if parts[0] == "benchmarks":
            target = parts[1] if len(parts) > 1 else name
            if not private(target):
                bad.append(f"{module} {name}: another script")
        elif parts[0] in ("glm_jax", "pallas_kernels") and (any(map(private, parts)) or (name and private(name))):
            bad.append(f"{module} {name}: a private name")
    assert not bad, bad
