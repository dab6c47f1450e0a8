"""How decode.py shows a completion: where the prompt ends and the completion starts.

On a terminal the prompt is printed dimmed (ANSI faint) and the completion follows it in normal
text, so code reads on without a break. Piped (or with NO_COLOR set) the prompt is followed by a
newline, the line COMPLETION_MARK and a newline, so the completion is exactly the text after
the first "\\n" + COMPLETION_MARK + "\\n":

    def f(x):
    ----- completion -----
        return x
"""

from __future__ import annotations

import os

COMPLETION_MARK = "----- completion -----"
_FAINT, _RESET = "\x1b[2m", "\x1b[0m"


def styled(stream) -> bool:
    """Whether `stream` shows ANSI styles: a terminal, and NO_COLOR (no-color.org) not set."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def prompt_text(prompt: str, *, style: bool) -> str:
    """The prompt as printed before its completion: dimmed (style), else followed by the marker line."""
    if style:
        return f"{_FAINT}{prompt}{_RESET}"
    return f"{prompt}\n{COMPLETION_MARK}\n"



def steady_state_line(gen) -> str:
    """After generation: decode tokens/s without compilation and, speculative, the mean acceptance
    length, from `gen.stats` (a `runtime.DecodeStats`) of a Generator or SpeculativeGenerator. The
    line starts "steady state: <float> tokens/s" (or "steady state: not measured")."""
    s = gen.stats
    if s.verify_steps:
        rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate)
        return (f"steady state: {s.steady_tokens / max(s.steady_s, 1e-9):.1f} tokens/s ({s.steady_tokens} new tokens "
                f"in {s.steady_s:.2f}s; the decode program was compiled before the timed run, in "
                f"{s.compile_s:.2f}s); acceptance length {s.acceptance_length:.2f} over {s.verify_steps} verify "
                f"steps (acceptance rate per draft position: {rates})")
    if s.steady_tokens <= 0:
        return (f"steady state: not measured (one decode block of {gen.block_size} tokens, which includes "
                f"the compilation; give --max-new-tokens > {gen.block_size})")
    return (f"steady state: {s.steady_tokens / max(s.steady_s, 1e-9):.1f} tokens/s ({s.steady_tokens} new tokens in "
            f"{s.steady_s:.2f}s after the first decode block, which compiled the decode program in "
            f"{s.compile_s:.2f}s)")
