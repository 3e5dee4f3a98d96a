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
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_WS_TAIL = re.compile(r"\s*$")


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

    from engine.structured_output import tighten_json_strings

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
    except json.JSONDecodeError:
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
        except json.JSONDecodeError:
            pass
    return ParsedToolCall(
        obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    )


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a finished text: the stream parser run once, so a response carries exactly
    what its stream would have. Content is the text before the first call (None if empty); text
    that is not valid markup stays content; a call cut short (max_tokens) keeps its partial arguments."""
    parser = ToolCallStreamParser()
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
        return text, []
    return content or None, list(calls.values())


# -- parsing a stream --------------------------------------------------------------------------------


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None  # set on a call's first delta
    arguments: str = ""


@dataclass(slots=True)
class _Call:
    index: int
    id: str = field(default_factory=new_call_id)
    header_sent: bool = False
    args_start: int = 0
    args_sent: int = 0
    args_done: bool = False
    gap: str | None = None  # whitespace before `<tool_call>` in content (None: after an earlier call)


class ToolCallStreamParser:
    """Feed text deltas; get content and tool-call deltas back, as OpenAI streams them.

    Content is emitted as it comes, except a tail that may begin `<tool_call>` (and whitespace right
    before it). Inside a call, the name goes out once it is complete, then the arguments' JSON text
    as it grows; the closing brace of the call object is never part of them."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "content"  # content | call | after
        self._call: _Call | None = None
        self.num_calls = 0

    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        self._buf += text
        out: list[ContentDelta | ToolCallDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        """The text ended: release what was held back, close a call the model did not close."""
        out: list[ContentDelta | ToolCallDelta] = []
        if self._mode == "content" and self._buf:
            out.append(ContentDelta(self._buf))
        elif self._mode == "call":
            self._close_call(self._buf, closed=False, out=out)
        self._buf = ""
        return out

    def _step(self, out: list) -> bool:
        """Consume what can be consumed; True if another pass may consume more."""
        if self._mode == "call":
            end = self._buf.find(END)
            if end < 0:
                self._progress_call(out)
                return False
            body, self._buf = self._buf[:end], self._buf[end + len(END) :]
            self._close_call(body, closed=True, out=out)
            return True
        start = self._buf.find(START)
        if start >= 0:
            before = self._buf[:start]
            if self._mode == "content" and (kept := before.rstrip()):
                out.append(ContentDelta(kept))
            gap = before[len(before.rstrip()) :] if self._mode == "content" else None
            self._buf, self._mode = self._buf[start + len(START) :], "call"
            self._call = _Call(index=self.num_calls, gap=gap)
            return True
        hold = _held_back(self._buf)
        if self._mode == "content" and len(self._buf) > hold:
            out.append(ContentDelta(self._buf[: len(self._buf) - hold]))
        self._buf = self._buf[len(self._buf) - hold :]  # text between or after calls is dropped
        return False

    def _progress_call(self, out: list) -> None:
        call = self._call
        if not call.header_sent:
            header = _HEADER.match(self._buf)
            if header is None:
                return
            call.header_sent, call.args_start = True, header.end()
            out.append(ToolCallDelta(call.index, call.id, json.loads(f'"{header.group(1)}"')))
            self.num_calls += 1
        raw = self._buf[call.args_start :]
        if call.args_sent == 0:  # the header may have matched before the whitespace after its colon
            blank = len(raw) - len(raw.lstrip())
            call.args_start, raw = call.args_start + blank, raw[blank:]
        if call.args_done or not raw or raw[0] not in "{[":
            return  # a scalar argument value goes out whole, when the call closes
        end = json_value_end(raw)
        upto = len(raw) if end is None else end
        if upto > call.args_sent:
            out.append(ToolCallDelta(call.index, arguments=raw[call.args_sent : upto]))
            call.args_sent = upto
        call.args_done = end is not None

    def _close_call(self, body: str, closed: bool, out: list) -> None:
        call, parsed = self._call, decode_call(body)
        self._call, self._mode = None, "after"
        if parsed is None:
            if not call.header_sent and call.gap is not None:  # not a call after all: it was text
                out.append(ContentDelta(call.gap + START + body + (END if closed else "")))
                self._mode = "content"
            return  # a call whose name went out keeps the arguments sent so far
        if not call.header_sent:
            out.append(ToolCallDelta(call.index, call.id, parsed.name))
            self.num_calls += 1
        if rest := parsed.arguments[call.args_sent :]:
            out.append(ToolCallDelta(call.index, arguments=rest))


def _held_back(text: str) -> int:
    """Length of the tail that may begin a tool call: a prefix of START, with whitespace before it."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n + len(_WS_TAIL.search(text[:-n]).group(0))
    return len(_WS_TAIL.search(text).group(0))


def json_value_end(text: str) -> int | None:
    """Index just past the JSON object/array that `text` starts with; None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
