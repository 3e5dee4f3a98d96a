"""Reasoning parsers on real token boundaries: the shipped tokenizer (which splits `<think>` into
five tokens) and one that has the tags as single added tokens, as Qwen3's and DeepSeek-R1's do."""

import copy

import pytest

from raylane.deployments.pool.reasoning_parser import ReasoningParser, reasoning_tokens, split_reasoning
from tests.tokenizers_for_tests import make_tokenizer

THOUGHT = "<think>\nTwo and two: 4.\n</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def shipped():
    from raylane.models.demo import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def tagged():
    tokenizer = copy.deepcopy(make_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


def token_texts(tokenizer, text: str) -> tuple[list[int], list[str]]:
    """The text of each token as a detokenizer streams it (decoded prefixes' differences)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts, shown = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        texts.append(now[len(shown) :])
        shown = now
    assert shown == text
    return ids, texts


def stream(fmt: str, pieces: list[str]) -> tuple[str, str, ReasoningParser]:
    parser = ReasoningParser(fmt)
    reasoning = content = ""
    for piece in pieces:
        out = parser.feed(piece)
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = parser.finish()
    return reasoning + out.reasoning, content + out.content, parser


def test_tags_split_across_tokens_are_found(shipped):
    ids, texts = token_texts(shipped, THOUGHT)
    assert "<think>" not in texts and "</" in texts  # the tags really are split
    reasoning, content, parser = stream("qwen3", texts)
    assert (reasoning, content) == ("\nTwo and two: 4.\n", "The answer is 4.")
    whole, _ = split_reasoning("qwen3", THOUGHT)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    # The thinking ends with the token that completes "</think>" (the shipped BPE writes it as
    # "</", "th", "in", "k", ">\n"): every token up to it, none of the answer's.
    end = THOUGHT.index("</think>") + len("</think>")
    counted = reasoning_tokens(parser, shipped, ids)
    assert len(shipped.decode(ids[: counted - 1])) < end <= len(shipped.decode(ids[:counted]))
    assert shipped.decode(ids[counted:]).strip() == "The answer is 4."


def test_tags_as_single_tokens(tagged):
    ids, texts = token_texts(tagged, THOUGHT)
    assert "<think>" in texts and "</think>" in texts
    reasoning, content, parser = stream("qwen3", texts)
    assert (reasoning, content) == ("\nTwo and two: 4.\n", "The answer is 4.")
    assert reasoning_tokens(parser, tagged, ids) == texts.index("</think>") + 1


def test_unterminated_thinking_is_all_reasoning(shipped):
    text = "<think>\nStill thinking about </thi"
    ids, texts = token_texts(shipped, text)
    reasoning, content, parser = stream("qwen3", texts)
    assert (reasoning, content) == ("\nStill thinking about </thi", "")
    assert reasoning_tokens(parser, shipped, ids) == len(ids)


def test_qwen3_without_thinking_is_all_answer(shipped):
    for text in ("Hello <think> there", "  <thi", "Plain answer."):
        ids, texts = token_texts(shipped, text)
        reasoning, content, parser = stream("qwen3", texts)
        assert (reasoning, content) == ("", text)
        assert reasoning_tokens(parser, shipped, ids) == 0


def test_deepseek_r1_starts_inside_the_thinking(shipped):
    cases = {
        "First, 2+2.</think>\n\nIt is 4.": ("First, 2+2.", "It is 4."),
        "<think>Again.</think>Done": ("Again.", "Done"),  # a repeated <think> is dropped
        "Never finished": ("Never finished", ""),
        "": ("", ""),
    }
    for text, expected in cases.items():
        _, texts = token_texts(shipped, text) if text else (None, [])
        reasoning, content, _ = stream("deepseek_r1", texts)
        assert (reasoning, content) == expected, text


def test_any_chunking_gives_the_same_split():
    whole, _ = split_reasoning("qwen3", THOUGHT)
    for i in range(len(THOUGHT) + 1):
        for j in range(i, len(THOUGHT) + 1, 3):
            reasoning, content, _ = stream("qwen3", [THOUGHT[:i], THOUGHT[i:j], THOUGHT[j:]])
            assert (reasoning, content) == (whole.reasoning, whole.content), (i, j)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        ReasoningParser("granite")


@pytest.mark.timeout(10, func_only=True)  # a session teardown after it is not its time
@pytest.mark.parametrize("fmt", ["qwen3", "deepseek_r1"])
def test_long_blank_run_at_the_start_parses_in_linear_time(fmt):
    """A model that writes 200 KB of blanks before anything else, one per token: the parser holds
    them until the next text decides what they are, without re-reading them on every token (the
    old parser did, taking seconds per 100 KB and growing with the square)."""
    blanks = " \n" * 100_000
    reasoning, content, _ = stream(fmt, list(blanks) + ["<think>", "x", "</think>", "y"])
    assert (reasoning, content) == ("x", "y")
    reasoning, content, _ = stream(fmt, list(blanks) + ["The answer."])
    expected = ("", blanks + "The answer.") if fmt == "qwen3" else (blanks + "The answer.", "")
    assert (reasoning, content) == expected
