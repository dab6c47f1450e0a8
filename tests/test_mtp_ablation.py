"""benchmarks/mtp_ablation.py's paired gains: per-prompt differences between ablation rows."""

from benchmarks import mtp_ablation


def _rows(temperature, per_row):
    return [dict(row=row, temperature=temperature, per_prompt=values) for row, values in per_row.items()]


def test_gains_are_paired_per_prompt_and_judged_against_their_standard_error():
    # b beats a by exactly 1 on every prompt although the prompts' spread (1..4) is larger:
    # paired, the gain is 1 ± 0; d differs from c by +1/-1 alternately: 0 ± 0.5, not a gain.
    rows = _rows(0.7, {"a": [1.0, 2.0, 3.0, 4.0], "b": [2.0, 3.0, 4.0, 5.0], "c": [2.0, 3.0, 4.0, 5.0],
                       "d": [3.0, 2.0, 5.0, 4.0]})
    lines = mtp_ablation.paired_gains(rows, 0.7)
    assert lines[0] == "| a -> b | 0.7 | +1.00 ± 0.00 | yes | 4 of 4 |"
    assert lines[1] == "| b -> c | 0.7 | +0.00 ± 0.00 | no | 0 of 4 |"
    assert lines[2] == "| c -> d | 0.7 | +0.00 ± 0.50 | no | 2 of 4 |"
    assert lines[3] == "| a -> d | 0.7 | +1.00 ± 0.50 | yes | 2 of 4 |"
