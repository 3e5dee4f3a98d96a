"""vLLM's `/tokenize` and `/detokenize` bodies, so clients written for vLLM work unchanged.

A tokenize request is vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest`
(`messages`, rendered with the pool's chat template); `model` picks the pool, as in every raylane
endpoint. Unknown fields are refused, as in the OpenAI endpoints.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from raylane.deployments.protocol.openai_schemas import (
    MAX_MESSAGES,
    ChatMessage,
    Tool,
    _Request,
    _Response,
    template_variables_only,
)

# Token ids a detokenize request may carry: bounded like a prompt (the body limit bounds it too).
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeCompletionRequest(_Request):
    model: str
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables_only(kwargs)

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


TokenizeRequest = TokenizeChatRequest | TokenizeCompletionRequest


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(_Response):
    prompt: str


def tokenize_request_model(data: dict) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """Which of vLLM's two tokenize requests a body is: `messages` makes it the chat one (as vLLM's
    union does), so an error names the fields of the request the client meant."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
