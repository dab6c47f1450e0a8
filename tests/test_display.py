"""decode.py's output marking: dimmed prompt on a terminal, a marker line when piped."""

from __future__ import annotations

import io

from glm_jax.decoding import display


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_dims_the_prompt_and_a_pipe_gets_the_marker_line(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert display.styled(_Terminal()) and not display.styled(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not display.styled(_Terminal())
    assert display.prompt_text("def f(x):", style=True) == "\x1b[2mdef f(x):\x1b[0m"
    piped = display.prompt_text("def f(x):\n", style=False) + "    return x\n"
    prompt, _, completion = piped.partition(f"\n{display.COMPLETION_MARK}\n")
    assert (prompt, completion) == ("def f(x):\n", "    return x\n")
