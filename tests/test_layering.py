"""The library's core imports no front end: walking the imports of its modules (every import
statement, those inside functions too, followed through glm_jax) never reaches
glm_jax.frontends. The core is every module of glm_jax outside glm_jax/frontends/."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "glm_jax"
FRONT_ENDS = "glm_jax.frontends"


def _file_of(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(module: str) -> set[str]:
    """The glm_jax modules `module`'s file imports (with the packages above them); the package
    writes no relative imports (the walk asserts it)."""
    found = set()
    for node in ast.walk(ast.parse(_file_of(module).read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{module}: a relative import, which this walk does not follow"
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("glm_jax") and _file_of(name):
                parts = name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found


def _reached_from(start: str) -> dict[str, str]:
    """Every glm_jax module imported from `start`, directly or through others -> the module that imports it."""
    seen, todo = {start: ""}, [start]
    while todo:
        module = todo.pop()
        for name in _imports(module):
            if name not in seen:
                seen[name] = module
                todo.append(name)
    return seen


def _modules() -> list[str]:
    """Every module of glm_jax (packages by their __init__), dotted."""
    return [".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for f in sorted(PACKAGE.rglob("*.py"))]


def _core_modules() -> list[str]:
    return [m for m in _modules() if not (m == FRONT_ENDS or m.startswith(FRONT_ENDS + "."))]


def test_the_core_reaches_no_front_end():
    offending = []
    for module in _core_modules():
        reached = _reached_from(module)
        for name in reached:
            if name == FRONT_ENDS or name.startswith(FRONT_ENDS + "."):
                chain = [name]
                while reached[chain[-1]]:
                    chain.append(reached[chain[-1]])
                offending.append(" <- ".join(chain))
    assert not offending, "\n".join(offending)


def test_the_walk_sees_imports_inside_functions():
    """The walk follows an import written inside a function (as the front ends' lazy imports are)
    and covers the core's modules."""
    assert "glm_jax.frontends.cli" in _reached_from("glm_jax.frontends.serve")
    assert "glm_jax.checkpoint_damage" in _reached_from("glm_jax.frontends.cli")   # exit_with's import
    core = _core_modules()
    assert {"glm_jax", "glm_jax.aot", "glm_jax.serving.app", "glm_jax.hlo_overlap", "glm_jax.training.loop"} <= set(core)
    assert not set(core) & {"glm_jax.frontends", "glm_jax.frontends.cli"}
    assert len(core) + len([m for m in _modules() if m.startswith(FRONT_ENDS)]) == len(_modules())


def _kernel_imports(path: Path) -> list[str]:
    """The imports of pallas_kernels in one file (every import statement, inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "pallas_kernels"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pallas_kernels":
            found.append(node.module)
    return found


def test_ops_is_the_one_module_that_imports_the_kernels():
    """glm_jax reaches pallas_kernels only through glm_jax.ops: no other module of the package
    imports it (what the others need, ops re-exports)."""
    offending = [f"{path.relative_to(ROOT)}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
                 if path != PACKAGE / "ops.py" for name in _kernel_imports(path)]
    assert not offending, "\n".join(offending)
    assert _kernel_imports(PACKAGE / "ops.py")         # the walk sees the imports it forbids


def test_the_kernel_import_walk_sees_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import pallas_kernels as pk\nfrom pallas_kernels.fp8 import Fp8Keys\n"
                      "def f():\n    from pallas_kernels import impl_choices\n"
                      "import pallas_kernels_like\nfrom glm_jax import ops\n")
    assert _kernel_imports(source) == ["pallas_kernels", "pallas_kernels.fp8", "pallas_kernels"]
