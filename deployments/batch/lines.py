"""A batch's input file, read and checked, and the lines of its output and error files, in OpenAI's
formats: an input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, and a
line that never got a response `{..., "response": null, "error": {"code", "message"}}`."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

MAX_CUSTOM_ID = 512  # characters: it is echoed in every output line
MAX_ERRORS = 100  # validation errors reported for one file (the first ones)


@dataclass(frozen=True, slots=True)
class InputLine:
    number: int  # 1-based, as OpenAI's validation errors count lines
    custom_id: str
    body: bytes  # the request body, as JSON
    prefix: str  # the model and the head of the prompt, to send lines sharing a prefix together


PREFIX_CHARS = 4096  # of a line's prompt (as JSON) that its place in the order depends on


def dispatch_order(lines: list[InputLine]) -> list[InputLine]:
    """`lines` in the order to send them: sorted by model and prompt, so that lines sharing a prompt
    prefix of any length (a system prompt, few-shot examples) are neighbours, run together, and the
    pool's prefix cache computes the shared part once."""
    return sorted(lines, key=lambda line: (line.prefix, line.number))


def read_input(
    content: bytes, endpoint: str, max_lines: int, max_body_bytes: int
) -> tuple[list[InputLine], list[dict]]:
    """The requests of an input file, and what is wrong with it (OpenAI's `errors.data` items:
    `code`, `message`, `param`, `line`); a file with any error runs nothing."""
    lines: list[InputLine] = []
    errors: list[dict] = []
    seen: set[str] = set()

    def error(code: str, message: str, number: int | None = None, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        error("invalid_file", f"The file is not UTF-8 text (byte {e.start}).")
        return [], errors
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) >= max_lines:
            error("too_many_lines", f"A batch may hold at most {max_lines} requests.", number)
            break
        try:
            item = json.loads(raw)
        except ValueError:
            error("invalid_json_line", "The line is not a JSON object.", number)
            continue
        if not isinstance(item, dict):
            error("invalid_json_line", "The line is not a JSON object.", number)
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            error(
                "invalid_custom_id",
                f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters.",
                number,
                "custom_id",
            )
            continue
        if custom_id in seen:
            error(
                "duplicate_custom_id", f"custom_id {custom_id!r} appears more than once.", number, "custom_id"
            )
            continue
        seen.add(custom_id)
        if item.get("method") != "POST":
            error("invalid_method", "method must be 'POST'.", number, "method")
            continue
        if item.get("url") != endpoint:
            error("mismatched_endpoint", f"url must be the batch's endpoint {endpoint!r}.", number, "url")
            continue
        body = item.get("body")
        if not isinstance(body, dict):
            error("invalid_body", "body must be a JSON object.", number, "body")
            continue
        if body.get("stream"):
            error("invalid_body", "A batch request cannot stream.", number, "body.stream")
            continue
        encoded = json.dumps(body, ensure_ascii=False).encode()
        if len(encoded) > max_body_bytes:
            error("invalid_body", f"body is larger than {max_body_bytes} bytes.", number, "body")
            continue
        prompt = body.get("messages", body.get("prompt", body.get("input")))
        head = json.dumps(prompt, ensure_ascii=False)[:PREFIX_CHARS]
        lines.append(InputLine(number, custom_id, encoded, f"{body.get('model')}\n{head}"))
    if not lines and not errors:
        error("empty_file", "The file holds no request.")
    return lines, errors


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
