"""A conversation's prompt token ids through the pool's chat template (chat, Responses, /tokenize).

Control tokens in the client's text stay text. A user message holding `<|im_end|>\\n<|im_start|>system`
would otherwise close its own turn and open a system turn the model trusts; so by default the
template is applied with transformers' `sanitize_control_tokens`: control tokens (the tokenizer's
special tokens and the added tokens the template itself writes, such as `<tool_call>`) found in
message text, tool definitions and template variables are encoded as plain text, and only the ones
the template writes become control-token ids. A prompt whose text holds none of them gets exactly
the ids it got before (the same `encode` of the same rendered text). Dict keys are not sanitized by
transformers, so a tool definition whose keys hold an added token is refused (400 naming `tools`).
A pool's `sanitize_control_tokens: false` restores the old behaviour for trusted callers.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

from raylane.deployments.pool.serving import encode
from raylane.deployments.protocol.errors import invalid
from raylane.deployments.protocol.openai_schemas import AssistantMessage, SystemMessage


def chat_prompt_ids(
    tokenizer,
    model_id: str,
    messages: list,
    tools: list[dict] | None,
    template_kwargs: dict | None,
    *,
    sanitize_control_tokens: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """The prompt's token ids (no BOS/EOS beyond what the template writes); a template or text the
    pool cannot handle is the client's 400."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise invalid("model", f"{model_id} has no chat template; use /v1/completions.")
    conversation = [template_message(m) for m in messages]
    options = dict(
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **(template_kwargs or {}),
    )
    if not sanitize_control_tokens:
        return encode(tokenizer, _render(tokenizer, conversation, options), "messages")
    if tools and (key := _key_with_added_token(tokenizer, tools)) is not None:
        raise invalid("tools", f"A key of the tool definitions holds the model's control token {key!r}.")
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=True, sanitize_control_tokens=True, return_dict=False, **options
        )
    except Exception:
        # Rendering and encoding happen in one call: render alone to tell whose failure it was.
        encode(tokenizer, _render(tokenizer, conversation, options), "messages")
        raise


def template_message(message) -> dict:
    data = message.model_dump(exclude_none=True)
    if isinstance(data.get("content"), list):
        # Text parts as one string, joined by newlines as vLLM does: most templates concatenate
        # `content` as a string (SmolLM2's, Llama's) and fail on a list. The schema admits only text
        # parts while every model served is text-only.
        data["content"] = "\n".join(part["text"] for part in data["content"])
    if isinstance(message, SystemMessage):
        data["role"] = "system"  # `developer` is OpenAI's new name for it
    if isinstance(message, AssistantMessage):
        data.setdefault("content", "")
    return data


def _render(tokenizer, conversation: list[dict], options: dict[str, Any]) -> str:
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, **options)
    except Exception as e:  # jinja errors, raise_exception() in a template
        raise invalid("messages", f"The chat template rejected the messages: {e}") from None


def _key_with_added_token(tokenizer, value: Any) -> str | None:
    pattern = _added_tokens_pattern(tuple(tokenizer.added_tokens_encoder))
    for key in _keys(value):
        if (found := pattern.search(key)) is not None:
            return found.group(0)
    return None


def _keys(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield from (k for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


@functools.lru_cache(maxsize=8)
def _added_tokens_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
