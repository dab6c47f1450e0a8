"""benchmarks/repetition.py's measures of a completion and its --settings items, on hand-written
texts and token lists."""

import argparse

import pytest

from benchmarks import repetition
from glm_jax.decoding.sampling import SamplingParams


def _text(repeated: str, times: int) -> str:
    return "def f(x):\n" + f"    {repeated}\n" * times + "\n\n    return x\n"


def test_a_line_five_times_is_flagged_and_three_times_is_not():
    five = repetition.measure([1, 2, 3], _text("x = x + 1", 5))
    assert five["repeats_line"] and five["max_line_count"] == 5 and five["most_repeated_line"] == "x = x + 1"
    three = repetition.measure([1, 2, 3], _text("x = x + 1", 3))
    assert not three["repeats_line"] and three["max_line_count"] == 3
    four = repetition.measure([1, 2, 3], _text("x = x + 1", 4))
    assert four["repeats_line"]                           # more than 3 times


def test_lines_are_compared_stripped_and_blank_lines_do_not_count():
    text = "a = 1\n  a = 1  \n\ta = 1\n\n\n\n   \n\nb = 2\n"
    assert repetition.max_line_count(text) == 3
    assert repetition.line_counts(text) == {"a = 1": 3, "b = 2": 1}
    assert repetition.max_line_count("\n \n\n") == 0
    assert repetition.measure([], "")["max_line_count"] == 0


def test_a_loop_without_newlines_is_caught_by_the_4gram_measure():
    # `len(len(len(...`: tokens [len, (] repeated; every 4-gram of it occurs many times
    loop = [7, 8] * 20
    m = repetition.measure(loop, "len(" * 20)
    assert m["loops"] and not m["repeats_line"] and m["max_line_count"] == 1
    assert m["loop_coverage"] == 1.0
    assert m["distinct_ratio"] == pytest.approx(2 / 40)


def test_a_4gram_five_times_loops_and_four_times_does_not():
    gram = [1, 2, 3, 4]
    five = sum(([*gram, 100 + i] for i in range(5)), [])      # separated by distinct tokens
    assert repetition.ngram_counts(five)[tuple(gram)] == 5
    assert repetition.measure(five, "")["loops"]
    assert repetition.loop_coverage(five) == pytest.approx(20 / 25)      # the separators are outside
    four = sum(([*gram, 100 + i] for i in range(4)), [])
    assert not repetition.measure(four, "")["loops"] and repetition.loop_coverage(four) == 0.0


def test_distinct_ratio_and_empty_completions():
    assert repetition.distinct_ratio([5, 6, 7, 8]) == 1.0
    assert repetition.distinct_ratio([5, 5, 6, 6]) == 0.5
    assert repetition.distinct_ratio([]) == 0.0 and repetition.loop_coverage([]) == 0.0


def test_completions_are_cut_at_the_stop_token_or_padding():
    assert repetition.new_tokens([3, 4, 9, 5], stop=9) == [3, 4]
    assert repetition.new_tokens([3, 4, -1, -1], stop=None) == [3, 4]


def test_summary_counts_flags_and_takes_the_median_max_line_count():
    per = [repetition.measure([1, 2, 3, 4], _text("pass", n)) for n in (1, 2, 5, 6, 7)]
    row = repetition.summarize(per)
    assert row["completions"] == 5 and row["repeats_line"] == 3 and row["median_max_line_count"] == 5
    assert row["loops"] == 0 and row["mean_distinct_ratio"] == 1.0 and row["mean_new_tokens"] == 4


def test_settings_parse_to_sampling_params_and_label_back():
    assert repetition.parse_setting("greedy") == SamplingParams()
    p = repetition.parse_setting("t=0.8,top_p=0.95")
    assert p == SamplingParams(temperature=0.8, top_p=0.95)
    assert repetition.setting_label(p) == "t=0.8,top_p=0.95"
    assert repetition.setting_label(repetition.parse_setting("temperature=1, min_p=0.05")) == "t=1,min_p=0.05"
    assert repetition.setting_label(repetition.parse_setting("t=0,top_k=40")) == "greedy"
    for default in repetition.DEFAULT_SETTINGS:
        assert repetition.setting_label(repetition.parse_setting(default)) == default


@pytest.mark.parametrize("bad, says", [("t=0.7,top_q=0.9", "top_q"), ("t=hot", "must be a number"),
                                       ("top_p=1.5", "top_p must be in (0, 1]"), ("t=-1", "temperature must be"),
                                       ("top_k=2.5", "top_k must be a number")])
def test_bad_settings_are_one_line_errors_that_name_the_item(bad, says):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        repetition.parse_setting(bad)
    assert says in str(e.value) and "\n" not in str(e.value)
