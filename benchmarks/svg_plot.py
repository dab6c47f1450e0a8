"""A dependency-free line chart in SVG (log-log or linear axes), for the plots in docs/.

    PYTHONPATH=. python3 benchmarks/svg_plot.py indexer docs/data/indexer_topk_h200.json docs/img/indexer_topk_h200.svg
    PYTHONPATH=. python3 benchmarks/svg_plot.py long_context docs/data/long_context_h200.json docs/img/long_context_h200.svg
    PYTHONPATH=. python3 benchmarks/svg_plot.py loss_curve first.jsonl resumed.jsonl docs/img/loss.svg

A `.json` input is a benchmark's --json output (its "rows"); `.jsonl` inputs are train.py
metrics files, one series each (named by the file), for the loss curve.
"""

from __future__ import annotations

import argparse
import json
import math

WIDTH, HEIGHT, MARGIN = 640, 400, 64
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def line_chart(series: dict[str, list[tuple[float, float]]], *, title: str, xlabel: str,
               ylabel: str, log: bool = True) -> str:
    """series: name -> [(x, y)] -> an SVG document (log-log axes, x and y > 0; or linear axes)."""
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    scale = math.log10 if log else (lambda v: v)
    lx0, lx1 = scale(min(xs)), scale(max(xs))
    if log:
        ly0, ly1 = math.floor(scale(min(ys))), math.ceil(scale(max(ys)))
        y_ticks = [10.0 ** e for e in range(ly0, ly1 + 1)]
        x_ticks = sorted(set(xs))
    else:
        ly0, ly1 = math.floor(min(ys)), math.ceil(max(ys))
        y_ticks = [float(v) for v in range(ly0, ly1 + 1)]
        x_ticks = sorted({round(lx0 + i * (lx1 - lx0) / 5) for i in range(6)})
    px = lambda x: MARGIN + (scale(x) - lx0) / max(lx1 - lx0, 1e-9) * (WIDTH - 2 * MARGIN)
    py = lambda y: HEIGHT - MARGIN - (scale(y) - ly0) / max(ly1 - ly0, 1e-9) * (HEIGHT - 2 * MARGIN)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="14">{title}</text>',
           f'<text x="{WIDTH / 2}" y="{HEIGHT - 16}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 16 {HEIGHT / 2})">'
           f'{ylabel}</text>']
    for tick in y_ticks:
        y = py(tick)
        out.append(f'<line x1="{MARGIN}" y1="{y:.1f}" x2="{WIDTH - MARGIN}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{MARGIN - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for x in x_ticks:
        out.append(f'<text x="{px(x):.1f}" y="{HEIGHT - MARGIN + 18}" text-anchor="middle">{_short(x)}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(pts))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in pts]
        out.append(f'<text x="{MARGIN + 10}" y="{MARGIN + 16 * i}" fill="{color}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _short(x: float) -> str:
    for unit, size in (("M", 2 ** 20), ("K", 2 ** 10)):
        if x >= size:
            return f"{x / size:g}{unit}"
    return f"{x:g}"


def _series(rows: list[dict], x: str, match: dict, y: str, scale: float = 1.0) -> list[tuple[float, float]]:
    """The (row[x], row[y] * scale) points of the rows whose fields equal `match`."""
    return [(r[x], r[y] * scale) for r in rows if all(r[k] == v for k, v in match.items())]


def indexer_chart(rows: list[dict]) -> str:
    """Decode and selection rows of benchmarks/indexer_topk.py --json -> time vs context."""
    series = {f"{what}, {impl}": _series(rows, "T", {"kind": kind}, key, 1e3)
              for kind, what in (("decode", "decode top-k"), ("select", "selection alone"))
              for key, impl in (("ours_s", "Pallas"), ("baseline_s", "XLA baseline"))}
    return line_chart(series, title="Indexer top-2048, 64 sequences x 1 query (H200)",
                      xlabel="context (keys)", ylabel="ms per call")


def long_context_chart(rows: list[dict]) -> str:
    """Rows of benchmarks/long_context.py --json -> ms per decode step vs context."""
    series = {f"{what}, {pattern}": _series(rows, "context", {"pattern": pattern}, key)
              for key, what in (("step_ms", "decode step"), ("attention_indexer_ms", "attention + indexer"))
              for pattern in ("all Full", "IndexShare")}
    return line_chart(series, title="8-layer GLM-5.2-attention model, decode (H200)",
                      xlabel="context (tokens)", ylabel="ms per step")


def loss_curve_chart(rows: list[dict]) -> str:
    """train.py metrics rows, each with the "source" file it came from -> LM loss vs step."""
    sources = list(dict.fromkeys(r["source"] for r in rows))
    series = {f"lm loss, {source}": _series(rows, "step", {"source": source}, "lm") for source in sources}
    return line_chart(series, title="small-128k, 131072-token sequences (H200)", xlabel="step",
                      ylabel="LM loss", log=False)


CHARTS = {"indexer": indexer_chart, "long_context": long_context_chart, "loss_curve": loss_curve_chart}


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
    ap.add_argument("out", help="the .svg to write")
    args = ap.parse_args()
    with open(args.out, "w") as f:
        f.write(CHARTS[args.chart](read_rows(args.data)))


if __name__ == "__main__":
    main()
