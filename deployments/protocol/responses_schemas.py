"""OpenAI's Responses API bodies (`POST /v1/responses`) as pydantic models.

The request is checked as strictly as chat's: unknown fields are refused by name, and the fields
OpenAI defines that a self-hosted server cannot honour (`UNSUPPORTED`: background mode, hosted
conversations, prompt templates, ...) are refused by name too, with `unsupported_parameter`. Input
items may be the SDK's own output items echoed back (`input += response.output`): messages with
`output_text` parts, `function_call` items and `reasoning` items (whose text the model does not need
again, as with OpenAI's hosted reasoning models) are all accepted.

The response object and its output items are built with these models too, dumped with the same
rules as chat's (`_Response`): OpenAI's nulls are set explicitly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from raylane.deployments.protocol.openai_schemas import (
    MAX_MESSAGES,
    NAME_PATTERN,
    Identifier,
    Metadata,
    Name,
    StructuredOutputs,
    _Lenient,
    _Request,
    _Response,
)

# OpenAI's fields that raylane refuses when set (to anything but their "off" value).
UNSUPPORTED = ("background", "conversation", "prompt", "include", "max_tool_calls", "top_logprobs")


# -- input -------------------------------------------------------------------------------------------


class InputText(_Lenient):
    # `output_text` (assistant turns echoed back) and `refusal` carry text too.
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @property
    def value(self) -> str:
        return self.text if self.text is not None else self.refusal or ""


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallInput(_Lenient):
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: str
    id: Name | None = None


class FunctionCallOutputInput(_Lenient):
    type: Literal["function_call_output"]
    call_id: Name
    output: str | list[InputText]


class ReasoningInput(_Lenient):
    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return item.get("type", "message")  # OpenAI's "easy" messages have no type
    return getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
    | Annotated[ReasoningInput, Tag("reasoning")],
    Discriminator(_item_type),
]


# -- tools and formats -----------------------------------------------------------------------------


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Lenient):
    type: Literal["function"]
    name: Name


class FormatText(_Lenient):
    type: Literal["text"]


class FormatJsonObject(_Lenient):
    type: Literal["json_object"]


class FormatJsonSchema(_Lenient):
    type: Literal["json_schema"]
    name: str = Field(pattern=NAME_PATTERN)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# -- request ---------------------------------------------------------------------------------------


class ResponsesRequest(_Request):
    model: str
    input: str | list[InputItem] = Field(min_length=1, max_length=MAX_MESSAGES)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate here
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns silently: refused
    metadata: Metadata | None = None
    user: Identifier | None = None
    # Accepted and ignored, as in chat.
    service_tier: Identifier | None = None
    prompt_cache_key: Identifier | None = None
    safety_identifier: Identifier | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension, as in chat (extra_body)
    # OpenAI's, refused by name when set (see UNSUPPORTED).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


# -- response --------------------------------------------------------------------------------------


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(_Response):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # no explicit prompt caching here


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | dict[str, Any] | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: str | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


class ResponseDeleted(_Response):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class ResponseStreamEvent(_Response):
    """One server-sent event of a streamed response (its SSE `event:` is its `type`); the other
    fields depend on the type, as OpenAI documents them (`response.output_text.delta`, ...)."""

    type: str
    sequence_number: int
