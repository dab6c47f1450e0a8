"""benchmarks/plot.py draws each docs/ chart from the data saved beside it."""

import pytest

pytest.importorskip("matplotlib")

from benchmarks import plot  # noqa: E402
from conftest import ROOT  # noqa: E402

DATA = ROOT / "docs" / "data"


@pytest.mark.parametrize("chart, files, series", [
    ("indexer", ["indexer_topk_h200.json"], 4),
    ("long_context", ["long_context_h200.json"], 4),
    ("loss_curve", ["train_128k_h200_first.jsonl", "train_128k_h200_resumed.jsonl"], 4),   # train and held-out each
    ("mtp_ablation", ["mtp_ablation_cpu_smoke.json"], 7),
])
def test_chart_draws_every_series(tmp_path, chart, files, series):
    drawn = plot.CHARTS[chart](plot.read_rows([str(DATA / f) for f in files]))
    assert len(drawn.series) == series and all(drawn.series.values())
    out = tmp_path / "chart.svg"
    plot.draw(drawn, str(out))
    text = out.read_text()
    assert text.startswith("<?xml") and all(name in text for name in drawn.series)


def test_serving_chart_has_a_series_per_server_the_benchmark_ran():
    rows = [dict(server=server, pattern="IndexShare", context=context, throughput=float(context) / 1000)
            for server in ("continuous", "continuous, budget 520", "static waves") for context in (32768, 131072)]
    drawn = plot.serving_load_chart(rows + [dict(server="continuous", pattern="all Full", error="out of memory")])
    filled = [name for name, points in drawn.series.items() if points]
    assert filled == ["continuous, IndexShare", "continuous, budget 520, IndexShare", "static waves, IndexShare"]
