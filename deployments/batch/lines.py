"""A batch's input file, read and checked, and the lines of its output and error files, in OpenAI's
formats: an input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, and a
line that never got a response `{..., "response": null, "error": {"code", "message"}}`.

A line's url may be any of the endpoints a batch serves, whatever the batch's own `endpoint` (OpenAI
requires them to match): a file may mix chat and completions lines.

The file is read from disk a line at a time (JSONL: lines end at "\\n" only; U+2028 and its kin are
text inside a JSON string), and what a running batch keeps of a line is a `LineRef`: its number,
custom_id and place in the file, never its body, which is read again when the line is sent. So a
64 MiB input costs the batch actor its line index while the batch runs, not its bytes.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import BinaryIO

from raylane.config.batch import BATCH_ENDPOINTS
from raylane.deployments.protocol.batch_answers import LineUsage

MAX_CUSTOM_ID = 512  # characters: it is echoed in every output line
MAX_ERRORS = 100  # validation errors reported for one file (the first ones)
PREFIX_CHARS = 4096  # of a line's prompt (as JSON) that its place in the order depends on
# Characters JSON keeps raw inside strings that `str.splitlines()` (and JavaScript) take for line
# ends: an output line holding one would read as two to a client splitting the file that way.
LINE_BREAKS_IN_TEXT = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_ESCAPES = str.maketrans(LINE_BREAKS_IN_TEXT)


@dataclass(frozen=True, slots=True)
class LineCaps:
    """What one line may ask for (`batch.max_line_n`, `batch.max_line_tokens`)."""

    max_body_bytes: int
    max_n: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class InputLine:
    number: int  # 1-based, as OpenAI's validation errors count lines
    custom_id: str
    url: str  # the endpoint that serves it
    body: bytes  # the request body, as JSON
    prefix: str  # the model and the head of the prompt, to send lines sharing a prefix together


@dataclass(frozen=True, slots=True)
class LineRef:
    """What a running batch keeps of a line it has to send: where to read it again."""

    number: int
    custom_id: str
    url: str  # one of BATCH_ENDPOINTS (the constant itself: not a copy per line)
    offset: int  # of its first byte in the input file
    length: int  # its bytes, without the line end


@dataclass(slots=True)
class InputFile:
    lines: list[LineRef] = field(default_factory=list)  # what runs, in the order to send it
    rejected: list[tuple[int, str, str, str]] = field(default_factory=list)  # (number, custom_id, code, msg)
    errors: list[dict] = field(default_factory=list)  # what makes the whole file unusable


def read_input(
    source: BinaryIO | bytes, max_lines: int, max_body_bytes: int, caps: LineCaps | None = None
) -> InputFile:
    """The requests of an input file, the lines that cannot be sent (each becomes a line of the
    error file; the others run), and what makes the whole file unusable (the batch fails). The
    lines come in the order to send them: sorted by model and prompt, so that lines sharing a prompt
    prefix of any length (a system prompt, few-shot examples) are neighbours, run together, and the
    pool's prefix cache computes the shared part once."""
    caps = caps or LineCaps(max_body_bytes)
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    read = InputFile()

    def fail(code: str, message: str, number: int | None = None, param: str | None = None) -> None:
        if len(read.errors) < MAX_ERRORS:
            read.errors.append({"code": code, "message": message, "param": param, "line": number})

    seen: set[str] = set()
    order: list[tuple[str, int, LineRef]] = []
    count = offset = 0
    for number, raw in enumerate(source, start=1):  # a binary file splits at b"\n" only
        start, offset = offset, offset + len(raw)
        raw = raw.rstrip(b"\r\n")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            fail("invalid_file", f"The file is not UTF-8 text (byte {start + e.start}).", number)
            return InputFile(errors=read.errors)
        if not text.strip():
            continue
        count += 1
        if count > max_lines:
            fail("too_many_lines", f"A batch may hold at most {max_lines} requests.", number)
            break
        line, problem = read_line(text, number, caps)
        custom_id = line.custom_id if line is not None else problem[0]
        if custom_id in seen:
            fail(
                "duplicate_custom_id", f"custom_id {custom_id!r} appears more than once.", number, "custom_id"
            )
            continue
        if custom_id:
            seen.add(custom_id)
        if line is not None:
            url = BATCH_ENDPOINTS[BATCH_ENDPOINTS.index(line.url)]
            order.append((line.prefix, number, LineRef(number, custom_id, url, start, len(raw))))
        else:
            read.rejected.append((number, *problem))
    if not count:
        fail("empty_file", "The file holds no request.")
    order.sort(key=lambda item: item[:2])
    read.lines = [ref for _, _, ref in order]  # the prefixes go: only the order is kept
    return read


def load_line(fd: int, ref: LineRef, caps: LineCaps) -> tuple[InputLine | None, tuple[str, str, str]]:
    """Line `ref` read again from its input file (open as `fd`: read at its offset, so lines may be
    read from several threads at once), as `read_line` gives it."""
    text = os.pread(fd, ref.length, ref.offset).decode("utf-8", errors="replace")
    return read_line(text, ref.number, caps)


