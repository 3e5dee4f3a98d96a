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

Parsing, the walks and validation cost time linear in the body, which the client chose: a body over
`INLINE_BODY_BYTES` is parsed and validated in a thread (`asyncio.to_thread`), so the gateway's event
loop keeps streaming to others meanwhile (the walks are Python and yield the GIL as they go; the C
decoder and pydantic's validator hold it, a few milliseconds a MiB). Small bodies, nearly all of
them, are parsed inline, where a thread hop would cost more than the parse.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from raylane.deployments.protocol.errors import OpenAIError, from_validation_error, invalid

MAX_JSON_DEPTH = 64  # real tool schemas nest a dozen levels; json.loads itself gives up near 1000
INLINE_BODY_BYTES = 64 * 1024  # larger bodies are parsed and validated off the event loop
T = TypeVar("T")
try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: nothing to tune
    _libc = None
M_MMAP_THRESHOLD = -3  # mallopt(3)
MMAP_THRESHOLD_BYTES = 256 * 1024


def return_large_buffers() -> None:
    """Blocks of 256 KiB and more (request bodies) get their own mapping, given back to the system
    when freed. glibc's default raises that threshold to the largest block freed so far (up to 32
    MiB), after which such blocks come from the heap, which keeps its pages. (Measured once against
    test_noisy_neighbour's gateway growth: within its run-to-run spread.)"""
    if _libc is not None:
        _libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


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
    """The body as a JSON object, checked (depth, Unicode), or a 4xx naming what is wrong."""
    body = await read_body(request, max_bytes)
    return await off_the_loop_if_large(body, lambda: parse_json_object(body))


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    """The body as `model`, or a 4xx naming what is wrong (size and nesting first, then the JSON)."""
    return await parse_bytes(await read_body(request, max_bytes), model)


async def parse_bytes(body: bytes, model: type[BaseModel]) -> Any:
    """A body already read (and bounded: `read_body`) as `model`, or a 400 naming what is wrong."""
    return await off_the_loop_if_large(body, lambda: validate_body(parse_json_object(body), model))


async def off_the_loop_if_large(body: bytes, work: Callable[[], T]) -> T:
    """`work()` (parsing `body`): inline for a small body, in a thread for a large one."""
    if len(body) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(work)
    return work()


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A request body parsed as a JSON object within the depth limit, all of its text Unicode."""
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


def validate_body(data: dict[str, Any], model: type[BaseModel]) -> Any:
    """A parsed body as `model`, or a 400 naming the first wrong parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def unencodable_text(value: Any) -> str | None:
    """Where the first string (value or key, in document order) that UTF-8 cannot encode is, as
    `messages[0].content` ('' for the value itself); None when every string is valid Unicode.

    Depth first without recursion, like `nesting_depth`: the path is the stack of keys and indices
    being walked, turned into a string only for the one wrong element, so a million-element array
    costs a million checks and no strings. Cheap for ASCII."""
    if not isinstance(value, dict | list):
        return None if not isinstance(value, str) or _encodable(value) else ""
    path: list[str | int] = [0]
    walks = [_children(value)]
    while walks:
        for key, child in walks[-1]:
            path[-1] = key
            if isinstance(key, str) and not _encodable(key):  # a bad key: name the object holding it
                where = _path_text(path[:-1])
                return where or key.encode("utf-8", "backslashreplace").decode()
            if isinstance(child, str):
                if not _encodable(child):
                    return _path_text(path)
            elif isinstance(child, dict | list):
                walks.append(_children(child))
                path.append(0)
                break
        else:  # this container is done
            walks.pop()
            path.pop()
    return None


def _children(container: dict | list):
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


def _path_text(path: list[str | int]) -> str:
    """`["messages", 0, "content"]` -> `messages[0].content`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text


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
