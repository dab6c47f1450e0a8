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


def test_summary_reads_an_xspace_file_and_says_how_long_the_device_stood_idle(tmp_path):
    """The same sums from the *.xplane.pb JAX's profiler writes (read without the perfetto JSON),
    with the device's idle share of the traced span: 5 ms of kernels over 9 ms."""
    from jax.profiler import ProfileData

    ms = 1_000_000_000        # picoseconds
    xspace = f'''
    planes {{ id: 1 name: "/device:GPU:0"
      lines {{ id: 1 name: "Stream #13(Compute)"
        events {{ metadata_id: 1 offset_ps: 0 duration_ps: {3 * ms} }}
        events {{ metadata_id: 2 offset_ps: {3 * ms} duration_ps: {ms} stats {{ metadata_id: 1 str_value: "jit(step)/moe/dot" }} }}
        events {{ metadata_id: 1 offset_ps: {8 * ms} duration_ps: {ms} }} }}
      event_metadata {{ key: 1 value {{ id: 1 name: "sparse_mla_fwd" }} }}
      event_metadata {{ key: 2 value {{ id: 2 name: "fusion_1" }} }}
      stat_metadata {{ key: 1 value {{ id: 1 name: "tf_op" }} }} }}
    planes {{ id: 2 name: "/host:CPU" lines {{ id: 1 name: "python" events {{ metadata_id: 1 duration_ps: {9 * ms} }} }}
      event_metadata {{ key: 1 value {{ id: 1 name: "host work" }} }} }}'''
    (tmp_path / "run.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(xspace))
    text = summarize(str(tmp_path))
    assert "3 device events (3 a step), busy 5.0 ms a step over a span of 9.0 ms a step: the device idle 44%" in text
    assert "| sparse MLA kernels | 4.0 | 80% |" in text and "| MoE | 1.0 | 20% |" in text
    assert "| sparse_mla_fwd | 2 | 4.00 | 80.0% |" in text
    assert "host work" not in text
