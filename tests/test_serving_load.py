"""benchmarks/serving_load.py --smoke end to end (one layer pattern, to stay small): every
request of both servers completes, the continuous server at two rates and the baseline at the
first, the metrics are filled in, and the chart draws; the sweep's rates stop at saturation."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import plot, serving_load
from conftest import ROOT


def test_serving_load_smoke_runs_both_servers_and_patterns(tmp_path, monkeypatch):
    out = tmp_path / "load.json"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["serving_load.py", "--smoke", "--contexts", "128", "--requests", "3",
                                      "--new-tokens", "4", "--patterns", "IndexShare", "--rates", "20", "40",
                                      "--out", str(out)])
    serving_load.main()
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["server"], r["rate"]) for r in rows) == [("continuous", 20), ("continuous", 40),
                                                              ("static waves", 20)]
    for r in rows:
        assert r["tokens"] == 3 * 4 and r["throughput"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert r["host_ms_per_step"] > 0 and 0 <= r["goodput"] <= r["throughput"]
    pytest.importorskip("matplotlib")
    chart = plot.serving_load_chart(rows)
    assert [name for name, points in chart.series.items() if points] == ["continuous, IndexShare",
                                                                           "static waves, IndexShare"]
    plot.draw(chart, str(tmp_path / "load.svg"))


def test_sweep_doubles_the_rate_until_the_throughput_stops_growing():
    rates = serving_load.sweep_rates(2.0, given=None, sweep=True, most=6)
    seen = [next(rates)]
    for measured in (10.0, 19.0, 20.0):                 # +90%, then +5.3%: go on
        seen.append(rates.send(measured))
    assert seen == [2.0, 4.0, 8.0, 16.0]
    with pytest.raises(StopIteration):
        rates.send(20.5)                                # +2.5% < 5%: saturated
    assert list(serving_load.sweep_rates(2.0, given=[1.0, 3.0], sweep=False, most=6)) == [1.0, 3.0]


def test_layouts_share_one_byte_budget_and_fp8_admits_more(tmp_path, monkeypatch, capsys):
    """--kv-cache-dtype auto fp8 at one --kv-cache-memory-bytes (5 float32 pages of the smoke
    model): a row per layout, each pool within the bytes, FP8's with more pages and admitting
    more 128-token sequences; every request completes; the FP8 / auto line is printed."""
    from benchmarks._serving_model import PATTERNS, model_config
    from glm_jax.cache import page_bytes

    out = tmp_path / "load.json"
    budget = 5 * page_bytes(model_config(PATTERNS["IndexShare"], True), 64)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["serving_load.py", "--smoke", "--contexts", "128", "--requests", "3",
                                      "--new-tokens", "4", "--patterns", "IndexShare", "--rates", "40", "--no-waves",
                                      "--ceiling-points", "0", "--kv-cache-dtype", "auto", "fp8",
                                      "--kv-cache-memory-bytes", str(budget), "--out", str(out)])
    serving_load.main()
    rows = {r["kv_cache_dtype"]: r for r in json.loads(out.read_text())["rows"]}
    assert [(r["server"], r["layout"]) for r in rows.values()] == [("continuous, KV auto", "float32"),
                                                                    ("continuous, KV fp8", "fp8")]
    auto, fp8 = rows["auto"], rows["fp8"]
    assert all(r["tokens"] == 3 * 4 and r["pool_bytes"] <= budget and r["decode_tokens_s"] > 0 for r in (auto, fp8))
    assert (auto["pool_pages"], auto["admits"]) == (5, 2) and fp8["pool_pages"] > 3 * auto["pool_pages"]
    assert fp8["admits"] >= 3 * auto["admits"] and 1 <= auto["peak_decoding"] <= 3
    assert "fp8 / auto, 128 IndexShare continuous at 40/s: admits" in capsys.readouterr().out


def test_a_memory_fraction_needs_memory_statistics():
    """On a CPU (no memory statistics) a fraction exits in one line; explicit bytes go first."""
    from benchmarks import _serving_layouts

    with pytest.raises(SystemExit, match="^--cache-memory-fraction: this device reports no memory statistics"):
        _serving_layouts.cache_budget(0.5, None)
    assert _serving_layouts.cache_budget(0.5, 1234) == 1234 and _serving_layouts.cache_budget(None, None) is None
