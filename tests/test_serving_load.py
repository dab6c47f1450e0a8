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
