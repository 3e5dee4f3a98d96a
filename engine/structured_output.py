"""Grammar-constrained decoding with xgrammar (JSON mode, JSON schema, regex, EBNF).

The manager owns what is per model (the tokenizer's vocabulary as xgrammar sees it, a compiler and
a cache of compiled grammars); each constrained request owns a `GrammarMatcherState`. Before
sampling, the engine asks the states for a bitmask of allowed next tokens and applies it to the
logits rows; after sampling it feeds the chosen token back with `accept_token`. Once the grammar
is complete xgrammar only allows stop tokens; accepting one terminates the matcher. What a request
asks for is a `StructuredOutputParams` (engine/structured_params.py).
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr

from raylane.engine.structured_params import StructuredOutputParams, clean_xgrammar_error

_HAS_TRITON = importlib.util.find_spec("triton") is not None


class GrammarMatcherState:
    """One request's position in its grammar."""

    __slots__ = ("manager", "matcher", "num_accepted")

    def __init__(self, manager: StructuredOutputManager, compiled: xgr.CompiledGrammar) -> None:
        self.manager = manager
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=manager.stop_token_ids)
        self.num_accepted = 0  # tokens accepted since the last reset (what rollback can undo)

    def apply_mask(self, logits_row: torch.Tensor) -> None:
        """Set disallowed tokens of one `[V]` logits row to -inf, in place."""
        self.manager.apply_masks(logits_row.unsqueeze(0), [0], [self])

    def accept_token(self, token_id: int) -> bool:
        ok = self.matcher.accept_token(int(token_id))
        self.num_accepted += ok
        return ok

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """The output so far is a full match; only a stop token is allowed next."""
        return self.matcher.is_completed()

    def rollback(self, n: int) -> None:
        n = min(n, self.num_accepted)
        if n > 0:
            self.matcher.rollback(n)
            self.num_accepted -= n

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0


class StructuredOutputManager:
    """Per-model: vocabulary info, compiler, compiled-grammar cache, reusable bitmask buffer.
    Not thread-safe (the bitmask buffer is shared): call it from the engine's step loop only.
    `stop_token_ids` defaults to the tokenizer's eos; pass all of the model's eos ids."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
        max_threads: int = min(8, os.cpu_count() or 1),
        cache_size: int = 256,
    ) -> None:
        # vocab_size is the logits width: ids the tokenizer lacks (padding) are always disallowed.
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.stop_token_ids: list[int] = list(self.tokenizer_info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self._cache: OrderedDict[tuple[str, str, bool], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        # Mask for a terminated matcher (it cannot fill one): only stop tokens.
        words = [0] * self._bitmask.shape[1]
        for t in (t for t in self.stop_token_ids if t < vocab_size):
            words[t // 32] |= 1 << (t % 32)
        self._stop_only = torch.tensor(
            [w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")  # half the cores

    def compile(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        key = params.key()
        if (hit := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return hit
        try:
            if params.compiled is not None:  # compiled (and bounded) off this loop
                compiled = xgr.CompiledGrammar.deserialize_json(params.compiled, self.tokenizer_info)
            else:
                compiled = self.compiler.compile_grammar(params._to_grammar())
        except RuntimeError as e:
            raise ValueError(f"structured.{params.kind}: {clean_xgrammar_error(e)}") from None
        self._cache[key] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, params: StructuredOutputParams) -> GrammarMatcherState:
        return GrammarMatcherState(self, self.compile(params))

    def apply_masks(self, logits: torch.Tensor, rows: list[int], states: list[GrammarMatcherState]) -> None:
        """Mask `logits[rows[i]]` by `states[i]` in one kernel call; other rows stay untouched."""
        if not rows:
            return
        batch = logits.shape[0]
        if self._bitmask.shape[0] < batch:
            self._bitmask = xgr.allocate_token_bitmask(batch, self.vocab_size)
        bitmask = self._bitmask[:batch]
        live: list[tuple[int, xgr.GrammarMatcher]] = []
        for r, s in zip(rows, states, strict=True):
            if s.is_terminated():
                bitmask[r] = self._stop_only
            else:
                live.append((r, s.matcher))
        if len(live) == 1:
            live[0][1].fill_next_token_bitmask(bitmask, live[0][0])
        elif live:  # fills rows on xgrammar's thread pool
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask, [r for r, _ in live])
        backend = "cpu"
        if logits.device.type != "cpu":
            # Pageable source: the copy has read the buffer before returning, so reuse is safe.
            bitmask = bitmask.to(logits.device, non_blocking=True)
            backend = "triton" if _HAS_TRITON and logits.device.type == "cuda" else "torch_native"
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=list(rows), backend=backend
        )
