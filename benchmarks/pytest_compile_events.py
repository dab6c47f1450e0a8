"""A pytest plugin that prints where a test run's time went in jax: the summed durations of
jax's own compile events (tracing, lowering, XLA's backend compile) and how many compiles took
how long. For finding what makes the test suite slow:

    PYTHONPATH=.:benchmarks .venv/bin/python -m pytest -q -p pytest_compile_events \\
        tests/test_bits_per_byte.py tests/test_model.py tests/test_losses.py

Run it without -n (the counts are of this process only)."""

from __future__ import annotations

import collections
import time

from jax import monitoring

_BACKEND = "/jax/core/compile/backend_compile_duration"
_seconds: collections.Counter = collections.Counter()
_calls: collections.Counter = collections.Counter()
_backend: list[float] = []
_start = time.perf_counter()


def _listen(event: str, duration: float, **_) -> None:
    _seconds[event] += duration
    _calls[event] += 1
    if event == _BACKEND:
        _backend.append(duration)


monitoring.register_event_duration_secs_listener(_listen)


def pytest_unconfigure(config) -> None:
    wall = time.perf_counter() - _start
    print(f"\njax compile events over {wall:.1f} s of this process:")
    for event, seconds in _seconds.most_common(6):
        print(f"  {seconds:8.1f} s  {100 * seconds / wall:5.1f}%  {_calls[event]:6d} calls  {event}")
    bounds = (0.0, 0.05, 0.2, 1.0, 5.0, float("inf"))
    for lo, hi in zip(bounds, bounds[1:]):
        within = [d for d in _backend if lo <= d < hi]
        print(f"  backend compiles of {lo:g}-{hi:g} s: {len(within)}, {sum(within):.1f} s")
