"""Errors that reach a client, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`OpenAIError` is raised anywhere in the gateway or a pool and travels between them (it pickles);
the gateway turns it into a JSON response with its status. Other failures become a 5xx of the same
shape, never a bare 500.

Ownership: an `OpenAIError` with a 4xx status is the client's (`is_client_error`). A pool yields it
as its first item or raises it; raised, it crosses the Serve handle inside Ray's `RayTaskError`
(an instance of both, with the original as `.cause`), and `client_error()` finds it either way.
The gateway answers it as it is: never retried on another pool, never counted by a circuit
breaker or a pool's error metrics.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from raylane.deployments.protocol.openai_schemas import MESSAGE_ROLES


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 429 from a pool's busy queue)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        wait = max(1.0, self.retry_after)
        return {"retry-after": str(math.ceil(wait)), "retry-after-ms": str(round(wait * 1000))}

    @property
    def is_client_error(self) -> bool:
        return 400 <= self.status < 500

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # keyword-only arguments: the default Exception pickling would lose them
        return (_restore, (self.message, self.status, self.type, self.param, self.code, self.retry_after))


def _restore(message, status, type, param, code, retry_after=None) -> OpenAIError:
    return OpenAIError(message, status=status, type=type, param=param, code=code, retry_after=retry_after)


def cause_of(error: BaseException) -> BaseException:
    """The exception a pool raised, unwrapped from Ray's `RayTaskError` where it crossed a handle."""
    from ray.exceptions import RayTaskError

    if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error


def client_error(error: BaseException) -> OpenAIError | None:
    """The client's error (a 4xx `OpenAIError`) that `error` is or carries, else None."""
    cause = cause_of(error)
    return cause if isinstance(cause, OpenAIError) and cause.is_client_error else None


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "internal_server_error" if status == 500 else "service_unavailable_error"
    return "invalid_request_error"


def invalid(param: str | None, message: str, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(message, status=400, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist or you do not have access to it.",
        status=404,
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def internal_error(message: str = "The server had an error while processing your request.") -> OpenAIError:
    return OpenAIError(message, status=500, code="internal_error")


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(message, status=503, code="service_unavailable")


# -- pydantic validation -> one 400 naming the parameter ---------------------------------------------

_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
}


_UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _is_union_member(part: str) -> bool:
    """pydantic names the union member an error is about in `loc`: 'str', 'list[ContentPart]',
    'function-after[...]', 'NamedToolChoice'. Field names here are lowercase words."""
    return part in _UNION_MEMBER_TAGS or "[" in part or part[:1].isupper() or part.startswith("function-")


def param_path(loc: tuple) -> str | None:
    """('messages', 0, 'user', 'content', 'str') -> 'messages[0].content' (union tags dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i > 0 and isinstance(loc[i - 1], int) and part in MESSAGE_ROLES:
            continue  # the discriminated union's tag, not a field
        elif _is_union_member(part):
            continue
        else:
            part = str(part) if len(str(part)) <= SHOWN_INPUT_CHARS else f"{str(part)[:SHOWN_INPUT_CHARS]}..."
            out += f".{part}" if out else part  # a client's key, cut: an unknown 1 MB field name
    return out or None


def from_validation_error(error: ValidationError) -> OpenAIError:
    errors = error.errors(include_url=False)
    # Of the errors about the first bad field, the deepest: for a union (a string or a list of parts)
    # that is the member the client meant, e.g. the image part inside a list, not "not a string".
    first = errors[0]["loc"][:1]
    err = max((e for e in errors if e["loc"][:1] == first), key=lambda e: len(param_path(e["loc"]) or ""))
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        loc = (*loc, "role" if loc[:1] == ("messages",) else "type")
    param = param_path(loc)
    if kind == "extra_forbidden":
        return invalid(param, f"Unrecognized request argument supplied: {param}", _CODES[kind])
    if kind == "missing":
        return invalid(param, f"Missing required parameter: '{param}'.", _CODES[kind])
    message = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {_shown(got)})"
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return invalid(param, f"Invalid '{param}': {message}{shown}.", code)


SHOWN_INPUT_CHARS = 80  # of a wrong value quoted back: the client knows the rest, the logs need none of it


def _shown(value: Any) -> str:
    """A wrong value as the error quotes it: its repr, cut short when the client sent a long one."""
    text = repr(value)
    if len(text) <= SHOWN_INPUT_CHARS:
        return text
    size = f", {len(value)} characters" if isinstance(value, str) else ""
    return f"{text[:SHOWN_INPUT_CHARS]}...{size}"


def from_engine_value_error(error: ValueError, rename: dict[str, str] | None = None) -> OpenAIError:
    """The engine's ValueErrors start with the field they are about ('prompt: ...', 'top_p must ...')."""
    text = str(error)
    head = text.split(":", 1)[0].split(" ", 1)[0].split(".", 1)[0]
    rename = rename or {}
    param = rename.get(head, head) if head.isidentifier() else None
    return invalid(param, text)
