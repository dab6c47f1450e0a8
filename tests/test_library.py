"""glm-jax as a library: a lean core with extras (pyproject.toml), imports that need no optional
package, the shipped presets, the layers' checks and public names, and the example of
docs/using-the-layers.md run as printed.

One subprocess (`core_run`) blocks the optional packages with an import hook, checks what
imports without them, and runs the docs page's example on 4 simulated CPU devices."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

import glm_jax
from conftest import simulated_devices_env
from glm_jax.config import PRESETS_DIR, ConfigError, load_config, preset_names
from glm_jax.extras import EXTRA_OF
from glm_jax.layers import ForwardOptions, IndexShareGroup, LayerKind
from glm_jax.model import GLMModel
from glm_jax.ops import KernelChoice

ROOT = Path(__file__).resolve().parents[1]
CORE = {"jax", "flax", "optax", "chex", "einops", "pyyaml", "numpy"}
#: Optional top-level modules -> the distribution that installs them.
DISTRIBUTION = {"orbax": "orbax-checkpoint"}
#: The modules that need an optional package, and the extra their ImportError must name.
NEEDS_EXTRA = {"glm_jax.checkpoint": "checkpoints", "glm_jax.training.checkpointing": "checkpoints",
               "glm_jax.data.tokenizer": "tokenizers", "glm_jax.data.pipeline": "tokenizers",
               "glm_jax.serving.app": "serve", "glm_jax.serving.server": "serve", "glm_jax.training.run": "train"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(extras: dict, name: str) -> set[str]:
    """The distributions extra `name` installs, following its `glm-jax[...]` references."""
    names = set()
    for requirement in extras[name]:
        dist, _, inner = re.match(r"([A-Za-z0-9_.\-]+)(\[([^\]]*)\])?", requirement).groups()
        if dist == "glm-jax":
            names |= {n for extra in inner.split(",") for n in _requirements(extras, extra.strip())}
        else:
            names.add(dist.lower())
    return names


def test_the_core_is_lean_and_each_optional_package_has_its_extra():
    project = _project()["project"]
    assert {re.match(r"[\w\-.]+", r).group(0).lower() for r in project["dependencies"]} == CORE
    extras = project["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert DISTRIBUTION.get(module, module) in _requirements(extras, extra), (module, extra)
    user_facing = set(extras) - {"all", "dev", "tpu", "gpu"}
    assert set().union(*(_requirements(extras, e) for e in user_facing)) <= _requirements(extras, "all")
    assert _requirements(extras, "all") | {"pytest"} <= _requirements(extras, "dev")


def test_the_wheel_holds_the_library_and_not_the_lab():
    """The packages setuptools finds are glm_jax and pallas_kernels: lab/ (kernels no `impl`
    selects) and the scripts' folders stay out of the wheel."""
    include = _project()["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert {"lab", "glm_jax", "pallas_kernels"} <= tops
    assert {t for t in tops if any(fnmatch.fnmatch(t, pattern) for pattern in include)} == {"glm_jax", "pallas_kernels"}


def _imported_tops(path: Path) -> set[str]:
    """The top-level names of every module the file imports (statements inside functions too)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            tops.add(node.module.split(".")[0])
    return tops


def test_the_library_never_imports_the_lab():
    """lab/ is not in the wheel, so no module of glm_jax or pallas_kernels may import it (lab
    imports pallas_kernels, not the reverse)."""
    files = [f for package in ("glm_jax", "pallas_kernels") for f in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 50
    assert [str(f.relative_to(ROOT)) for f in files if "lab" in _imported_tops(f)] == []
    assert "pallas_kernels" in _imported_tops(ROOT / "lab" / "dense_indexer_kl_gpu_vjp.py")   # the walk sees imports


def test_presets_ship_as_package_data_and_load_by_name():
    assert _project()["tool"]["setuptools"]["package-data"]["glm_jax"] == ["configs/*.yaml"]
    assert PRESETS_DIR == ROOT / "glm_jax" / "configs" and PRESETS_DIR.resolve() == ROOT / "configs"
    assert {"tiny", "tiny-attention", "glm-5.2"} <= set(preset_names())
    assert load_config("tiny") == load_config("configs/tiny.yaml") == load_config(ROOT / "configs" / "tiny.yaml")
    cfg = load_config("tiny-attention")
    assert (cfg.num_hidden_layers, cfg.pattern, any(cfg.layer_is_moe), cfg.num_nextn_predict_layers) == (2, "FS", False, 0)
    with pytest.raises(ConfigError, match=r"no preset named 'tiny2'; the presets are .*tiny-attention"):
        load_config("tiny2")


def test_options_and_layer_constructors_check_their_arguments():
    with pytest.raises(ValueError, match=r"ForwardOptions.mode must be one of \('sparse', 'dense'\), got 'sprase'"):
        ForwardOptions(mode="sprase")
    with pytest.raises(ValueError, match=r"ForwardOptions.form must be one of \('absorbed', 'expanded'\), got 'flash'"):
        ForwardOptions(form="flash")
    with pytest.raises(ValueError, match=r"max_segments must be a positive int or None, got 0"):
        ForwardOptions(max_segments=0)
    with pytest.raises(ValueError, match=r"KernelChoice sparse_mla='flash': valid choices are 'auto', 'reference'"):
        KernelChoice(sparse_mla="flash")
    with pytest.raises(ValueError, match=r"KernelChoice: unknown op 'attention'; the ops are sparse_mla, indexer_topk"):
        KernelChoice(attention="xla")
    cfg = load_config("tiny-attention")
    full, shared = LayerKind(is_full=True, is_moe=False), LayerKind(is_full=False, is_moe=False)
    with pytest.raises(ValueError, match=r"IndexShareGroup: a group is one Full layer followed by Shared ones"):
        IndexShareGroup(cfg, (shared, full), rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"IndexShareGroup: cfg must be a GLMConfig .*got dict"):
        IndexShareGroup(cfg.to_dict(), (full,), rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    group = IndexShareGroup(cfg, (full, shared), rngs=nnx.Rngs(0), param_dtype=jnp.float32)
    s = cfg.max_position_embeddings + 1
    with pytest.raises(ValueError, match=rf"a sequence of {s} tokens is longer than max_position_embeddings="):
        group.forward(jnp.zeros((1, s, cfg.hidden_size)), jnp.zeros((1, s), jnp.int32), jnp.full((1,), s, jnp.int32),
                      ForwardOptions())


def test_modules_are_small_and_the_scripts_are_shims():
    """No module of the library (glm_jax, pallas_kernels) over 500 lines; train.py and decode.py under 40 each: their
    command lines live in glm_jax.frontends."""
    lines = lambda path: len(path.read_text().splitlines())
    modules = [p for package in ("glm_jax", "pallas_kernels") for p in sorted((ROOT / package).rglob("*.py"))]
    over = {str(p.relative_to(ROOT)): lines(p) for p in modules if lines(p) > 500}
    assert not over, over
    assert {name: lines(ROOT / name) for name in ("train.py", "decode.py") if lines(ROOT / name) >= 40} == {}


def test_public_names():
    from glm_jax import layers

    assert glm_jax.GLMModel is GLMModel
    assert glm_jax.load_config is load_config and glm_jax.ForwardOptions is ForwardOptions
    assert all(getattr(layers, name) for name in layers.__all__) and set(glm_jax.__all__) <= set(dir(glm_jax))
    with pytest.raises(AttributeError, match="has no attribute 'Model'"):
        glm_jax.Model


_CORE_SCRIPT = r"""
import importlib, importlib.abc, json, sys

OPTIONAL = {optional!r}
blocked = set(OPTIONAL)


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)


