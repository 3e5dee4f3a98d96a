from __future__ import annotations

import pytest

from raylane.engine.detokenizer import IncrementalDetokenizer
from tests.tokenizers_for_tests import make_tokenizer

TEXTS = [
    "Hello world, this is plain ASCII.",
    "Crème brûlée à São Paulo, naïve façade — Ångström!",
    "東京は日本の首都です。北京是中国的首都。",
    "Rockets 🚀🛸 and 🧪🧬 mix with 中文 and émojis 👩🏽‍🔬 here.",
    '{"name": "Zoë", "city": "Kraków", "tags": ["✓", "日本"]}',
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(1000)


def stream(detok: IncrementalDetokenizer, ids: list[int], finish: bool = True) -> list[str]:
    deltas = [detok.update([i]) for i in ids]
    if finish:
        deltas.append(detok.flush())
    return deltas


def test_fixture_splits_characters(tok):
    # The tests below only mean something if some tokens hold part of a character.
    ids = tok.encode("".join(TEXTS))
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Q: say something 日本\nA:"])
def test_deltas_concatenate_to_full_decode(tok, text, prompt):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.stopped_by is None


def test_multi_token_updates_and_special_tokens(tok):
    ids = tok.encode(TEXTS[3]) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == TEXTS[3]
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(keep, ids)) == tok.decode(ids, skip_special_tokens=False)


def test_window_stays_small(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("prompt " * 50))
    for i in tok.encode(" ".join(TEXTS) * 4):
        detok.update([i])
        assert len(detok._ids) <= 12  # constant work per token, whatever the length


def test_invalid_utf8_is_emitted_not_held_forever(tok):
    # A lone lead byte followed by ASCII: the U+FFFD is real output, not a pending character.
    lead = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")
    ids = tok.encode("ab") + [lead] + tok.encode("cd")
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, ids)) == tok.decode(ids)
    trailing = IncrementalDetokenizer(tok, [])
    assert "".join(stream(trailing, tok.encode("ab") + [lead])) == tok.decode(tok.encode("ab") + [lead])


@pytest.mark.parametrize("include", [False, True])
def test_single_stop_string(tok, include):
    text = "The answer is 42. END of the story."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], stop=["END"], include_stop_str_in_output=include)
    deltas = stream(detok, ids, finish=False)
    expected = "The answer is 42. END" if include else "The answer is 42. "
    assert "".join(deltas) == detok.text == expected
    assert detok.stopped_by == "END"
    assert detok.update(tok.encode(" more")) == "" and detok.flush() == ""
    if not include:
        assert not any("E" in d for d in deltas)  # never a partial stop string on the wire


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_and_multibyte(tok, include):
    stop = "首都です"
    text = "東京は日本の首都です。次へ"
    ids = tok.encode(text)
    # Make sure the stop string really spans several tokens.
    assert not any(stop in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], stop=["xyz", stop], include_stop_str_in_output=include)
    deltas = stream(detok, ids, finish=False)
    assert "".join(deltas) == ("東京は日本の首都です" if include else "東京は日本の")
    assert detok.stopped_by == stop
    assert not any("\ufffd" in d for d in deltas)
    if not include:
        assert not any("首" in d for d in deltas)


def test_multiple_stops_earliest_wins(tok):
    text = "alpha ### beta END gamma"
    detok = IncrementalDetokenizer(tok, [], stop=["END", "###"])
    assert "".join(stream(detok, tok.encode(text), finish=False)) == "alpha "
    assert detok.stopped_by == "###"


def test_stop_matching_at_first_token_and_spanning_shown_text(tok):
    # With include_stop_str_in_output nothing is held, so a stop string that begins in
    # already-emitted text must still be found.
    ids = tok.encode("xx</s>yy")
    detok = IncrementalDetokenizer(tok, [], stop=["</s>"], include_stop_str_in_output=True)
    deltas = stream(detok, ids, finish=False)
    assert "".join(deltas) == "xx</s>" and detok.stopped_by == "</s>"
    first = IncrementalDetokenizer(tok, [], stop=["xx"])
    assert "".join(stream(first, ids, finish=False)) == "" and first.stopped_by == "xx"


def test_held_back_prefix_released_by_flush(tok):
    text = "Wait for the EN"  # ends with a prefix of "END": held until the request ends
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    streamed = "".join(stream(detok, tok.encode(text), finish=False))
    assert streamed == "Wait for the "
    assert detok.flush() == "EN"
    assert detok.text == text and detok.stopped_by is None


def test_held_back_prefix_released_when_it_diverges(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["ENDING"])
    out = "".join(stream(detok, tok.encode("the END is near"), finish=False))
    assert out == "the END is near"  # "END" diverged from "ENDING" once " is" arrived
    assert detok.flush() == ""


def test_stop_strings_count_only_after_min_tokens(tok):
    """vLLM's min_tokens: a stop string in the first min_tokens tokens is shown, one after them stops."""
    text = "one END two END three"
    ids = tok.encode(text)
    before_second = len(tok.encode("one END two"))
    detok = IncrementalDetokenizer(tok, [], stop=["END"], min_tokens=before_second)
    shown = "".join(stream(detok, ids, finish=False))
    assert shown == "one END two " and detok.stopped_by == "END"
    no_min = IncrementalDetokenizer(tok, [], stop=["END"])
    assert "".join(stream(no_min, ids, finish=False)) == "one "
