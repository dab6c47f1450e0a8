"""Where a traced program's GPU time goes: the device events of a `jax.profiler` trace
(perfetto_trace.json.gz, written by `jax.profiler.trace(dir, create_perfetto_trace=True)`)
summed by kernel and by the model part their op names point to (`summarize`; the command line:
benchmarks/trace_summary.py).

Run the traced program with XLA command buffers off (`XLA_FLAGS=--xla_gpu_enable_command_buffer=`)
or the device events carry the graph's name instead of each kernel's.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

# (part, regular expression on the event's op name or kernel name), first match wins
PARTS = (
    ("sparse MLA kernels", r"sparse_mla"),
    ("indexer kernels", r"indexer|topk|top_k|threshold"),
    ("dense attention (cuDNN / fused)", r"cudnn|flash|fmha|dot_product_attention|dense_(indexer_)?kl"),
    ("vocabulary head and losses", r"head_losses|cross_entropy|linear_nll|lm_head|logsumexp"),
    ("embedding", r"embedding|embed"),
    ("MoE", r"moe|expert|ragged|router"),
    ("optimizer", r"adam|optax|scale_by|clip"),
    ("all-reduce / copies", r"memcpy|memset|copy"),
)


def device_events(trace: dict) -> list[dict]:
    """The complete ("X") events on GPU streams of a perfetto/chrome trace."""
    pids = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pids[e["pid"]] = e.get("args", {}).get("name", "")
    gpu = {pid for pid, name in pids.items() if "GPU" in name or "gpu" in name or "/device:" in name}
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def op_name(event: dict) -> str:
    """The most specific name an event carries: its HLO op's name stack if present, else its name."""
    args = event.get("args", {})
    for key in ("tf_op", "long_name", "hlo_op", "name"):
        if args.get(key):
            return str(args[key])
    return event.get("name", "")


def part_of(event: dict) -> str:
    text = (op_name(event) + " " + event.get("name", "")).lower()
    for part, pattern in PARTS:
        if re.search(pattern, text):
            return part
    return "rest (projections, norms, elementwise)"


def summarize(trace_dir: str, steps: int = 1, top: int = 40) -> str:
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz")) or sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    if not files:
        raise ValueError(f"no perfetto_trace.json.gz or *.trace.json.gz under {trace_dir}")
    trace = json.loads(gzip.decompress(files[-1].read_bytes()))
    events = device_events(trace)
    if not events:
        raise ValueError(f"{files[-1]}: no device events (a CPU trace has none)")
    total = sum(e["dur"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    by_kernel = collections.Counter()
    count = collections.Counter()
    example = {}
    for e in events:
        by_kernel[e["name"]] += e["dur"]
        count[e["name"]] += 1
        example.setdefault(e["name"], op_name(e))
    by_part = collections.Counter()
    for e in events:
        by_part[part_of(e)] += e["dur"]
    out = [f"{files[-1]}: {len(events)} device events, busy {total / 1e3 / steps:.1f} ms a step "
           f"over a span of {span / 1e3 / steps:.1f} ms a step ({steps} steps traced)", "",
           "| part | ms/step | share |", "|---|---:|---:|"]
    out += [f"| {p} | {d / 1e3 / steps:.1f} | {d / total:.0%} |" for p, d in by_part.most_common()]
    out += ["", "| kernel | calls/step | ms/step | share | op |", "|---|---:|---:|---:|---|"]
    for name, d in by_kernel.most_common(top):
        out.append(f"| {name[:70]} | {count[name] / steps:.0f} | {d / 1e3 / steps:.2f} | {d / total:.1%} | "
                   f"{example[name][:140]} |")
    sample = next((e for e in events if e.get("args")), events[0])
    out += ["", "one event's fields: " + json.dumps({k: str(v)[:120] for k, v in sample.get("args", {}).items()})]
    return "\n".join(out)

