"""benchmarks/serving_load.py --smoke end to end (one layer pattern, to stay small): every
request of both servers completes, the metrics are filled in, and the chart draws."""

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
                                      "--new-tokens", "4", "--patterns", "IndexShare", "--out", str(out)])
    serving_load.main()
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["server"], r["pattern"]) for r in rows) == [("continuous", "IndexShare"),
                                                                 ("static waves", "IndexShare")]
    for r in rows:
        assert r["tokens"] == 3 * 4 and r["throughput"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert r["host_ms_per_step"] > 0
    pytest.importorskip("matplotlib")
    chart = plot.serving_load_chart(rows)
    assert [name for name, points in chart.series.items() if points] == ["continuous, IndexShare",
                                                                           "static waves, IndexShare"]
    plot.draw(chart, str(tmp_path / "load.svg"))
