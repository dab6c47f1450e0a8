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

