"""OpenAI's request and response bodies (chat, completions, embeddings, models, errors) as pydantic models.

Requests reject unknown top-level fields, as OpenAI does ("Unrecognized request argument"); nested
objects (messages, tools) ignore unknown keys, because SDKs echo assistant messages back with extra
fields (refusal, annotations, audio). A few vLLM extensions that clients pass through `extra_body`
are accepted: top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, structured_outputs, chat_template_kwargs, prompt_logprobs.

Responses are dumped with `exclude_unset=True`: a field whose default is null appears only when the
builder sets it (to null where OpenAI shows a null), so stream deltas carry only what changed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# Bounds on what a client may send (besides the body size, `gateway.max_request_body_bytes`): OpenAI's
# own where it publishes one (messages), else generous ones that keep per-token work bounded.
MAX_MESSAGES = 2048
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256  # characters: the detokenizer holds back text that may begin a stop string
MAX_STOP_TOKEN_IDS = 256
# vLLM's `prompt_logprobs`: top-k per prompt token, capped as vLLM's default `max_logprobs` (and chat's
# `top_logprobs`) caps it. Each prompt token then costs a top-k and k decoded strings in the response.
MAX_PROMPT_LOGPROBS = 20
# Fields that identify rather than say something: an end user, a cache key, a tier. A client's value
# is kept in logs, maps and stored responses, so it is bounded like a name, not like a prompt.
MAX_IDENTIFIER_CHARS = 512
MAX_NAME_CHARS = 256  # names and ids echoed back in messages (tool call names, ids): generous
# OpenAI's published bounds on `metadata`.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# `apply_chat_template`'s own arguments: `chat_template_kwargs` may set the template's variables
# (enable_thinking, ...) but not these. A template sent by a client would run in the pool replica
# (an endless loop in it blocks the replica; vLLM refuses one unless trusted), and the others would
# change how the prompt is built (sanitize_control_tokens=False lets message text become special tokens).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def template_variables_only(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` that set only the template's variables (RESERVED_TEMPLATE_KWARGS)."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
    if reserved:
        raise ValueError(f"may set the chat template's variables only, not {', '.join(reserved)}")
    return kwargs


def _bounded_metadata(value: Any) -> Any:
    """OpenAI's `metadata`: at most 16 pairs, string keys of 64 characters, string values of 512.
    The count is checked first, so a million pairs cost one comparison."""
    if not isinstance(value, dict):
        return value  # the dict type check after this names it
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"keys must be strings of at most {MAX_METADATA_KEY_CHARS} characters")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters")
    return value


Metadata = Annotated[dict[str, str], BeforeValidator(_bounded_metadata)]
Identifier = Annotated[str, Field(max_length=MAX_IDENTIFIER_CHARS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _show_defaults(self):
        """Fields with a non-null default (`object`, `type`, counts) always appear; null ones when set."""
        for name, info in type(self).model_fields.items():
            if info.default is not None or info.default_factory is not None:
                self.__pydantic_fields_set__.add(name)
        return self

    def to_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)


# -- messages --------------------------------------------------------------------------------------


class ContentPart(_Lenient):
    # Published as the one type served; validated below, so the error names the unsupported type.
    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            served = "only text content parts are supported (the models served take text)"
            raise ValueError(f"{served}, got {self.type!r}")
        if self.text is None:
            raise ValueError("a text content part needs `text`")
        return self


Content = str | list[ContentPart]


class FunctionCall(_Lenient):
    name: Name
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Lenient):
    role: Literal["system", "developer"]
    content: Content
    name: Name | None = None


class UserMessage(_Lenient):
    role: Literal["user"]
    content: Content
    name: Name | None = None


class AssistantMessage(_Lenient):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    name: Name | None = None


class ToolMessage(_Lenient):
    role: Literal["tool"]
    content: Content
    tool_call_id: Name


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


# -- tools and formats -----------------------------------------------------------------------------


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Lenient):
    name: Name


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(_Lenient):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Lenient):
    type: Literal["text"]


class ResponseFormatJsonObject(_Lenient):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Lenient):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StreamOptions(_Lenient):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk (with include_usage)


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extension: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = Field(None, min_length=1)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        chosen = [k for k in ("json_", "regex", "grammar", "choice") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError("set exactly one of json, regex, grammar, choice")
        return self


# -- requests --------------------------------------------------------------------------------------


class SamplingRequest(_Request):
    """Fields that chat and completions share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Identifier | None = None
    # Accepted and ignored, as a self-hosted server does (prompt_cache_key names an `auto` conversation).
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Identifier | None = None
    prompt_cache_key: Identifier | None = None
    safety_identifier: Identifier | None = None
    # vLLM extensions (extra_body).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_LENGTH} characters long")
        return stops


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables_only(kwargs)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt alone (vLLM; lm-eval sends it)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# What the gateway embeds: texts, or token-id arrays in the embedding model's own vocabulary.
_EMBEDDING_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
EmbeddingInput = Annotated[
    str | list[str] | list[int] | list[list[int]],
    WithJsonSchema(
        {
            "anyOf": [
                _EMBEDDING_TEXT,
                {"type": "array", "items": _EMBEDDING_TEXT, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]
        }
    ),
]


class EmbeddingRequest(_Request):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: Identifier | None = None


# -- responses -------------------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with a reasoning parser


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCallOut(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut | None = None


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking, with a reasoning parser (vLLM's field)
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class PromptLogprob(_Response):
    """vLLM's `prompt_logprobs` entry (its `Logprob`), keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per prompt token, None for the first (it has no context): vLLM's `prompt_logprobs`.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with `prompt_logprobs` asked for


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension (whole responses only, as vLLM)


class Completion(_Response):
    """Also the shape of each streamed completions chunk, as in OpenAI."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Embedding(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "raylane"
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorBody
