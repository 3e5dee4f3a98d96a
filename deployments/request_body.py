"""Reading a request's JSON body within limits, before any of it is parsed.

A client decides how much it sends and how deeply it nests it, so both are bounded here, each with a
4xx in OpenAI's shape: a body over `gateway.max_request_body_bytes` is a 413, refused on its
Content-Length before a byte is read, or, sent chunked without one, as soon as the bytes read pass
the limit (the rest is never read). JSON nested deeper than `MAX_JSON_DEPTH` is a 400: Python's
decoder and the validators after it recurse per level and would otherwise fail with RecursionError
(a 500) on a few kilobytes of brackets. Text that is not Unicode is a 400 naming where it is: JSON's
`\\ud800` escapes decode to lone UTF-16 surrogates, which no tokenizer can encode (the HF tokenizers
are Rust and take UTF-8: they raise TypeError on them, and would fail the request in every pool).
Tested against the shipped tokenizer: NUL, other control characters, noncharacters, BOMs and
unassigned code points all encode; lone surrogates are the only text they refuse.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from deployments.errors import OpenAIError, from_validation_error, invalid

MAX_JSON_DEPTH = 64  # real tool schemas nest a dozen levels; json.loads itself gives up near 1000
BYTES_PER_TOKEN = 4  # English text in BPE vocabularies: about 4 bytes a token


def body_too_large(max_bytes: int, got: int | None = None) -> OpenAIError:
    size = f" (got {got} bytes)" if got is not None else ""
    return OpenAIError(
        f"The request body is too large: this server accepts at most {max_bytes} bytes{size}.",
        status=413,
        code="request_too_large",
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to be longer than `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes, int(declared))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:  # chunked (or lying about its length): stop reading here
            raise body_too_large(max_bytes)
    return bytes(body)


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    return json_object(await read_body(request, max_bytes))


def estimate_tokens(body: bytes) -> int:
    """The tokens a body's text is charged up front, before it is parsed: its length in bytes over
    `BYTES_PER_TOKEN` (its JSON punctuation counts too: linear in the bytes, and never free)."""
    return -(-len(body) // BYTES_PER_TOKEN)


def json_object(body: bytes) -> dict[str, Any]:
    """A body read within its limit, parsed: a JSON object, not nested too deep, valid Unicode."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(
            f"We could not parse the JSON body of your request: {e}. (The body must be valid JSON.)",
            param=None,
            code="invalid_json",
        ) from None
    except RecursionError:
        raise too_deep() from None
    if not isinstance(data, dict):
        raise invalid(None, "The request body must be a JSON object.", code="invalid_json")
    if nesting_depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise too_deep()
    if (where := unencodable_text(data)) is not None:
        raise invalid(
            where or None,
            f"Invalid '{where or 'body'}': the text holds a lone UTF-16 surrogate (an unpaired "
            "\\ud800-\\udfff escape), which is not Unicode text and cannot be tokenized.",
            code="invalid_encoding",
        )
    return data


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    """The body as `model`, or a 4xx naming what is wrong (size and nesting first, then the JSON)."""
    return validate_body(await read_json_object(request, max_bytes), model)


def validate_body(data: dict[str, Any], model: type[BaseModel]) -> Any:
    """A parsed body as `model`, or a 400 naming the first wrong parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def unencodable_text(value: Any) -> str | None:
    """Where the first string (value or key) that UTF-8 cannot encode is, as `messages[0].content`
    ('' for the value itself); None when every string is valid Unicode. Iterative, like
    `nesting_depth`, and cheap for ASCII."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                where = f"{path}.{key}" if path else str(key)
                if not _encodable(key):
                    return path or where.encode("utf-8", "backslashreplace").decode()
                stack.append((child, where))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def too_deep() -> OpenAIError:
    return invalid(
        None, f"The JSON body is nested too deeply: at most {MAX_JSON_DEPTH} levels.", code="invalid_json"
    )


def nesting_depth(value: Any, stop_above: int) -> int:
    """Levels of objects and arrays in `value` (a scalar is 0), counted without recursion; stops
    early once past `stop_above`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_above:
            return deepest
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest
