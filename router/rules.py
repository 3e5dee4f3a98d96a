"""Keyword and regex rules: a route decided outright by what the latest user turn contains.

Rules run before admission on text the client wrote, so their cost is bounded twice over:
- they read a bounded window of the text (`rule_window`), its first and last `RULE_WINDOW_CHARS`
  characters (a request is stated at the start, then a paste, or at the end, after one), never the
  middle of a multi-megabyte paste; the classifier cuts every text it reads to this window first;
- they run on RE2 (`google-re2`), whose matching is linear in the text whatever the pattern: a
  backtracking engine takes exponential time on `(a+)+$` against `aaaa…b`. RE2 refuses what it cannot
  run in linear time (backreferences, lookarounds), which `raylane.config.RouteConfig` checks at load.
Keywords match whole words, case-insensitively; a word character is a letter, digit or `_` in any
script (Python's `\\w`), since RE2's `\\b` knows ASCII letters only.
"""

from __future__ import annotations

import re2

from raylane.config import compile_route_regex

RULE_WINDOW_CHARS = 4096  # characters read at each end of a text
_NOT_WORD = r"[^\p{L}\p{N}_]"


def keyword_pattern(keyword: str) -> str:
    """A keyword as a whole-word, case-insensitive RE2 pattern."""
    return rf"(?i)(?:^|{_NOT_WORD}){re2.escape(keyword)}(?:{_NOT_WORD}|$)"


def rule_window(text: str, chars: int = RULE_WINDOW_CHARS) -> str:
    """What the classifier reads of `text`: all of it when short, else its head and its tail joined
    by a line break, each cut at a line break (when it has one) so that `^` and `$` of a multiline
    pattern still mean whole lines. At most `2 * chars + 1` characters."""
    if len(text) <= 2 * chars + 1:
        return text
    head, tail = text[:chars], text[-chars:]
    if (cut := head.rfind("\n")) > 0:
        head = head[:cut]
    if 0 <= (cut := tail.find("\n")) < len(tail) - 1:
        tail = tail[cut + 1 :]
    return f"{head}\n{tail}"


class RouteRules:
    """One route's rules, compiled once."""

    def __init__(self, keywords: list[str], patterns: list[str]) -> None:
        self._rules = [compile_route_regex(keyword_pattern(k)) for k in keywords]
        self._rules += [compile_route_regex(p) for p in patterns]

    def __bool__(self) -> bool:
        return bool(self._rules)

    def matches(self, text: str) -> bool:
        """Whether a rule matches `text` (a `rule_window`: the caller bounds it)."""
        return any(rule.search(text) for rule in self._rules)
