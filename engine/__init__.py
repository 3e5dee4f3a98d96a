"""One replica's inference engine (vLLM-shaped): `LLM` offline, `AsyncLLM` for serving.

The names load on first use (PEP 562): a serving process that imports `engine.async_llm` with an
engine core process does not import the model, the runner and their torch/transformers modules,
which only the core process runs (a replica restarts faster without them).
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLM": "engine.async_llm",
    "EngineConfig": "cluster.config",
    "EngineDeadError": "engine.errors",
    "InsufficientResourcesError": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "Resumption": "engine.request",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
