"""A Responses request as the chat request the pools serve, in the gateway.

`/v1/responses` goes through the same path as `/v1/chat/completions` (router, tiers, admission,
fallback, the pool's chat template, tool-call grammar and parsing, structured output): this module
turns `instructions` + the previous response's conversation + `input` items into chat messages, and
`text.format`, `tools`, `tool_choice`, `max_output_tokens` into their chat names. A mistake found on
the chat side is renamed back to the Responses parameter the client sent.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import ValidationError

from raylane.deployments.protocol.errors import OpenAIError, from_validation_error, invalid
from raylane.deployments.protocol.openai_schemas import ChatCompletionRequest
from raylane.deployments.protocol.responses_schemas import (
    UNSUPPORTED,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallInput,
    FunctionCallOutputInput,
    InputMessage,
    InputText,
    ResponseObject,
    ResponsesRequest,
    ToolChoiceFunction,
)

# Chat parameter -> the Responses parameter the client wrote (longest prefix first).
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def check_supported(req: ResponsesRequest) -> None:
    for name in UNSUPPORTED:
        value = getattr(req, name)
        if value is not None and value is not False and value != []:
            raise invalid(name, f"'{name}' is not supported by this server.", code="unsupported_parameter")


def to_messages(items: str | list, role: str = "user") -> list[dict[str, Any]]:
    """Chat messages of Responses input items (or of a response's output items, which are input items
    too). Consecutive function calls become one assistant message's `tool_calls`, joined to the
    assistant text just before them, as a chat template expects them."""
    if isinstance(items, str):
        return [{"role": role, "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallInput):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputInput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        # reasoning items: the model's earlier thinking is not sent to it again
    return messages


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.value for part in content)


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves `req`, after the conversation `history` (a previous response's
    messages, without its instructions: OpenAI does not carry instructions over)."""
    messages = [{"role": "developer", "content": req.instructions}] if req.instructions else []
    messages += history + to_messages(req.input)
    if not messages:
        raise invalid("input", "The input holds no message to answer.")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": bool(req.stream),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, ToolChoiceFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJsonObject):
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, FormatJsonSchema):
        spec = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if req.structured_outputs is not None:
        body["structured_outputs"] = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    if req.reasoning is not None and req.reasoning.effort is not None:
        # Templates read one of these: Qwen3's enable_thinking, gpt-oss's reasoning_effort.
        effort = req.reasoning.effort
        body["chat_template_kwargs"] = {"enable_thinking": effort != "none", "reasoning_effort": effort}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise responses_error(from_validation_error(e)) from None


def responses_error(error: OpenAIError) -> OpenAIError:
    """A chat-side error, with its parameter and message in the Responses request's names."""
    if error.param is None:
        return error
    for chat, responses in _RENAMES:
        if error.param == chat or error.param.startswith(chat + ".") or error.param.startswith(chat + "["):
            param = responses + error.param[len(chat) :]
            message = error.message.replace(error.param, param).replace(f"'{chat}'", f"'{responses}'")
            return OpenAIError(message, status=error.status, type=error.type, param=param, code=error.code)
    return error


def echo(req: ResponsesRequest, response_id: str, previous: str | None) -> dict[str, Any]:
    """The request's fields that the response object repeats (the pool adds output, usage, status)."""
    body = ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        model=req.model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        previous_response_id=previous,
        reasoning=req.reasoning,
        store=req.store is not False,
        temperature=req.temperature if req.temperature is not None else 1.0,
        top_p=req.top_p if req.top_p is not None else 1.0,
        text=req.text.model_dump(by_alias=True, exclude_none=True)
        if req.text
        else {"format": {"type": "text"}},
        tools=req.tools or [],
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        metadata=req.metadata or {},
        user=req.user,
    )
    data = body.model_dump(mode="json", exclude_unset=True, by_alias=True)
    for null in ("error", "incomplete_details", "usage", "instructions", "max_output_tokens",
                 "previous_response_id", "reasoning", "user"):  # fmt: skip
        data.setdefault(null, None)
    return data