sys.meta_path.insert(0, Block())
found = {{}}
import glm_jax
found["glm_jax loads jax"] = "jax" in sys.modules
blocked |= {{"flax", "optax", "chex", "einops", "yaml"}}         # pallas_kernels: jax alone
import pallas_kernels
blocked -= {{"flax", "optax", "chex", "einops", "yaml"}}
from glm_jax import GLMModel, load_config
import glm_jax.layers, glm_jax.ops, glm_jax.training.step
for module in {needs_extra!r}:
    try:
        importlib.import_module(module)
        found[module] = "imported"
    except ImportError as e:
        found[module] = str(e)
exec(compile(open(sys.argv[1]).read(), "docs/using-the-layers.md", "exec"), {{"__name__": "__main__"}})
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def core_run(tmp_path_factory):
    """(stdout lines, the JSON it printed last) of the core-only subprocess."""
    page = (ROOT / "docs" / "using-the-layers.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 2, "the page holds a complete example and a finer-grained one after it"
    example = tmp_path_factory.mktemp("docs") / "example.py"
    example.write_text("\n".join(blocks))
    optional = sorted(set(EXTRA_OF) | {"safetensors", "matplotlib", "httpx", "openai"})
    script = _CORE_SCRIPT.format(optional=optional, needs_extra=sorted(NEEDS_EXTRA))
    env = simulated_devices_env(4, PYTHONPATH=str(ROOT))     # (with the test processes' XLA flags)
    run = subprocess.run([sys.executable, "-c", script, str(example)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_pallas_kernels_and_the_core_import_without_optional_packages(core_run):
    _, found = core_run
    assert found.pop("glm_jax loads jax") is False
    for module, extra in NEEDS_EXTRA.items():
        assert re.search(rf"comes with glm-jax's '{extra}' extra: pip install 'glm-jax\[{extra}\]'", found[module]), \
            (module, found[module])


def test_the_docs_example_trains_on_a_mesh_with_the_core_alone(core_run):
    lines, _ = core_run
    first, last = map(float, re.fullmatch(r"loss (\S+) -> (\S+)", lines[-2]).groups())
    assert last < first / 2
    assert "P('q_lora', 'heads')" in "\n".join(lines)
