"""`/tokenize` and `/detokenize` on one pool (vLLM's `OpenAIServingTokenization`).

The pool's own tokenizer and chat template answer, so the count is the one the pool's engine will
see for the same prompt or messages (the chat endpoint renders messages with the same function,
`chat_prompt_ids`, control tokens in the messages' text as text unless the pool allows them).
"""

from __future__ import annotations

import functools

from raylane.deployments.pool.chat_prompt import chat_prompt_ids
from raylane.deployments.pool.serving import encode
from raylane.deployments.protocol.errors import invalid
from raylane.deployments.protocol.tokenization_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)


class OpenAIServingTokenization:
    def __init__(
        self, tokenizer, model_id: str, max_model_len: int, sanitize_control_tokens: bool = True
    ) -> None:
        self.tokenizer, self.model_id, self.max_model_len = tokenizer, model_id, max_model_len
        self.sanitize_control_tokens = sanitize_control_tokens

    def tokenize(self, req: TokenizeChatRequest | TokenizeCompletionRequest) -> str:
        if isinstance(req, TokenizeChatRequest):
            ids = self._chat_ids(req)
        else:
            ids = self._encode(req.prompt, "prompt", req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)
        if strs is not None:
            body.token_strs = strs
        return body.to_json()

    def detokenize(self, req: DetokenizeRequest) -> str:
        if len(req.tokens) > self.max_model_len:
            raise invalid(
                "tokens",
                f"At most {self.max_model_len} token ids (the context length), got {len(req.tokens)}.",
            )
        vocab = len(self.tokenizer)
        for i, token in enumerate(req.tokens):
            if token >= vocab:
                raise invalid(
                    f"tokens[{i}]", f"Token id {token} is out of vocabulary (this model has {vocab} tokens)."
                )
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)).to_json()

    def _chat_ids(self, req: TokenizeChatRequest) -> list[int]:
        ids = chat_prompt_ids(
            self.tokenizer,
            self.model_id,
            req.messages,
            [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            req.chat_template_kwargs,
            sanitize_control_tokens=self.sanitize_control_tokens,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        if not req.add_special_tokens:
            return ids
        # The tokenizer's own special tokens (BOS) around the rendered prompt, as vLLM adds them
        # when asked; the prompt's ids stay the sanitized ones.
        before, after = _special_tokens_around(self.tokenizer)
        return [*before, *ids, *after]

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Token ids as the engine gets them (`serving.encode`), with the tokenizer's special tokens
        (BOS) added when asked, as vLLM does."""
        if not add_special_tokens:
            return encode(self.tokenizer, text, param)
        try:
            return self.tokenizer.encode(text, add_special_tokens=True)
        except (TypeError, ValueError, UnicodeError) as e:
            raise invalid(
                param, f"The tokenizer cannot encode the {param}: {e}", "invalid_encoding"
            ) from None


@functools.lru_cache(maxsize=8)
def _special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text (BOS, EOS), found by
    encoding a probe with and without them."""
    bare = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    at = next(i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare)
    return full[:at], full[at + len(bare) :]
