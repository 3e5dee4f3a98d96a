"""Tool calls in the Hermes/Qwen markup that the demo chat template renders:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_call_grammar` constrains generation to valid calls of the given tools (tool_choice `required`
or a named function); `parse_tool_calls` reads the markup out of a finished text and
`ToolCallStreamParser` does the same as text streams in, so a streamed response carries the same
content and calls as a non-streamed one. Arguments are the model's own JSON text, not re-serialized.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
CALL_BEGIN = '<tool_call>\n{{"name": {name}, "arguments": '
CALL_END = "}\n</tool_call>"
# Whitespace characters in a row inside constrained arguments: JSON as the template's `tojson` writes
# it ({"a": 1, "b": 2}) fits, while a weak model cannot pad the arguments with runs of blanks.
MAX_WHITESPACE = 1
# A call's header ({"name": "...", "arguments": ) is looked for in this much of its body while it
# streams in; one further away (only a model padding it with blanks) goes out when the call closes.
MAX_HEADER_CHARS = 1024
# Matched once per call on a bounded text: each quantifier is followed by a character it cannot
# consume, so the match is linear (no nested or adjacent overlapping quantifiers).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON text
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- constrained generation --------------------------------------------------------------------------


def tool_call_grammar(tools: list[dict], only: str | None = None, parallel: bool = True) -> str:
    """EBNF that admits one call of `only`, or one or more calls (one if not `parallel`) of any tool.

    `tools` are OpenAI function definitions ({"name", "parameters"}). Raises ValueError for a
    parameters schema that xgrammar cannot compile."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    from raylane.engine.structured_params import tighten_json_strings

    chosen = [t for t in tools if only is None or t["name"] == only]
    tags = [
        TagFormat(
            begin=CALL_BEGIN.format(name=json.dumps(t["name"])),
            content=JSONSchemaFormat(
                json_schema=t.get("parameters") or {"type": "object", "properties": {}},
                max_whitespace_cnt=MAX_WHITESPACE,
            ),
            end=CALL_END,
        )
        for t in chosen
    ]
    if only is not None:
        fmt = tags[0]
    else:
        fmt = TagsWithSeparatorFormat(
            tags=tags, separator="\n", at_least_one=True, stop_after_first=not parallel
        )
    try:
        text = str(xgr.Grammar.from_structural_tag(StructuralTag(format=fmt)))
    except Exception as e:  # xgrammar raises RuntimeError or its own errors for unsupported schemas
        raise ValueError(f"cannot build a grammar for these tools: {e}") from None
    # The engine's fix for xgrammar's loose JSON string characters (raw control chars, surrogates).
    return tighten_json_strings(text)


# -- parsing a finished text -------------------------------------------------------------------------


def decode_call(body: str) -> ParsedToolCall | None:
    """One call's JSON ({"name", "arguments"}); None if it is not a valid call."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):  # nesting deeper than the parser's stack is not a call
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    header = _HEADER.match(body)
    if header is not None:  # keep the model's own text of the arguments
        try:
            value, end = json.JSONDecoder().raw_decode(body, header.end())
            if value == args:
                raw = body[header.end() : end]
                return ParsedToolCall(obj["name"], value if isinstance(value, str) else raw)
        except (json.JSONDecodeError, RecursionError):
            pass
    return ParsedToolCall(
        obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    )


def parse_tool_calls(text: str, forced: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a finished text: the stream parser run once, so a response carries exactly
    what its stream would have. Content is the text before the first call (None if empty); text
    that is not valid markup stays content, unless the calls were `forced`; a call cut short
    (max_tokens) keeps its partial arguments."""
    parser = ToolCallStreamParser(forced)
    calls: dict[int, ParsedToolCall] = {}
    content = ""
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, ContentDelta):
            content += event.text
        elif event.name is not None:
            calls[event.index] = ParsedToolCall(event.name, event.arguments, event.id)
        else:
            calls[event.index].arguments += event.arguments
    if not calls:
        return (None if forced else text), []
    return content or None, list(calls.values())


# -- parsing a stream --------------------------------------------------------------------------------
#
# Each `feed` costs time in the new text only (plus a few characters kept from before), so a stream
# costs linear time in its length whatever the model writes: a text held back (a run of whitespace
# that may precede `<tool_call>`, a call's body) is kept as a list of pieces and joined once when it
# is released, and a call's arguments are scanned by a `JsonScanner` that keeps its state between
# pieces. Only a call's header is matched with a regex, on at most `MAX_HEADER_CHARS` of its body.


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None  # set on a call's first delta
    arguments: str = ""


class JsonScanner:
    """Finds where the JSON object/array that a text starts with ends, fed piece by piece."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """Index in `text` just past the value's end; None while it is still open."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def json_value_end(text: str) -> int | None:
    """Index just past the JSON object/array that `text` starts with; None while it is incomplete."""
    return JsonScanner().feed(text)


@dataclass(slots=True)
class _Call:
    index: int
    id: str = field(default_factory=new_call_id)
    gap: str | None = None  # whitespace before `<tool_call>` in content (None: after an earlier call)
    parts: list[str] = field(default_factory=list)  # the body so far
    tail: str = ""  # the body's last characters, where `</tool_call>` may have begun
    head: str = ""  # the body's first MAX_HEADER_CHARS characters, while the header is not found
    header_sent: bool = False
    args_began: bool = False  # the arguments' first non-blank character was seen
    args_scalar: bool = False  # not an object/array: it goes out whole, when the call closes
    args_sent: int = 0
    unsent: str = ""  # arguments held back: they may begin `</tool_call>`
    args_done: bool = False
    scanner: JsonScanner = field(default_factory=JsonScanner)


