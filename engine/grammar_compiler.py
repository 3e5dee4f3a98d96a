"""A pool's grammar compiles, bounded: in a `BoundedWorker` (raylane/bounded_worker.py), a separate
process, one call at a time, killed past its time limit.

A client's JSON schema, regex or EBNF grammar can cost exponential time to check and compile (a
deeply nested `anyOf`, an enum of long strings: seconds to tens of seconds with the demo
tokenizer). The gateway checks and builds a request's grammar in a worker of its own before any pool
sees it; a pool compiles it here (`GrammarCompileService.prepare`) with the engine's own tokenizer
info and hands the serialized result to the engine in `StructuredOutputParams.compiled`, which the
engine deserializes (bounded by `MAX_COMPILED_BYTES`) instead of compiling.

The bound: `GRAMMAR_TIMEOUT_S` (a pool's `grammar_compile_timeout_s`) of the worker's CPU time per
compile, and the worker's wall-clock and queue bounds; the text itself is at most
`structured_output.MAX_GRAMMAR_CHARS`. `raylane bench grammar-bound` measures what a catastrophic
grammar costs its caller and what the next grammar pays for a fresh worker. A call that finds the
queue full is refused at once with `WorkerBusy` (a 429 with Retry-After), never queued silently.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from raylane.bounded_worker import BoundedWorker, WorkerTimeout

GRAMMAR_TIMEOUT_S = 5.0  # one check or compile, CPU time of one core in the worker
POOL_MAX_PENDING = 64  # a pool's compile worker: the calls of all its gateways
POOL_MAX_PENDING_PER_KEY = 4  # of those, one API key's (the request's tenant)
MAX_FAILED = 256  # grammars remembered as failing (a digest and a short message each)
MAX_FAILURE_CHARS = 300
MAX_COMPILED_BYTES = 2 * 1024 * 1024  # serialized compiled grammar the engine loop may deserialize

# What a pool's compile workers import (a gateway's check workers import
# raylane.deployments.protocol.sampling).
COMPILE_PRELOAD = ("raylane.engine.structured_output",)
logger = logging.getLogger(__name__)


class GrammarTooComplex(ValueError):
    """A client's grammar that took too long to compile, or compiled too large (the client's 400)."""


# -- compiling for one model's engine ----------------------------------------------------------------

_compiler = None  # the worker's xgrammar GrammarCompiler, for the model whose tokenizer info it got


def _init_compiler(tokenizer_info_json: str) -> None:
    global _compiler
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    _compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_serialized(params) -> str:
    """In the worker: check, build and compile `params` (a `StructuredOutputParams`); the compiled
    grammar as xgrammar's JSON."""
    from raylane.engine.structured_params import clean_xgrammar_error

    grammar = params.validate()
    try:
        compiled = _compiler.compile_grammar(grammar)
    except RuntimeError as e:
        raise ValueError(f"structured.{params.kind}: {clean_xgrammar_error(e)}") from None
    return compiled.serialize_json()


def tokenizer_info_json(engine) -> str:
    """Run in the engine (`AsyncLLM.run_in_engine`): its grammar tokenizer info, serialized."""
    return engine.structured_output.tokenizer_info.serialize_json()


class GrammarCompileService:
    """A pool's bounded compiler: the engine's tokenizer info (fetched once), a worker, and an LRU of
    compiled grammars by their cache key, so a schema used again costs nothing here."""

    def __init__(self, fetch_tokenizer_info, timeout_s: float = GRAMMAR_TIMEOUT_S, cache_size: int = 64):
        self._fetch = fetch_tokenizer_info  # async () -> str
        self.timeout_s = timeout_s
        self._worker: BoundedWorker | None = None
        self._cache: OrderedDict[tuple, str] = OrderedDict()
        self._cache_size = cache_size
        # grammar digest -> (the error's class, its message cut short): a failing grammar sent again
        # is refused without the worker (whoever sends it), and the cache holds no client text whole.
        self._failed: OrderedDict[tuple, tuple[type[ValueError], str]] = OrderedDict()

    async def prepare(self, params, tenant: str = "") -> None:
        """Set `params.compiled` (a `StructuredOutputParams`); ValueError naming `structured.<kind>`
        when it does not compile, is too large, or takes longer than the limit; WorkerBusy when
        `POOL_MAX_PENDING` compiles are queued already, or `POOL_MAX_PENDING_PER_KEY` of `tenant`'s
        (the caller's API key). A compile that runs out its time holds one of the key's places
        for as long again."""
        key = params.key()
        if (failed := self._failed.get(key)) is not None:
            self._failed.move_to_end(key)
            raise failed[0](failed[1])
        try:
            self._keep(params, key, await self._compiled(params, key, tenant))
        except ValueError as e:
            self._failed[key] = (type(e), str(e)[:MAX_FAILURE_CHARS])
            if len(self._failed) > MAX_FAILED:
                self._failed.popitem(last=False)
            raise

    def _keep(self, params, key: tuple, compiled: str) -> None:
        self._cache[key] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        params.compiled = compiled

    async def _compiled(self, params, key: tuple, tenant: str) -> str:
        if (hit := self._cache.get(key)) is None:
            if self._worker is None:
                info = await self._fetch()
                if self._worker is None:  # another request may have made it meanwhile
                    self._worker = BoundedWorker(
                        _init_compiler,
                        (info,),
                        timeout_s=self.timeout_s,
                        preload=COMPILE_PRELOAD,
                        max_pending=POOL_MAX_PENDING,
                        max_pending_per_key=POOL_MAX_PENDING_PER_KEY,
                    )
            try:
                hit = await self._worker.run(compile_serialized, params, key=tenant)
            except WorkerTimeout:
                self._worker.hold(tenant, self.timeout_s)
                raise GrammarTooComplex(
                    f"structured.{params.kind}: too complex: it did not compile within {self.timeout_s:g} s"
                ) from None
            if len(hit) > MAX_COMPILED_BYTES:
                raise GrammarTooComplex(
                    f"structured.{params.kind}: too large: it compiles to {len(hit)} bytes, "
                    f"at most {MAX_COMPILED_BYTES}"
                )
        return hit

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
