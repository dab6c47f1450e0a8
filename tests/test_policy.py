"""The speculative-decoding default: chosen from measured speedups, and the table equals its data file."""

from __future__ import annotations

import json

import pytest

from glm_jax.decoding import policy
from conftest import ROOT


def test_cpu_table_is_the_benchmark_output():
    m = policy.MEASURED["cpu"]
    data = json.loads((ROOT / m.source).read_text())
    assert data["backend"] == "cpu"
    measured: dict[int, dict[int, float]] = {}
    for row in data["rows"]:
        if row["draft"] and row["kv_share"]:
            measured.setdefault(row["batch"], {})[row["draft"]] = round(row["speedup"], 2)
    assert m.speedup == measured


def test_choice_follows_the_measured_speedups(monkeypatch):
    table = {1: {2: 1.30, 3: 1.50}, 16: {2: 1.10, 3: 0.90}}
    monkeypatch.setitem(policy.MEASURED, "gpu", policy.Measurement("H200", "table", "cmd", table))
    assert policy.choose("gpu", 1).num_draft == 3                  # measured: the fastest K
    assert policy.choose("gpu", 4).num_draft == 2                  # between: faster at both neighbours
    assert policy.choose("gpu", 16).num_draft == 2
    assert policy.choose("gpu", 17).num_draft == 0                 # above the largest measured batch
    assert policy.choose("tpu", 1) == policy.Choice(0, "plain decoding: speculative decoding was not measured on tpu")
    monkeypatch.setitem(policy.MEASURED, "gpu", policy.Measurement("H200", "table", "cmd", {1: {3: 1.02}}))
    slow = policy.choose("gpu", 1)
    assert slow.num_draft == 0 and "1.02x plain decoding with K=3 at batch 1" in slow.reason


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_the_reason_names_the_source(batch):
    choice = policy.choose("gpu", batch)
    assert "docs/speculative.md" in choice.reason and "\n" not in choice.reason
