"""The programs a run compiles, counted through `jax.monitoring`: how many times each jitted
function was built (compiled, or loaded from the persistent compilation cache) and the seconds
it took, so train.py can print compilation apart from its steady speed and show that the step
compiles once per stage.

    with CompileWatch() as watch:
        ...                                   # jitted calls
        n, seconds = watch.since_last()       # programs built since the previous call
    watch.counts                              # Counter: function name -> programs built
    watch.summary()                           # 'jit(train_step) 2x 20.1 s, ...' 
"""

from __future__ import annotations

import collections

import jax

#: The event jax records once per program it builds.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
    """Counts compilations per function name (`counts`) and their seconds (`seconds`) while
    entered."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.seconds_by_name: collections.Counter = collections.Counter()
        self.seconds = 0.0
        self._marked = (0, 0.0)
        self._active = False

    def _record(self, event: str, secs: float, **info) -> None:
        if self._active and event == COMPILE_EVENT:
            name = str(info.get("fun_name", "?"))
            self.counts[name] += 1
            self.seconds_by_name[name] += secs
            self.seconds += secs

    def __enter__(self) -> "CompileWatch":
        self._active = True
        jax.monitoring.register_event_duration_secs_listener(self._record)
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:             # (older jax: the listener stays, inactive)
            unregister(self._record)

    def since_last(self) -> tuple[int, float]:
        """(programs built, seconds) since the previous call."""
        total = (sum(self.counts.values()), self.seconds)
        n, secs = total[0] - self._marked[0], total[1] - self._marked[1]
        self._marked = total
        return n, secs

    def summary(self, at_least_s: float = 1.0, always: tuple[str, ...] = ()) -> str:
        """'jit(train_step) 2x 20.1 s, jit(eval_step) 1x 1.2 s, 11 smaller programs 0.3 s' (the
        functions that took at least `at_least_s` each, and those named in `always` however
        fast, e.g. a step loaded from the persistent compilation cache; the slowest first)."""
        if not self.counts:
            return "nothing compiled"
        big = [(name, s) for name, s in self.seconds_by_name.most_common() if s >= at_least_s or name in always]
        parts = [f"{name} {self.counts[name]}x {s:.1f} s" for name, s in big]
        small = [name for name in self.counts if name not in dict(big)]
        if small:
            rest = sum(self.counts[name] for name in small)
            parts.append(f"{rest} smaller program(s) {sum(self.seconds_by_name[n] for n in small):.1f} s")
        return ", ".join(parts)
