"""GSM8K answer extraction, table-driven: `#### N`, `\\boxed{}`, the last number; commas, signs, decimals, `$`."""

from fractions import Fraction

import pytest

from parse_jax.harness.eval.extract import boxed, extract_answer, format_number, numbers, reference_answer

CASES = [
    ("The answer is 42.", "42"),
    ("She pays $1,234 in total.", "1234"),
    ("1,000,000 people", "1000000"),
    ("It drops to -7 degrees", "-7"),
    ("It costs -$5 net", "-5"),
    ("It costs \u22123 now", "-3"),  # unicode minus
    ("0.5 of the cake", "0.5"),
    ("$3.50 each", "3.5"),
    ("so 3.50 dollars.", "3.5"),
    ("First 12, then 7 = 19 apples", "19"),
    ("5-3=2", "2"),  # a minus between numbers is an operator, not a sign
    ("step 1: 3 * 4 = 12\n#### 12", "12"),
    ("#### 1,200 dollars; later 7", "1200"),  # the #### answer wins over later numbers
    ("#### -8", "-8"),
    ("blah #### 3 #### 4", "4"),  # the last ####
    ("so the result is \\boxed{18} (check: 2 + 16)", "18"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("\\boxed{1/3}", "1/3"),
    ("\\boxed{\\$1,050.00}", "1050"),
    ("\\boxed{x + {1}} and 5", "1"),  # nested braces: the box's content holds 1
    ("no number here", None),
    ("", None),
    ("x2 y3", None),  # digits glued to letters are no numbers
    ("\\boxed{} then 9", "9"),  # an empty box falls back to the last number
    ("####", None),
]


@pytest.mark.parametrize("text, expect", CASES)
def test_extract_answer(text, expect):
    assert format_number(extract_answer(text)) == expect


@pytest.mark.parametrize("answer, expect", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("#### 1,000", "1000"),
    ("#### -3.25", "-3.25"),
    ("no final answer 5", None),
    ("#### none", None),
])
def test_reference_answer(answer, expect):
    assert format_number(reference_answer(answer)) == expect


def test_numbers_and_formatting():
    assert numbers("1, 2, 3 and 4.5") == [1, 2, 3, Fraction(9, 2)]
    assert boxed("a \\boxed{1} b \\boxed{2}") == "2" and boxed("\\boxed{3") is None
    assert format_number(Fraction(1, 8)) == "0.125" and format_number(Fraction(2, 3)) == "2/3"
    assert format_number(Fraction(-10)) == "-10" and format_number(None) is None


@pytest.mark.parametrize("text, strict, flexible", [
    ("2 + 2 = 4. #### 4", Fraction(4), Fraction(4)),
    ("#### 1,000.\nSo 12 apples.", Fraction(1000), Fraction(12)),  # strict reads the mark; flexible the last number
    ("The answer is \\boxed{7}.", None, Fraction(7)),
    ("#### -3 and #### 5", Fraction(-3), Fraction(5)),  # strict: the first mark, as lm-eval's regex matches it
    ("no number here", None, None),
])
def test_lm_eval_strict_and_flexible_scorings(text, strict, flexible):
    from parse_jax.harness.eval.extract import flexible_answer, strict_answer

    assert strict_answer(text) == strict and flexible_answer(text) == flexible