class ToolCallStreamParser:
    """Feed text deltas; get content and tool-call deltas back, as OpenAI streams them.

    Content is emitted as it comes, except a tail that may begin `<tool_call>` (and whitespace right
    before it). Inside a call, the name goes out once it is complete, then the arguments' JSON text
    as it grows; the closing brace of the call object is never part of them. `forced`: the output is
    constrained to calls (a named or required tool choice), so markup that is not a call by the end
    is a call that max_tokens cut short, never text: it is dropped, not sent as content."""

    def __init__(self, forced: bool = False) -> None:
        self._forced = forced
        self._mode = "content"  # content | call | after
        self._blank: list[str] = []  # held whitespace, in content or after a call
        self._partial = ""  # held after `_blank`: a proper start of `<tool_call>`
        self._call: _Call | None = None
        self.num_calls = 0

    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        out: list[ContentDelta | ToolCallDelta] = []
        rest: str | None = text
        while rest is not None:
            rest = self._feed_call(rest, out) if self._mode == "call" else self._feed_text(rest, out)
        return out

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        """The text ended: release what was held back, close a call the model did not close."""
        out: list[ContentDelta | ToolCallDelta] = []
        if self._mode == "content" and (held := "".join(self._blank) + self._partial) and not self._forced:
            out.append(ContentDelta(held))
        elif self._mode == "call":
            self._close_call("".join(self._call.parts), closed=False, out=out)
        self._blank, self._partial = [], ""
        return out

    def _feed_text(self, text: str, out: list) -> str | None:
        """Content, or text after a call (dropped). The text after a `<tool_call>`, else None."""
        buf = self._partial + text
        start = buf.find(START)
        if start >= 0:
            before = "".join(self._blank) + buf[:start]
            kept = before.rstrip()
            if self._mode == "content" and kept:
                out.append(ContentDelta(kept))
            gap = before[len(kept) :] if self._mode == "content" else None
            self._blank, self._partial, self._mode = [], "", "call"
            self._call = _Call(index=self.num_calls, gap=gap)
            return buf[start + len(START) :]
        hold = _partial_suffix(buf, START)
        body, self._partial = buf[: len(buf) - hold], buf[len(buf) - hold :]
        kept = body.rstrip()
        if kept:  # text that cannot precede a call: the held whitespace goes out with it
            if self._mode == "content":
                out.append(ContentDelta("".join(self._blank) + kept))
            self._blank = []
        if len(body) > len(kept):
            self._blank.append(body[len(kept) :])
        return None

    def _feed_call(self, text: str, out: list) -> str | None:
        """A call's body. The text after its `</tool_call>`, else None."""
        call = self._call
        probe = call.tail + text
        end = probe.find(END)
        if end < 0:
            call.parts.append(text)
            call.tail = probe[-(len(END) - 1) :]
            self._progress_call(text, out)
            return None
        cut = end - len(call.tail)  # where `</tool_call>` begins in `text`; < 0: in an earlier piece
        body = "".join(call.parts)
        body = body + text[:cut] if cut >= 0 else body[: len(body) + cut]
        self._close_call(body, closed=True, out=out)
        return probe[end + len(END) :]

    def _progress_call(self, text: str, out: list) -> None:
        call = self._call
        if not call.header_sent:
            if len(call.head) >= MAX_HEADER_CHARS:
                return  # no header in reach: the call goes out whole when it closes
            call.head += text[: MAX_HEADER_CHARS - len(call.head)]
            header = _HEADER.match(call.head)
            if header is None:
                return
            call.header_sent = True
            out.append(ToolCallDelta(call.index, call.id, json.loads(f'"{header.group(1)}"')))
            self.num_calls += 1
            text = "".join(call.parts)[header.end() :]  # once per call
        if not call.args_began:  # the header may have matched before the whitespace after its colon
            text = text.lstrip()
            if not text:
                return
            call.args_began, call.args_scalar = True, text[0] not in "{["
        if call.args_done or call.args_scalar:
            return  # a scalar argument value goes out whole, when the call closes
        end = call.scanner.feed(text)
        piece = call.unsent + (text if end is None else text[:end])
        hold = _partial_suffix(piece, END) if end is None else 0  # `</tool_call>` may be coming
        call.unsent = piece[len(piece) - hold :]
        if piece := piece[: len(piece) - hold]:
            out.append(ToolCallDelta(call.index, arguments=piece))
            call.args_sent += len(piece)
        call.args_done = end is not None

    def _close_call(self, body: str, closed: bool, out: list) -> None:
        call, parsed = self._call, decode_call(body)
        self._call, self._mode = None, "after"
        if parsed is None:
            if not call.header_sent and call.gap is not None and not self._forced:  # it was text
                out.append(ContentDelta(call.gap + START + body + (END if closed else "")))
                self._mode = "content"
            elif call.unsent and not closed:  # held back as a possible `</tool_call>`: it was not
                out.append(ToolCallDelta(call.index, arguments=call.unsent))
            return  # a call whose name went out keeps the arguments sent so far
        if not call.header_sent:
            out.append(ToolCallDelta(call.index, call.id, parsed.name))
            self.num_calls += 1
        if rest := parsed.arguments[call.args_sent :]:
            out.append(ToolCallDelta(call.index, arguments=rest))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
