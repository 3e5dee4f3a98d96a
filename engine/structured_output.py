"""Grammar-constrained decoding with xgrammar (JSON mode, JSON schema, regex, EBNF).

The manager owns what is per model (the tokenizer's vocabulary as xgrammar sees it, a compiler and
a cache of compiled grammars); each constrained request owns a `GrammarMatcherState`. Before
sampling, the engine asks the states for a bitmask of allowed next tokens and applies it to the
logits rows; after sampling it feeds the chosen token back with `accept_token`. Once the grammar
is complete xgrammar only allows stop tokens; accepting one terminates the matcher.

A client's grammar can cost exponential time to check, build and compile; the serving path does
that work in a bounded worker process (`raylane.engine.grammar_compiler`) and passes the result here as
`StructuredOutputParams.compiled`, so the engine loop only deserializes it. Constructing the
params with `check=False` skips the (unbounded) check for a caller that runs `validate()` there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import xgrammar as xgr

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_FIELDS = ("json_object", "json_schema", "regex", "grammar")
MAX_GRAMMAR_CHARS = 128 * 1024  # a schema, regex or grammar text; real ones are a few KiB
# xgrammar errors start with "[hh:mm:ss] /path/file.cc:123: "; clients need only the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _clean(err: Exception) -> str:
    return _XGR_PREFIX.sub("", str(err).strip())


@dataclass(slots=True)
class StructuredOutputParams:
    """Exactly one constraint. Validated on construction (no tokenizer needed), so the gateway can
    reject a bad request with a 400 before it reaches a replica."""

    json_object: bool = False  # any JSON object
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None  # EBNF (GBNF dialect), root rule `root`
    whitespace_flexible: bool = True  # JSON: allow any whitespace; False = compact `,` and `:`
    check: bool = field(default=True, repr=False, compare=False)  # False: the caller runs validate()
    # xgrammar's serialized CompiledGrammar for the engine's tokenizer (raylane.engine.grammar_compiler)
    compiled: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured: exactly one of {', '.join(_FIELDS)} must be set, got {chosen or 'none'}"
            )
        kind = chosen[0]
        if kind == "json_schema":
            self.json_schema = _parse_schema(self.json_schema)
        elif not isinstance(getattr(self, kind), bool if kind == "json_object" else str):
            raise ValueError(f"structured.{kind}: wrong type {type(getattr(self, kind)).__name__}")
        if (size := len(self._text())) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured.{kind}: too large: {size} characters, at most {MAX_GRAMMAR_CHARS}")
        if self.check:
            self.validate()

    def validate(self) -> xgr.Grammar:
        """Check the schema and build (not compile) the grammar, tokenizer-independent; ValueError
        naming the field. Quick for real grammars, unbounded for hostile ones (see the module doc)."""
        kind = self.kind
        if kind == "json_schema":
            _check_schema(self.json_schema)
        try:
            return self._to_grammar()
        except RuntimeError as e:
            raise ValueError(f"structured.{kind}: {_clean(e)}") from None

    @property
    def kind(self) -> str:
        return next(f for f in _FIELDS if getattr(self, f) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """Cache key: a 16-byte digest of the grammar's text, so the caches hold no client text."""
        digest = hashlib.blake2b(self._text().encode("utf-8", "surrogatepass"), digest_size=16)
        return self.kind, digest.hexdigest(), self.whitespace_flexible

    def _text(self) -> str:
        """The grammar as text. Schema key order is kept: it fixes the order properties are generated in."""
        value = getattr(self, self.kind)
        return json.dumps(value, separators=(",", ":")) if self.kind == "json_schema" else str(value)

    def _json_args(self) -> dict[str, Any]:
        return {"any_whitespace": self.whitespace_flexible} | (
            {} if self.whitespace_flexible else {"separators": (",", ":")}
        )

    def _to_grammar(self) -> xgr.Grammar:
        kind = self.kind
        if kind == "json_object":
            # strict_mode=False: otherwise {"type": "object"} would only allow `{}`.
            return _json_grammar('{"type":"object"}', strict_mode=False, **self._json_args())
        if kind == "json_schema":
            return _json_grammar(json.dumps(self.json_schema), **self._json_args())
        if kind == "regex":
            return xgr.Grammar.from_regex(self.regex)
        return xgr.Grammar.from_ebnf(self.grammar)


# xgrammar 0.2.x string character classes are looser than JSON text: strings with minLength/maxLength
# use `[^"\\\r\n]`, which admits raw control characters that strict parsers reject (mlc-ai/xgrammar#800),
# and every class admits UTF-8-encoded surrogates (ED A0..BF xx), which decode to three U+FFFD and
# break maxLength. Tighten both in the printed grammar; if its form ever changes, nothing is replaced.
_JSON_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"
_LOOSE_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")


def tighten_json_strings(ebnf: str) -> str:
    """An xgrammar EBNF text with its JSON string character classes restricted to valid JSON text."""
    for loose in _LOOSE_CHARS:
        ebnf = ebnf.replace(loose, _JSON_CHAR)
    return ebnf


def _json_grammar(schema: str, **kwargs: Any) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(schema, **kwargs)
    text = str(grammar)
    patched = tighten_json_strings(text)
    if patched == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(patched)
    except RuntimeError:  # printed grammar did not parse back: keep the (slightly loose) original
        return grammar


def _parse_schema(schema: Any) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured.json_schema: not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured.json_schema: must be a JSON object, got {type(schema).__name__}")
    return schema


def _check_schema(schema: dict[str, Any]) -> None:
    try:  # jsonschema (a Ray dependency) gives clearer messages than xgrammar for bad keywords
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"structured.json_schema: {e.message}") from None


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
            raise ValueError(f"structured.{params.kind}: {_clean(e)}") from None
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
