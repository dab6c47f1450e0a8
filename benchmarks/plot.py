"""The plots in docs/, drawn with matplotlib from the benchmarks' saved output.

    pip install -e ".[plot]"        # matplotlib, an optional extra
    PYTHONPATH=. python3 benchmarks/plot.py indexer docs/data/indexer_topk_h200.json docs/img/indexer_topk_h200.svg
    PYTHONPATH=. python3 benchmarks/plot.py long_context docs/data/long_context_h200.json docs/img/long_context_h200.svg
    PYTHONPATH=. python3 benchmarks/plot.py loss_curve first.jsonl resumed.jsonl docs/img/loss.svg
    PYTHONPATH=. python3 benchmarks/plot.py serving_load serving_load.json serving_load.svg
    PYTHONPATH=. python3 benchmarks/plot.py mtp_ablation docs/data/mtp_ablation_cpu_smoke.json docs/img/mtp_ablation_cpu_smoke.svg

A `.json` input is a benchmark's --json output (its "rows"); `.jsonl` inputs are train.py
metrics files, one series each (named by the file), for the loss curve. The output format
follows the file's suffix (.svg, .png, .pdf).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

Series = dict[str, list[tuple[float, float]]]


@dataclass(frozen=True)
class Chart:
    """What one plot shows: named (x, y) series and its labels; `log` for log-log axes."""

    series: Series
    title: str
    xlabel: str
    ylabel: str
    log: bool = True


def _series(rows: list[dict], x: str, match: dict, y: str, scale: float = 1.0) -> list[tuple[float, float]]:
    """The (row[x], row[y] * scale) points of the rows that have y and whose fields equal `match`,
    sorted by x."""
    return sorted((r[x], r[y] * scale) for r in rows if y in r and all(r.get(k) == v for k, v in match.items()))


def indexer_chart(rows: list[dict]) -> Chart:
    """Decode and selection rows of benchmarks/indexer_topk.py --json -> time vs context."""
    series = {f"{what}, {impl}": _series(rows, "T", {"kind": kind}, key, 1e3)
              for kind, what in (("decode", "decode top-k"), ("select", "selection alone"))
              for key, impl in (("ours_s", "Pallas"), ("baseline_s", "XLA baseline"))}
    return Chart(series, "Indexer top-2048, 64 sequences x 1 query (H200)", "context (keys)", "ms per call")


def long_context_chart(rows: list[dict]) -> Chart:
    """Rows of benchmarks/long_context.py --json -> ms per decode step vs context."""
    series = {f"{what}, {pattern}": _series(rows, "context", {"pattern": pattern}, key)
              for key, what in (("step_ms", "decode step"), ("attention_indexer_ms", "attention + indexer"))
              for pattern in ("all Full", "IndexShare")}
    return Chart(series, "8-layer GLM-5.2-attention model, decode (H200)", "context (tokens)", "ms per step")


def loss_curve_chart(rows: list[dict]) -> Chart:
    """train.py metrics rows, each with the "source" file it came from -> LM loss vs step: the
    logged training batches, and the held-out evaluations where the run made any."""
    sources = list(dict.fromkeys(r["source"] for r in rows))
    series = {}
    for source in sources:
        series[f"train lm loss, {source}"] = _series(rows, "step", {"source": source}, "lm")
        held_out = _series(rows, "step", {"source": source}, "val_lm")
        if held_out:
            series[f"held-out lm loss, {source}"] = held_out
    return Chart(series, "train.py LM loss (nats per token)", "step", "LM loss", log=False)


def serving_load_chart(rows: list[dict]) -> Chart:
    """Rows of benchmarks/serving_load.py --out -> throughput vs max context, per server and pattern:
    the best of a rate sweep (its saturation); rows of a server that failed and the replays at a
    fraction of saturation are left out."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r.get("context"), r.get("server"), r.get("pattern"))
        if "error" not in r and "load" not in r and (key not in best or r["throughput"] > best[key]["throughput"]):
            best[key] = r
    rows = list(best.values())
    servers = list(dict.fromkeys(r["server"] for r in rows))     # as the benchmark ran them, e.g. "continuous,
    series = {f"{server}, {pattern}": _series(rows, "context", {"server": server, "pattern": pattern}, "throughput")
              for server in servers for pattern in ("IndexShare", "all Full")}   # budget N" beside "continuous"
    return Chart(series, "Serving under Poisson load, 8-layer GLM-5.2-attention model", "max context (tokens)",
                 "tokens/s")



def mtp_ablation_chart(rows: list[dict]) -> Chart:
    """Rows of benchmarks/mtp_ablation.py --json -> acceptance length per ablation row (1-4 = a-d):
    ours (mean over prompts, and its quartiles) at each temperature, and the published row."""
    position = {r: i + 1 for i, r in enumerate("abcd")}
    series = {}
    for t in sorted({r["temperature"] for r in rows}):
        for key, what in (("mean", "mean"), ("q25", "25th percentile"), ("q75", "75th percentile")):
            series[f"ours, T={t}, {what}"] = sorted((position[r["row"]], r[key]) for r in rows
                                                    if r["temperature"] == t)
    series["published (GLM-5.2)"] = sorted({(position[r["row"]], r["published"]) for r in rows})
    return Chart(series, "MTP ablation: acceptance length over 7 draft steps",
                 "ablation row (1 = a ... 4 = d)", "acceptance length", log=False)



CHARTS = {"indexer": indexer_chart, "long_context": long_context_chart, "loss_curve": loss_curve_chart,
          "mtp_ablation": mtp_ablation_chart, "serving_load": serving_load_chart}


def _context_label(x: float, _pos=None) -> str:
    for unit, size in (("M", 2 ** 20), ("K", 2 ** 10)):
        if x >= size:
            return f"{x / size:g}{unit}"
    return f"{x:g}"


def draw(chart: Chart, out: str) -> None:
    """Writes `chart` to the file `out` (format from its suffix)."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit('benchmarks/plot.py needs matplotlib: pip install -e ".[plot]"') from e
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    for name, points in chart.series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
    if chart.log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_context_label))
    ax.set(title=chart.title, xlabel=chart.xlabel, ylabel=chart.ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out, metadata={"Date": None} if out.endswith(".svg") else None)
    plt.close(fig)


def read_rows(paths: list[str]) -> list[dict]:
    """A benchmark's --json rows, or the lines of train.py metrics files tagged with their file name."""
    rows = []
    for path in paths:
        with open(path) as f:
            if path.endswith(".jsonl"):
                name = path.rsplit("/", 1)[-1].removesuffix(".jsonl")
                rows += [dict(json.loads(line), source=name) for line in f if line.strip()]
            else:
                rows += json.load(f)["rows"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chart", choices=sorted(CHARTS))
    ap.add_argument("data", nargs="+", help="the --json output of the benchmark, or train.py metrics .jsonl files")
    ap.add_argument("out", help="the file to write (.svg, .png or .pdf)")
    args = ap.parse_args()
    draw(CHARTS[args.chart](read_rows(args.data)), args.out)


if __name__ == "__main__":
    main()
