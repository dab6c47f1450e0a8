"""Where a traced program's GPU time goes: the device events of a `jax.profiler` trace
(its *.xplane.pb, or perfetto_trace.json.gz as `jax.profiler.trace(dir, create_perfetto_trace=True)`
writes beside it) summed by kernel and by the model part their op names point to (`summarize`;
the command line: benchmarks/trace_summary.py), with the launches and the share of the traced
span the device stood idle (a program bound by its host or its loops' conditions shows there).

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


def part_of(kernel: str, op: str) -> str:
    text = (op + " " + kernel).lower()
    for part, pattern in PARTS:
        if re.search(pattern, text):
            return part
    return "rest (projections, norms, elementwise)"


class Kernels:
    """Device events summed by kernel name: time (us), calls, one op name each, and the span."""

    def __init__(self):
        self.time, self.calls, self.op = collections.Counter(), collections.Counter(), {}
        self.first, self.last = float("inf"), float("-inf")

    def add(self, name: str, ts: float, dur: float, op) -> None:
        """One event (microseconds); op: its op name, or a function giving it (asked once a kernel)."""
        self.time[name] += dur
        self.calls[name] += 1
        if name not in self.op:
            self.op[name] = op() if callable(op) else op
        self.first, self.last = min(self.first, ts), max(self.last, ts + dur)


def _from_perfetto(path: Path) -> Kernels:
    kernels = Kernels()
    for e in device_events(json.loads(gzip.decompress(path.read_bytes()))):
        kernels.add(e["name"], e["ts"], e["dur"], op_name(e))
    return kernels


def _from_xplane(path: Path) -> Kernels:
    """The GPU planes' stream events of an XSpace file (*.xplane.pb), read by JAX's profile
    reader: seconds where the perfetto JSON of a long program (millions of kernels) takes minutes."""
    from jax.profiler import ProfileData

    kernels = Kernels()
    for plane in ProfileData.from_file(str(path)).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for ev in line.events:
                kernels.add(ev.name, ev.start_ns / 1e3, ev.duration_ns / 1e3, lambda ev=ev: _xplane_op(ev))
    return kernels


def _xplane_op(event) -> str:
    stats = dict(event.stats)
    for key in ("tf_op", "long_name", "hlo_op", "name"):
        if stats.get(key):
            return str(stats[key])
    return event.name


def summarize(trace_dir: str, steps: int = 1, top: int = 40) -> str:
    """The markdown tables of a trace's GPU time by part and by kernel (its *.xplane.pb, else
    its perfetto_trace.json.gz), per step over `steps` traced steps. ValueError where the trace
    has no device events (a CPU's)."""
    root = Path(trace_dir)
    xplanes = sorted(root.rglob("*.xplane.pb"))
    files = sorted(root.rglob("perfetto_trace.json.gz")) or sorted(root.rglob("*.trace.json.gz"))
    if not xplanes and not files:
        raise ValueError(f"no *.xplane.pb, perfetto_trace.json.gz or *.trace.json.gz under {trace_dir}")
    source = xplanes[-1] if xplanes else files[-1]
    kernels = _from_xplane(source) if xplanes else _from_perfetto(source)
    if not kernels.time:
        raise ValueError(f"{source}: no device events (a CPU trace has none)")
    total, launches = sum(kernels.time.values()), sum(kernels.calls.values())
    span = kernels.last - kernels.first
    by_part = collections.Counter()
    for name, d in kernels.time.items():
        by_part[part_of(name, kernels.op[name])] += d
    out = [f"{source}: {launches} device events ({launches / steps:.0f} a step), busy {total / 1e3 / steps:.1f} ms "
           f"a step over a span of {span / 1e3 / steps:.1f} ms a step: the device idle {1 - total / span:.0%} of it "
           f"({steps} steps traced)", "",
           "| part | ms/step | share |", "|---|---:|---:|"]
    out += [f"| {p} | {d / 1e3 / steps:.1f} | {d / total:.0%} |" for p, d in by_part.most_common()]
    out += ["", "| kernel | calls/step | ms/step | share | op |", "|---|---:|---:|---:|---|"]
    for name, d in kernels.time.most_common(top):
        out.append(f"| {name[:70]} | {kernels.calls[name] / steps:.0f} | {d / 1e3 / steps:.2f} | {d / total:.1%} | "
                   f"{kernels.op[name][:140]} |")
    return "\n".join(out)
