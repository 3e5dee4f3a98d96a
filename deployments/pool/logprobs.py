"""The engine's logprob entries (`raylane.engine.outputs.Logprob` dicts) in the API's shapes: chat's
`logprobs.content`, the legacy completions `logprobs` (with the echoed prompt's tokens first), and
vLLM's `prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from raylane.deployments.pool.serving import token_text
from raylane.deployments.protocol.openai_schemas import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from raylane.engine.outputs import CompletionOutput, Logprob
from raylane.engine.outputs import PromptLogprobs as EnginePromptLogprobs

# JSON has no -inf: a token the model rules out entirely is reported at vLLM's and OpenAI's floor.
LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob] | None],
    k: int,
    offset: int,
    decode: Callable[[int], str],
) -> CompletionLogprobs:
    """OpenAI's legacy `logprobs` of `token_ids` (prompt tokens, when echoed, then generated ones),
    their text offsets counted from `offset` over the tokens' strings. Each token's `top_logprobs` is
    its entry's k likeliest and the token itself (OpenAI: "up to logprobs + 1 elements"). A token
    without an entry (the prompt's first: it has no context) has null logprobs; `decode` gives its
    text."""
    logprobs = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(token_id) if entry is not None else None
        token = token_text(chosen.decoded_token) if chosen is not None else decode(token_id)
        logprobs.tokens.append(token)
        logprobs.text_offset.append(offset)
        offset += len(token)
        if chosen is None:
            logprobs.token_logprobs.append(None)
            logprobs.top_logprobs.append(None)
            continue
        top = sorted(entry.items(), key=lambda item: -item[1].logprob)[:k]
        if token_id not in dict(top):
            top.append((token_id, chosen))
        logprobs.token_logprobs.append(_value(chosen.logprob))
        logprobs.top_logprobs.append({token_text(lp.decoded_token): _value(lp.logprob) for _, lp in top})
    return logprobs


def output_logprobs(
    comp: CompletionOutput, k: int | None, offset: int, decode: Callable[[int], str]
) -> CompletionLogprobs | None:
    """The legacy `logprobs` of a choice's generated tokens (None when not asked for)."""
    if k is None or comp.logprobs is None:
        return None
    return completion_logprobs(comp.token_ids, comp.logprobs, k, offset, decode)


def joined(first: CompletionLogprobs | None, then: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Legacy `logprobs` one after the other (the echoed prompt's, then the completion's)."""
    if first is None or then is None:
        return first or then
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def vllm_prompt_logprobs(prompt_logprobs: EnginePromptLogprobs) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` field: per prompt token, token id -> {logprob, rank, decoded_token}."""
    return [
        None
        if entry is None
        else {
            tid: PromptLogprob(logprob=_value(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def chat_logprobs(comp: CompletionOutput, k: int | None) -> ChoiceLogprobs | None:
    """Chat's `logprobs.content` of a choice's tokens: each with its `top_logprobs`, the k likeliest."""
    if k is None or comp.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(comp.token_ids, comp.logprobs, strict=False):
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
        sampled = entry[token_id]
        content.append(
            TokenLogprob(
                token=token_text(sampled.decoded_token),
                logprob=sampled.logprob,
                bytes=list(token_text(sampled.decoded_token).encode()),
                top_logprobs=[
                    TopLogprob(
                        token=token_text(lp.decoded_token),
                        logprob=lp.logprob,
                        bytes=list(token_text(lp.decoded_token).encode()),
                    )
                    for _, lp in top
                ],
            )
        )
    return ChoiceLogprobs(content=content, refusal=None)
