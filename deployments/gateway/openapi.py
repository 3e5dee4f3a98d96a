"""The gateway's OpenAPI document: request and response bodies from the pydantic models.

The handlers read their bodies themselves (`parse_body`), so that every mistake becomes OpenAI's
error JSON naming the parameter rather than FastAPI's 422; FastAPI therefore sees no body parameter
and would publish none. Each route declares its models with `route_docs` instead, and `publish`
adds the models' JSON schemas (requests as validated, responses as serialized) to the document's
`components`, so clients and generators (schemathesis, SDK generators) see the real shapes.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from raylane.deployments.protocol.batch_schemas import (
    Batch,
    BatchCreateRequest,
    BatchList,
    FileDeleted,
    FileList,
    FileObject,
)
from raylane.deployments.protocol.lora_schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from raylane.deployments.protocol.openai_schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from raylane.deployments.protocol.responses_schemas import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from raylane.deployments.protocol.tokenization_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

Mode = Literal["validation", "serialization"]
REQUESTS = (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    BatchCreateRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
RESPONSES = (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    EmbeddingResponse,
    ModelList,
    ModelCard,
    ErrorResponse,
    TokenizeResponse,
    DetokenizeResponse,
    ResponseObject,
    ResponseStreamEvent,
    ResponseDeleted,
    FileObject,
    FileList,
    FileDeleted,
    Batch,
    BatchList,
)
_PAIRS: list[tuple[type[BaseModel], Mode]] = [(m, "validation") for m in REQUESTS] + [
    (m, "serialization") for m in RESPONSES
]
# One pass over every model, so shared nested models get one component each.
_REFS, _DEFS = models_json_schema(_PAIRS, ref_template="#/components/schemas/{model}")
COMPONENTS: dict[str, Any] = _DEFS.get("$defs", {})


def ref(model: type[BaseModel], mode: Mode) -> dict[str, Any]:
    return dict(_REFS[(model, mode)])


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _json_text(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": ref(model, "serialization"),
    }


def _events(chunk: type[BaseModel]) -> dict[str, Any]:
    """A stream, event by event (OpenAPI 3.1 reads `schema` of text/event-stream as one event's): its
    `data` is a chunk's JSON, an error's (a failure after the first chunk) or the final [DONE]."""
    data = {"anyOf": [{"const": "[DONE]"}, _json_text(chunk), _json_text(ErrorResponse)]}
    if chunk is ResponseStreamEvent:  # the Responses API's typed events: `event` names each, no [DONE]
        data["anyOf"] = data["anyOf"][1:]
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"schema": event, "description": "Server-sent events when `stream` is true"}


def route_docs(
    response: type[BaseModel] | None,
    request: type[BaseModel] | tuple[type[BaseModel], ...] | None = None,
    chunk: type[BaseModel] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for `app.post/get`: the request body (required JSON; one of several models
    when `request` is a tuple), the 200 body (and the `text/event-stream` of `chunk`s when the route
    streams; None: a line of text, as vLLM's adapter endpoints answer) and OpenAI's error body."""
    if response is None:
        ok = {"description": "Success", "content": {"text/plain": {"schema": {"type": "string"}}}}
    else:
        ok = _json(ref(response, "serialization"), "Success")
    if chunk is not None:
        ok["content"]["text/event-stream"] = _events(chunk)
    error = _json(ref(ErrorResponse, "serialization"), "OpenAI's error object naming the problem")
    docs: dict[str, Any] = {"responses": {200: ok, "4XX": error, "5XX": error}}
    if request is not None:
        models = request if isinstance(request, tuple) else (request,)
        schemas = [ref(m, "validation") for m in models]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        docs["openapi_extra"] = {"requestBody": body}
    return docs


def publish(app: FastAPI) -> None:
    """Make `app.openapi()` include the models' schemas (FastAPI builds and caches the rest)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(COMPONENTS)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
