"""Mesh, logical-axis rules and LayerSplit on 8 simulated CPU devices (in a subprocess, since the
device count must be fixed before jax starts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec

from conftest import simulated_devices_env
from glm_jax.sharding import LOGICAL_AXIS_RULES, ShardingError, logical_spec, parse_mesh_spec

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def checks() -> dict:
    env = simulated_devices_env(8)
    proc = subprocess.run([sys.executable, str(HERE / "multidevice_checks.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mesh_spec_parsing():
    assert parse_mesh_spec("data=2,tensor=2,layer=2") == {"data": 2, "context": 1, "tensor": 2, "layer": 2}
    assert parse_mesh_spec("layer=8") == {"data": 1, "context": 1, "tensor": 1, "layer": 8}
    assert parse_mesh_spec("expert=4") == {"data": 1, "context": 1, "tensor": 4, "layer": 1}
    for bad in ("data=2,data=2", "pipeline=2", "layer", "layer=0"):
        with pytest.raises(ShardingError):
            parse_mesh_spec(bad)


def test_one_rules_table_maps_logical_names():
    assert logical_spec(("batch", None, "heads")) == PartitionSpec("data", None, "tensor")
    assert LOGICAL_AXIS_RULES["cache_layers"] == "layer"
    assert logical_spec(("stack", "q_lora", "heads")) == PartitionSpec(None, None, "tensor")
    assert logical_spec(("stack", "experts", "embed", "expert_mlp")) == PartitionSpec(None, ("tensor", "layer"), None, None)
    with pytest.raises(ShardingError, match="no rule"):
        logical_spec(("sequence",))


def test_layer_split_decode_equals_unsplit(checks):
    assert checks["devices"] == 8
    for spec, r in checks["split_equals_unsplit"].items():
        assert r["same_argmax"], spec
        assert r["max_abs_diff"] < 1e-4, (spec, r)


def test_layer_split_generator_and_paged_engine_same_greedy_tokens(checks):
    tokens = checks["generator_tokens"]
    assert tokens["None"] == tokens["data=1,layer=8"] == tokens["engine data=2,layer=4"]
    assert all(len(t) == 8 for t in tokens["None"])


def test_paged_engine_on_a_mesh_compiles_each_program_once(checks):
    """Its cache and slot state come back from every call with the shardings they went in with
    (spelling included: jit keys its dispatch on it), so no program compiles a second time."""
    report = checks["engine_on_mesh"]
    compiles = report["compiles"]
    assert [compiles.get(f"jit({name})") for name in ("prefill_chunk", "decode")] == [1, 1], compiles
    assert report["specs_after"] == report["specs_before"]
    assert ["layer", "data", None, None] in report["specs_before"]


def test_per_device_cache_bytes_shrink_as_one_over_n(checks):
    b = {int(n): r for n, r in checks["cache_bytes"].items()}
    for n in (2, 4):
        assert b[n]["max"] * n == b[1]["max"]
    # 8 layers, 4 Full layers: at n=8 each device keeps 1 latent slot and 1 (half-used) key slot
    assert b[8]["max"] == b[8]["latent_slot"] + b[8]["key_slot"]
    assert b[8]["devices"] == 8


def test_indivisible_dimension_names_dimension_and_fix(checks):
    msg = checks["indivisible_error"]
    assert "'vocab'" in msg and "97" in msg and "'tensor'" in msg and "divides" in msg


def test_layer_split_transfers_are_async_and_overlap_compute(checks):
    """Compiled for a TPU slice: the owner broadcasts are collective-permute-start/done pairs
    and some have compute scheduled while they are in flight."""
    if checks["hlo_overlap"] is None:
        pytest.skip("libtpu is not installed")
    permutes = checks["hlo_overlap"]["collective-permute"]
    assert permutes["pairs"] > 0 and permutes["overlapped"] > 0
