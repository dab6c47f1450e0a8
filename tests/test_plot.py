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
