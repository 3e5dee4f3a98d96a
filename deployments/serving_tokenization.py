"""`/tokenize` and `/detokenize` on one pool (vLLM's `OpenAIServingTokenization`).

The pool's own tokenizer and chat template answer, so the count is the one the pool's engine will
see for the same prompt or messages (the chat endpoint renders messages with the same function).
"""

from __future__ import annotations

from deployments.errors import invalid
from deployments.serving import encode
from deployments.serving_chat import render_messages
from deployments.tokenization_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)


class OpenAIServingTokenization:
    def __init__(self, tokenizer, model_id: str, max_model_len: int) -> None:
        self.tokenizer, self.model_id, self.max_model_len = tokenizer, model_id, max_model_len

    def tokenize(self, req: TokenizeChatRequest | TokenizeCompletionRequest) -> str:
        if isinstance(req, TokenizeChatRequest):
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            text = render_messages(
                self.tokenizer,
                self.model_id,
                req.messages,
                tools,
                req.chat_template_kwargs,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
            )
            param = "messages"
        else:
            text, param = req.prompt, "prompt"
        ids = self._encode(text, param, req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)
        if strs is not None:
            body.token_strs = strs
        return body.to_json()

    def detokenize(self, req: DetokenizeRequest) -> str:
        vocab = len(self.tokenizer)
        for i, token in enumerate(req.tokens):
            if token >= vocab:
                raise invalid(
                    f"tokens[{i}]", f"Token id {token} is out of vocabulary (this model has {vocab} tokens)."
                )
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)).to_json()

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
