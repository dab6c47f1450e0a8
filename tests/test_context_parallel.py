"""Context parallelism: the sequence split over the `context` mesh axis on 8 simulated CPU
devices (context=8 and data=2,context=4, in a subprocess: the device count is fixed before jax
starts). Every loss term and every gradient equals the one-device ones in both stages and both
attention forms; the compiled program holds each device's queries against all keys; kernels
that saw only their own shard's keys would give another loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from conftest import simulated_devices_env
from glm_jax.sharding import logical_spec, parse_mesh_spec, split_queries, split_tokens

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def checks() -> dict:
    env = simulated_devices_env(8)
    proc = subprocess.run([sys.executable, str(HERE / "context_parallel_checks.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_context_axis_and_its_logical_names():
    assert parse_mesh_spec("data=2,cp=4") == {"data": 2, "context": 4, "tensor": 1, "layer": 1}
    assert parse_mesh_spec("seq=8")["context"] == 8
    assert logical_spec(("batch", "activation_length", None)) == PartitionSpec("data", "context", None)
    assert logical_spec(("batch", "kv_length", None)) == PartitionSpec("data", None, None)


def test_without_a_mesh_nothing_is_split():
    x = jnp.ones((1, 4, 2))
    assert split_tokens(x) is x
    assert split_queries(lambda q, k: (q, k), {"q": 1}, {"k": 2}) == (1, 2)


def test_sharded_loss_terms_and_gradients_equal_one_device(checks):
    assert checks["devices"] == 8
    assert len(checks["cases"]) == 4
    for name, case in checks["cases"].items():
        for term, (got, want) in case["terms"].items():
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (name, term, got, want)
        assert case["grads"] < 1e-4, (name, case["grads"])


def test_each_device_scores_its_queries_against_all_keys(checks):
    """Attention probabilities [B, heads, S, T] = [2, 2, 16, 16]: per device [2, 2, 2, 16] on
    context=8 and [1, 2, 4, 16] on data=2,context=4; never the whole matrix."""
    shapes = {name: case["scores_shape"] for name, case in checks["cases"].items() if "scores_shape" in case}
    assert shapes["context=8 dense expanded"] == {"2,2,2,16": True, "1,2,4,16": False, "2,2,16,16": False}
    assert shapes["data=2,context=4 sparse expanded packed"] == {"2,2,2,16": False, "1,2,4,16": True,
                                                                 "2,2,16,16": False}


def test_kernels_without_the_key_gather_give_another_loss(checks):
    wrong, right = checks["keys_not_gathered"]
    assert abs(wrong - right) > 1e-3


def test_sequence_not_divisible_by_context_is_refused(checks):
    placing, tracing = checks["indivisible"]
    assert "sequence length 12" in placing and "context-parallel size 8" in placing and "--seq-len" in placing
    assert "'activation_length'" in tracing and "'context'" in tracing and "12" in tracing
