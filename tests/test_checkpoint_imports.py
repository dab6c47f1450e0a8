"""The checkpoint modules import nothing of the training package, at any depth of their code
(imports inside functions included): training builds on them, never the other way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement anywhere in the file names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", ["checkpoint.py", "checkpoint_damage.py", "thread_streams.py"])
def test_checkpoint_modules_do_not_import_training(module):
    names = imported_modules(ROOT / "glm_jax" / module)
    assert not [n for n in names if n == "glm_jax.training" or n.startswith("glm_jax.training.")], names
