"""Keyword and regex rules on client text: linear time, on a bounded window, whole words in any script.

A rule runs before admission on whatever the client sent: a pattern that backtracks, or a rule that
reads all of a multi-megabyte paste, would let one request stall a gateway replica for everyone.
"""

import pytest
from pydantic import ValidationError

from raylane.config import RouterConfig
from raylane.router.rules import RULE_WINDOW_CHARS, RouteRules, rule_window


def routes_with(**coding) -> dict:
    return {"routes": [{"name": "coding", "pool": "coding", **coding}, {"name": "chat", "pool": "chat"}]}


@pytest.mark.parametrize(
    "pattern",
    [
        r"^(\w+\s?)*\1$",  # a backreference: matching it is NP-hard, backtracking engines go exponential
        r"^(?=(a+)+b)",  # a lookahead around a nested quantifier
        r"(?<!x)(a|aa)+$",  # a lookbehind
    ],
)
def test_a_pattern_the_linear_engine_cannot_run_is_a_config_error_naming_it(pattern):
    with pytest.raises(ValidationError) as excinfo:
        RouterConfig.model_validate(routes_with(regex=["^```", pattern]))
    message = str(excinfo.value)
    assert "routes.0.regex" in message and repr(pattern) in message
    assert "linear" in message


def test_a_nested_quantifier_is_accepted_and_run_by_the_linear_engine():
    # `(a+)+$` takes a backtracking engine (Python's `re`) exponential time on "aaa…b": 40 characters
    # would take it hours. RE2 runs it in one pass, so this returns, with `re`'s answer.
    config = RouterConfig.model_validate(routes_with(regex=[r"^(a+)+$"]))
    rules = RouteRules([], config.routes[0].regex)
    assert rules.matches("aaaa") and not rules.matches("aaab")
    assert not rules.matches("a" * 2_000_000 + "b")


def test_the_window_is_bounded_and_keeps_whole_lines_at_both_ends():
    text = "explain this:\n" + "x = 1\n" * 400_000 + "what does it print?"
    window = rule_window(text)
    assert len(window) <= 2 * RULE_WINDOW_CHARS + 1
    assert window.startswith("explain this:\n") and window.endswith("\nwhat does it print?")
    assert all(line in ("explain this:", "x = 1", "what does it print?") for line in window.split("\n"))
    assert rule_window("short text\n") == "short text\n"


def test_a_rule_matches_in_the_head_and_in_the_tail_of_a_long_paste_not_in_its_middle():
    rules = RouteRules(["kubernetes"], [r"^Traceback \(most recent call last\):"])
    paste = "lorem ipsum dolor\n" * 100_000  # 1.8 MB
    assert rules.matches(rule_window("How do I scale a kubernetes deployment?\n" + paste))
    assert rules.matches(rule_window(paste + "Traceback (most recent call last):\n  File x\n"))
    assert not rules.matches(rule_window(paste + "kubernetes\n" + paste))


def test_keywords_match_whole_words_case_insensitively_in_any_script():
    rules = RouteRules(["función", "C++"], [])
    assert rules.matches("¿Cómo escribo una FUNCIÓN recursiva?")
    assert rules.matches("función")
    assert not rules.matches("subfunción") and not rules.matches("funciónes")
    assert rules.matches("templates in C++, please") and not rules.matches("C++x")
    assert not RouteRules(["sql"], []).matches("sqlite") and RouteRules(["sql"], []).matches("a SQL join")
