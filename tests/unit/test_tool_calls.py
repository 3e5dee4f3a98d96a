"""Tool-call markup out of model output: streamed pieces and a whole text give the same content and
calls, and hostile outputs (long blank runs, calls that never close, deep nesting, 200 KB arguments)
parse in linear time. The timeouts are a guard, not a measure: the linear parser takes well under a
second on these inputs, the quadratic one before it took minutes (see the commit message)."""

import json

import pytest

from raylane.deployments.protocol.tool_calls import ContentDelta, ToolCallStreamParser, parse_tool_calls

N = 200_000  # characters of hostile output, about what a long max_tokens lets a model write


def streamed(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from feeding `text` in pieces of `step` characters."""
    parser, events = ToolCallStreamParser(), []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if not isinstance(e, ContentDelta):
            if e.name is not None:
                calls[e.index] = [e.name, ""]
            calls[e.index][1] += e.arguments
    return content, [tuple(c) for c in calls.values()]


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c.name, c.arguments) for c in calls]


ORDINARY = [
    # (output, content, calls)
    (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me look.",
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        '<tool_call>\n{"name": "a", "arguments": {"x": "}", "y": [1, {"z": 2}]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        None,
        [("a", '{"x": "}", "y": [1, {"z": 2}]}'), ("b", "{}")],
    ),
    # a string value is taken as the arguments' JSON text itself
    ('<tool_call>{"name": "say", "arguments": "{}"}</tool_call>', None, [("say", "{}")]),
    (
        '<tool_call>\n{"name": "q\\"x", "arguments": {"s": "a\\\\"}}\n</tool_call>',
        None,
        [('q"x', '{"s": "a\\\\"}')],
    ),
    # a closing tag's first characters inside the arguments are arguments
    (
        '<tool_call>{"name": "h", "arguments": {"s": "</tool_x"}}</tool_call>',
        None,
        [("h", '{"s": "</tool_x"}')],
    ),
    # cut by max_tokens: the call keeps the arguments written so far
    ('<tool_call>\n{"name": "f", "arguments": {"city": "Par', None, [("f", '{"city": "Par')]),
    # not markup: stays content, whitespace and tags included
    ("no calls <tool_call> not json </tool_call>", "no calls <tool_call> not json </tool_call>", []),
    ("a < b and <tool but no call  \n ", "a < b and <tool but no call  \n ", []),
]


@pytest.mark.parametrize("text,content,calls", ORDINARY)
def test_ordinary_outputs_parse_the_same_streamed_and_whole(text, content, calls):
    assert whole(text) == ((content if calls else text), calls)
    for step in (1, 2, 3, 7, 64, len(text)):
        assert streamed(text, step) == ((content or "") if calls else text, calls)


@pytest.mark.timeout(10, func_only=True)  # a session teardown after it is not its time
def test_long_blank_run_before_text_parses_in_linear_time():
    text = " \n" * (N // 2) + "x"  # a run that may precede <tool_call> until "x" says it does not
    assert whole(text) == (text, [])
    assert streamed(text, 1) == (text, [])


@pytest.mark.timeout(10, func_only=True)  # a session teardown after it is not its time
def test_long_blank_run_before_a_call_is_dropped_in_linear_time():
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text = "Answer." + " " * N + call
    assert whole(text) == ("Answer.", [("f", '{"a": 1}')])
    assert streamed(text, 1) == ("Answer.", [("f", '{"a": 1}')])


@pytest.mark.timeout(10, func_only=True)  # a session teardown after it is not its time
def test_long_arguments_stream_in_linear_time():
    args = json.dumps({"text": "x" * N, "list": [[{}] * 3] * 1000})
    text = f'<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'
    assert streamed(text, 1) == ("", [("f", args)])
    assert whole(text) == (None, [("f", args)])


@pytest.mark.timeout(10, func_only=True)  # a session teardown after it is not its time
def test_unclosed_and_repeated_tags_stay_text_in_linear_time():
    text = "<tool_call>{" * (N // 12)
    assert whole(text) == (text, [])
    assert streamed(text, 5) == (text, [])
    text = ("<tool_c" + " " * 50) * (N // 57)
    assert whole(text) == (text, [])
    assert streamed(text, 3) == (text, [])


@pytest.mark.timeout(10, func_only=True)  # a session teardown after it is not its time
def test_header_far_into_a_call_goes_out_when_it_closes():
    text = "<tool_call>{" + " " * N + '"name": "f", "arguments": {"a": [1]}}</tool_call>'
    assert whole(text) == (None, [("f", '{"a": [1]}')])
    assert streamed(text, 4) == ("", [("f", '{"a": [1]}')])


@pytest.mark.timeout(10, func_only=True)  # a session teardown after it is not its time
@pytest.mark.parametrize("opener", ["[", "{"])
def test_nesting_deeper_than_the_json_parser_is_not_an_error(opener):
    deep = opener * (N // 2)  # json.loads raises RecursionError at about a thousand levels
    text = f'<tool_call>\n{{"name": "f", "arguments": {deep}\n</tool_call>after'
    # Not a valid call, so a whole text keeps it as content; a stream had sent the name and keeps
    # the arguments sent so far (as for any call that turns out invalid after its name went out).
    assert whole(text) == (text, [])
    assert streamed(text, 16) == ("", [("f", deep + "\n")])
    assert whole(f"<tool_call>{deep}</tool_call>") == (f"<tool_call>{deep}</tool_call>", [])


@pytest.mark.parametrize(
    "cut", ['<tool_call>\n{"name": "get_weather', "<tool_call>\n{", "<tool_", '  <tool_call>\n{"na']
)
def test_a_forced_call_cut_before_its_arguments_is_no_content(cut):
    """A named or `required` tool choice constrains the output to calls: cut by max_tokens before its
    arguments began, the markup is a call cut short, not text to show the client (it was returned as
    `content`). Unforced, the same text stays content."""
    assert parse_tool_calls(cut, forced=True) == (None, [])
    parser = ToolCallStreamParser(forced=True)
    events = [*parser.feed(cut[:5]), *parser.feed(cut[5:]), *parser.finish()]
    assert not [e for e in events if isinstance(e, ContentDelta)]
    assert parse_tool_calls(cut)[0] == cut
