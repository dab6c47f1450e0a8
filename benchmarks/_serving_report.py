"""The load benchmark's report (benchmarks/serving_load.py): a run's table row, a failed
server's row, and the saturation line after a rate sweep."""

from __future__ import annotations

from benchmarks._report import failure


def _num(x: float) -> str:
    return "n/a" if x != x else f"{x:.1f}"


def failed_row(context: int, pattern: str, server: str, rate: float, error: Exception, **extra) -> dict:
    """The row of a server that failed (`_report.failure`: the exception's type and last line;
    its traceback on stderr), with `extra` fields, printed as a table row."""
    row = dict(context=context, pattern=pattern, server=server, rate=rate, **extra, error=failure(error))
    print(f"| {context} | {pattern} | {server} | {rate:g} | failed: {row['error']} | | | | | |", flush=True)
    return row


def print_row(row: dict) -> None:
    """A measured row as a line of the markdown table."""
    print(f"| {row['context']} | {row['pattern']} | {row['server']} | {row['rate']:g} | {row['throughput']:.1f} | "
          f"{row['goodput']:.1f} | {_num(row.get('device_ceiling_tokens_s', float('nan')))} | "
          f"{_num(row['ceiling_tokens_s'])} | {_num(row['ttft_p50_ms'])} / "
          f"{_num(row['ttft_p99_ms'])} | {_num(row['itl_p50_ms'])} / {_num(row['itl_p99_ms'])} | "
          f"{row['host_ms_per_step']:.3f} / {row['host_cpu_ms_per_step']:.3f} |", flush=True)


def print_saturation(rows: list[dict], context: int, pattern: str, server: str) -> None:
    """The best throughput of a continuous server's rates, against the ceiling of that run."""
    best = saturation_row(rows, context, pattern, server)
    if best is None:
        return
    runs = [r for r in rows if (r["context"], r["pattern"], r["server"]) == (context, pattern, server)
            and "error" not in r and "load" not in r]
    shares = []
    for label, key in (("device ceiling", "device_ceiling_tokens_s"), ("decode ceiling", "ceiling_tokens_s")):
        ceiling = best.get(key, float("nan"))
        shares.append(f"{best['throughput'] / ceiling:.0%} of the {label} {ceiling:.1f}" if ceiling == ceiling
                      else f"{label} n/a")
    print(f"saturation, {context} {pattern} {server}: {best['throughput']:.1f} tokens/s at {best['rate']:g}/s, "
          f"{'; '.join(shares)}; {len(runs)} rate(s) run", flush=True)


def saturation_row(rows: list[dict], context: int, pattern: str, server: str) -> dict | None:
    """The sweep row of a continuous server with the best throughput (None if none ran)."""
    runs = [r for r in rows if (r["context"], r["pattern"], r["server"]) == (context, pattern, server)
            and "error" not in r and "load" not in r]
    return max(runs, key=lambda r: r["throughput"]) if runs else None


