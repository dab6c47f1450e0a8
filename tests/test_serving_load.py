"""benchmarks/serving_load.py --smoke end to end: every request of both servers and both layer
patterns completes, the metrics are filled in, and the chart draws."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import plot, serving_load
from conftest import ROOT


@pytest.mark.slow
def test_serving_load_smoke_runs_both_servers_and_patterns(tmp_path, monkeypatch):
    out = tmp_path / "load.json"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["serving_load.py", "--smoke", "--contexts", "128", "--requests", "3",
                                      "--new-tokens", "4", "--out", str(out)])
    serving_load.main()
    rows = json.loads(out.read_text())["rows"]
    assert {(r["server"], r["pattern"]) for r in rows} == {(s, p) for s in ("continuous", "static waves")
                                                           for p in ("IndexShare", "all Full")}
    for r in rows:
        assert r["tokens"] == 3 * 4 and r["throughput"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
        assert r["host_ms_per_step"] > 0
    pytest.importorskip("matplotlib")
    chart = plot.serving_load_chart(rows)
    assert len(chart.series) == 4 and all(chart.series.values())
    plot.draw(chart, str(tmp_path / "load.svg"))
