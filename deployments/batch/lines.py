"""A batch's input file, read and checked, and the lines of its output and error files, in OpenAI's
formats: an input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, and a
line that never got a response `{..., "response": null, "error": {"code", "message"}}`.

A line's url may be any of the endpoints a batch serves, whatever the batch's own `endpoint` (OpenAI
requires them to match): a file may mix chat and completions lines."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from raylane.config.batch import BATCH_ENDPOINTS

MAX_CUSTOM_ID = 512  # characters: it is echoed in every output line
MAX_ERRORS = 100  # validation errors reported for one file (the first ones)


@dataclass(frozen=True, slots=True)
class InputLine:
    number: int  # 1-based, as OpenAI's validation errors count lines
    custom_id: str
    url: str  # the endpoint that serves it
    body: bytes  # the request body, as JSON
    prefix: str  # the model and the head of the prompt, to send lines sharing a prefix together


@dataclass(slots=True)
class InputFile:
    lines: list[InputLine]  # what runs
    rejected: list[tuple[int, str, str, str]]  # (line number, custom_id or "", code, message)
    errors: list[dict]  # what makes the whole file unusable: OpenAI's `errors.data` items


PREFIX_CHARS = 4096  # of a line's prompt (as JSON) that its place in the order depends on


def dispatch_order(lines: list[InputLine]) -> list[InputLine]:
    """`lines` in the order to send them: sorted by model and prompt, so that lines sharing a prompt
    prefix of any length (a system prompt, few-shot examples) are neighbours, run together, and the
    pool's prefix cache computes the shared part once."""
    return sorted(lines, key=lambda line: (line.prefix, line.number))


def read_input(content: bytes, max_lines: int, max_body_bytes: int) -> InputFile:
    """The requests of an input file, the lines that cannot be sent (each becomes a line of the
    error file; the others run), and what makes the whole file unusable (the batch fails)."""
    read = InputFile([], [], [])

    def fail(code: str, message: str, number: int | None = None, param: str | None = None) -> None:
        if len(read.errors) < MAX_ERRORS:
            read.errors.append({"code": code, "message": message, "param": param, "line": number})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        fail("invalid_file", f"The file is not UTF-8 text (byte {e.start}).")
        return read
    seen: set[str] = set()
    count = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        count += 1
        if count > max_lines:
            fail("too_many_lines", f"A batch may hold at most {max_lines} requests.", number)
            break
        line, problem = read_line(raw, number, max_body_bytes)
        custom_id = line.custom_id if line is not None else problem[0]
        if custom_id in seen:
            fail(
                "duplicate_custom_id", f"custom_id {custom_id!r} appears more than once.", number, "custom_id"
            )
            continue
        if custom_id:
            seen.add(custom_id)
        if line is not None:
            read.lines.append(line)
        else:
            read.rejected.append((number, *problem))
    if not count:
        fail("empty_file", "The file holds no request.")
    return read


def read_line(raw: str, number: int, max_body_bytes: int) -> tuple[InputLine | None, tuple[str, str, str]]:
    """One input line: (the request, _) or (None, (custom_id or "", error code, message))."""
    try:
        item = json.loads(raw)
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
    encoded = json.dumps(body, ensure_ascii=False).encode()
    if len(encoded) > max_body_bytes:
        return None, (custom_id, "invalid_body", f"body is larger than {max_body_bytes} bytes.")
    prompt = body.get("messages", body.get("prompt", body.get("input")))
    head = json.dumps(prompt, ensure_ascii=False)[:PREFIX_CHARS]
    return InputLine(number, custom_id, url, encoded, f"{body.get('model')}\n{head}"), ("", "", "")


def output_line(custom_id: str, status_code: int, body: Any) -> dict:
    request_id = f"req_{uuid.uuid4().hex}"
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


def error_line(custom_id: str, code: str, message: str) -> dict:
    error = {"code": code, "message": message}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": error}


def add_usage(total: dict[str, int], body: Any) -> None:
    """Add a response body's token usage (chat, completions, embeddings or Responses) to `total`
    (`input_tokens`, `output_tokens`, `total_tokens`, as a batch's `usage` counts them)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    total["input_tokens"] += prompt
    total["output_tokens"] += completion
    total["total_tokens"] += prompt + completion
