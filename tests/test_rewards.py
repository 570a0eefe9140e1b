"""Rule verifiers: tricky forms of the same answer, and answers that only look alike."""

import pytest

from grpo_kernels.training.rewards import boxed_match, extract_boxed, format_reward, numeric_match, parse_number


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("0.50", "0.5", 1.0),
        (".5", "0.5", 1.0),
        (" 9.9 ", "9.90", 1.0),
        ("1,000", "1000", 1.0),
        ("$3", "3", 1.0),
        ("-3.", "-3", 1.0),
        ("1/2", "0.5", 1.0),
        ("\\frac{1}{2}", "0.5", 1.0),
        ("9.11", "9.9", 0.0),
        ("9.9.9", "9.9", 0.0),
        ("nine", "9", 0.0),
        ("", "0", 0.0),
        ("1e3", "1000", 0.0),
    ],
)
def test_numeric_match(completion, gold, score):
    assert numeric_match(["q"], [completion], [gold]) == [score]


def test_numeric_match_tolerance_and_missing_gold():
    assert numeric_match(["q", "q"], ["3.1416", "3.2"], ["3.14159", "3.14159"], tolerance=1e-4) == [1.0, 0.0]
    assert numeric_match(["q"], ["1"], [None]) == [None]
    assert parse_number("9.") == 9.0 and parse_number("+.25") == 0.25 and parse_number("1 2") is None


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{x^{2}+1}", "x^{2}+1"),
        ("no box", None),
        ("\\boxed{open", None),
    ],
)
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("The answer is \\boxed{0.75}", "\\frac{3}{4}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("\\boxed{ \\text{Paris} }", "paris", 1.0),
        ("\\boxed{2}", "3", 0.0),
        ("2", "2", 0.0),
        ("\\boxed{x^{2}+1}", "\\boxed{x^{2} + 1}", 1.0),
    ],
)
def test_boxed_match(completion, gold, score):
    assert boxed_match(["q"], [completion], [gold]) == [score]


def test_format_reward():
    assert format_reward(["q"] * 4, ["9.9", " .5 ", "9.9 or 9.11", "answer: 3"]) == [1.0, 1.0, 0.0, 0.0]
    assert format_reward(["q"], ["<think>a</think> 3"], pattern=r"<think>.*</think>.*") == [1.0]
