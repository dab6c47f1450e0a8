"""benchmarks/_traces.py (trace_summary.py's summary) on a small hand-made trace: device events
only, summed by kernel and by part."""

import gzip
import json

from benchmarks._traces import summarize


def test_summary_sums_device_events_by_kernel_and_part(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "ts": 0, "dur": 3000, "name": "sparse_mla_fwd", "args": {}},
        {"ph": "X", "pid": 1, "ts": 3000, "dur": 1000, "name": "fusion_1",
         "args": {"tf_op": "jit(step)/moe/dot_general"}},
        {"ph": "X", "pid": 1, "ts": 4000, "dur": 1000, "name": "sparse_mla_fwd", "args": {}},
        {"ph": "X", "pid": 2, "ts": 0, "dur": 9000, "name": "host work", "args": {}},
    ]
    (tmp_path / "perfetto_trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    text = summarize(str(tmp_path), steps=2)
    assert "busy 2.5 ms a step" in text                        # 5 ms of device events over 2 steps
    assert "| sparse MLA kernels | 2.0 | 80% |" in text
    assert "| MoE | 0.5 | 20% |" in text
    assert "| sparse_mla_fwd | 1 | 2.00 | 80.0% |" in text
    assert "host work" not in text
