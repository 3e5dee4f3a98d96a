"""What a request's output must match: one of JSON mode, a JSON schema, a regex or an EBNF grammar.

Validated on construction, without a tokenizer, so the gateway can answer a bad request with a 400
before it reaches a replica. A client's grammar can cost exponential time to check, build and
compile; the serving path does that work in a bounded worker process
(`raylane.engine.grammar_compiler`) and passes the result as `StructuredOutputParams.compiled`, so
the engine loop only deserializes it. Constructing the params with `check=False` skips the
(unbounded) check for a caller that runs `validate()` there.

xgrammar (which imports torch) is imported by the check only: the gateway builds these params for
every request and imports neither (deployments/gateway/core.py checks grammars in its worker).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

_FIELDS = ("json_object", "json_schema", "regex", "grammar")
MAX_GRAMMAR_CHARS = 128 * 1024  # a schema, regex or grammar text; real ones are a few KiB
# xgrammar errors start with "[hh:mm:ss] /path/file.cc:123: "; clients need only the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def clean_xgrammar_error(err: Exception) -> str:
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
            raise ValueError(f"structured.{kind}: {clean_xgrammar_error(e)}") from None

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
        import xgrammar as xgr

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
    import xgrammar as xgr

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
