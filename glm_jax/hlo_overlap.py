"""Find async collectives in scheduled HLO text and what compute runs while they are in flight.

    pairs = async_pairs(compiled.as_text())
    [(p.kind, p.ops_between) for p in pairs]

A pair is an `X-start` and its `X-done` in one computation (HLO is printed in schedule order);
`ops_between` counts the fusions, convolutions and custom calls scheduled between them: work
the device does while the transfer is in flight.
"""

from __future__ import annotations

import dataclasses
import re

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_COMPUTE = ("fusion", "convolution", "custom-call", "dot")


@dataclasses.dataclass(frozen=True)
class AsyncPair:
    kind: str            # e.g. "collective-permute"
    start: str           # instruction names
    done: str
    ops_between: int     # compute instructions scheduled between start and done


def async_pairs(hlo_text: str) -> list[AsyncPair]:
    pairs: list[AsyncPair] = []
    for body in re.split(r"\n(?=\S)", hlo_text):          # one computation per top-level block
        open_starts: dict[str, tuple[str, int]] = {}
        compute = 0
        for line in body.splitlines():
            m = _DEF.match(line)
            if not m:
                continue
            name, opcode, rest = m.groups()
            if opcode.endswith("-start"):
                open_starts[name] = (opcode[: -len("-start")], compute)
            elif opcode.endswith("-done"):
                operand = re.match(r"\s*%([\w.\-]+)", rest)
                if operand and operand.group(1) in open_starts:
                    kind, at = open_starts.pop(operand.group(1))
                    pairs.append(AsyncPair(kind, operand.group(1), name, compute - at))
            elif opcode in _COMPUTE:
                compute += 1
    return pairs


def summarize(pairs: list[AsyncPair]) -> dict[str, dict[str, int]]:
    """{kind: {"pairs": n, "overlapped": pairs with compute between start and done}}."""
    out: dict[str, dict[str, int]] = {}
    for p in pairs:
        row = out.setdefault(p.kind, {"pairs": 0, "overlapped": 0})
        row["pairs"] += 1
        row["overlapped"] += p.ops_between > 0
    return out