def read_line(raw: str, number: int, caps: LineCaps | int) -> tuple[InputLine | None, tuple[str, str, str]]:
    """One input line: (the request, _) or (None, (custom_id or "", error code, message)). `caps`:
    what a line may ask for (an int: only the largest body)."""
    if isinstance(caps, int):
        caps = LineCaps(caps)
    try:
        item = json.loads(raw)
    except RecursionError:  # nested past Python's recursion limit: this line's fault, not the file's
        return None, ("", "invalid_json_line", "The line is nested too deeply to read.")
    except ValueError:
        item = None
    if not isinstance(item, dict):
        return None, ("", "invalid_json_line", "The line is not a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return None, (
            "",
            "invalid_custom_id",
            f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters.",
        )
    if item.get("method") != "POST":
        return None, (custom_id, "invalid_method", "method must be 'POST'.")
    url = item.get("url")
    if url not in BATCH_ENDPOINTS:
        return None, (custom_id, "invalid_url", f"url must be one of {list(BATCH_ENDPOINTS)}.")
    body = item.get("body")
    if not isinstance(body, dict):
        return None, (custom_id, "invalid_body", "body must be a JSON object.")
    if body.get("stream"):
        return None, (custom_id, "invalid_body", "A batch request cannot stream (body.stream).")
    if (problem := over_caps(body, caps)) is not None:
        return None, (custom_id, *problem)
    body = with_token_cap(url, body, caps)
    try:
        encoded = json.dumps(body, ensure_ascii=False).encode()
    except RecursionError:
        return None, (custom_id, "invalid_body", "body is nested too deeply.")
    if len(encoded) > caps.max_body_bytes:
        return None, (custom_id, "invalid_body", f"body is larger than {caps.max_body_bytes} bytes.")
    prompt = body.get("messages", body.get("prompt", body.get("input")))
    head = json.dumps(prompt, ensure_ascii=False)[:PREFIX_CHARS]
    return InputLine(number, custom_id, url, encoded, f"{body.get('model')}\n{head}"), ("", "", "")


def over_caps(body: dict, caps: LineCaps) -> tuple[str, str] | None:
    """(code, message) when a line asks for more choices or tokens than a batch line may."""
    n = body.get("n", 1)
    prompts = body.get("prompt")
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
        n = n * len(prompts) if isinstance(n, int) else n  # each prompt is its own sequences
    if caps.max_n is not None and isinstance(n, int) and n > caps.max_n:
        return "too_many_choices", (
            f"A batch line may ask for at most {caps.max_n} choices (batch.max_line_n); "
            f"this one asks for {n} (n x prompts)."
        )
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if caps.max_tokens is not None and isinstance(value, int) and value > caps.max_tokens:
            return "max_tokens_too_large", (
                f"A batch line may ask for at most {caps.max_tokens} tokens (batch.max_line_tokens); "
                f"body.{name} is {value}."
            )
    return None


# The field each generation endpoint reads its limit from, as OpenAI names it today.
TOKEN_LIMIT_FIELD = {
    "/v1/chat/completions": "max_completion_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def with_token_cap(url: str, body: dict, caps: LineCaps) -> dict:
    """`body` with `batch.max_line_tokens` as its limit when it sets none: such a line would
    otherwise generate up to the pool's context, past the cap a line that names a limit is held to.
    (A completions line that leaves `max_tokens` out has OpenAI's default, 16; an explicit null is
    no limit, and gets the cap.)"""
    name = TOKEN_LIMIT_FIELD.get(url)
    if name is None or caps.max_tokens is None:
        return body
    if any(
        body.get(field) is not None for field in ("max_tokens", "max_completion_tokens", "max_output_tokens")
    ):
        return body
    if url == "/v1/completions" and "max_tokens" not in body:
        return body
    return {**body, name: caps.max_tokens}


def output_record_text(custom_id: str, status_code: int, body: str) -> str:
    """An output line as it is stored and written (OpenAI's batch output format), around a body that
    is the gateway's own JSON, not parsed: an embeddings line's body is megabytes of floats, and
    reading and writing them again cost the batch actor ~0.3 s a line at serving's priority."""
    if "\n" in body or "\r" in body:  # between its tokens (JSON keeps none raw in a string)
        body = body.replace("\r", " ").replace("\n", " ")
    line_id, request_id = f"batch_req_{uuid.uuid4().hex}", f"req_{uuid.uuid4().hex}"
    custom_id = json.dumps(custom_id, ensure_ascii=False)
    response = f'{{"status_code": {int(status_code)}, "request_id": "{request_id}", "body": {body}}}'
    return (
        f'{{"id": "{line_id}", "custom_id": {custom_id}, "response": {response}, "error": null}}'
    ).translate(_ESCAPES)


def error_line(custom_id: str, code: str, message: str) -> dict:
    error = {"code": code, "message": message}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": error}


def record_text(record: dict) -> str:
    """An output or error line as it is stored and written: JSON on one line, whatever splits it."""
    return json.dumps(record, ensure_ascii=False).translate(_ESCAPES)


def add_usage(total: dict[str, int], usage: LineUsage) -> None:
    """Add a line's usage to `total` (`input_tokens`, `output_tokens`, `total_tokens`, as a batch's
    `usage` counts them)."""
    total["input_tokens"] += usage.input_tokens
    total["output_tokens"] += usage.output_tokens
    total["total_tokens"] += usage.input_tokens + usage.output_tokens
