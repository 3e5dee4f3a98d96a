"""What the gateway's `run_batch_line` answers the batch actor about a line beyond the line's own
result: the line's token usage, counted where the result was made (so the actor never parses a
result of megabytes to count it), and OpenAI errors with codes both sides know: the key may no
longer run batches (the batch stops), the key's batch tokens/min are spent (the line waits, never
counted as a failed try), the result is larger than a line may make (that line's error)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from raylane.config import TierConfig
from raylane.config.batch import BatchConfig
from raylane.deployments.protocol.errors import OpenAIError

KEY_REVOKED = "api_key_revoked"
BATCHES_NOT_ALLOWED = "batches_not_allowed"
BUDGET_EXCEEDED = "batch_tokens_per_minute_exceeded"
LINE_TOO_LARGE = "line_result_too_large"
UPLOAD_RATE_EXCEEDED = "upload_rate_exceeded"  # an upload past its key's bytes a minute
STOPS_BATCH = (KEY_REVOKED, BATCHES_NOT_ALLOWED)


class LineUsage(NamedTuple):
    """A line's tokens as a batch's `usage` counts them."""

    input_tokens: int = 0
    output_tokens: int = 0


NO_USAGE = LineUsage()


def usage_of(body: Any) -> LineUsage:
    """The usage of a response body (chat, completions, embeddings or Responses; a dict or its JSON
    text); none for an error or a body without one."""
    if isinstance(body, str | bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return LineUsage()
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return LineUsage()
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return LineUsage(int(prompt), int(completion))


def batch_key_refused(tier: TierConfig | None) -> OpenAIError:
    """For a key gone from the config (or its Secret), or whose tier no longer allows batches."""
    if tier is None:
        message = "The API key that made this batch is no longer valid."
        return OpenAIError(message, status=403, code=KEY_REVOKED)
    message = f"The tier '{tier.name}' of the API key that made this batch no longer allows batches."
    return OpenAIError(message, status=403, code=BATCHES_NOT_ALLOWED)


def batch_budget_exceeded(error: Exception) -> OpenAIError:
    message = f"This API key's batch lines are over its tier's batch_tokens_per_minute: {error}"
    return OpenAIError(message, status=429, code=BUDGET_EXCEEDED)


def line_too_large(size: int, config: BatchConfig, at_least: bool = False) -> OpenAIError:
    """`at_least`: the result was stopped once `size` bytes of it passed the cap."""
    limit = config.max_line_result_bytes
    return OpenAIError(
        f"The line's result is {'at least ' if at_least else ''}{size} bytes, more than a batch line may "
        f"make ({limit}, batch.max_line_result_bytes).",
        status=413,
        code=LINE_TOO_LARGE,
    )
