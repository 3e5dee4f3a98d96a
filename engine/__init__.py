"""One replica's inference engine (vLLM-shaped): `LLM` offline, `AsyncLLM` for serving.

The names load on first use (PEP 562): a serving process that imports `raylane.engine.async_llm` with an
engine core process does not import the model, the runner and their torch/transformers modules,
which only the core process runs (a replica restarts faster without them).
"""

import importlib

_EXPORTS = {
    "LLM": "raylane.engine.llm",
    "AsyncLLM": "raylane.engine.async_llm",
    "EngineConfig": "raylane.config",
    "EngineDeadError": "raylane.engine.errors",
    "InsufficientResourcesError": "raylane.engine.errors",
    "LLMEngine": "raylane.engine.llm_engine",
    "SamplingParams": "raylane.engine.sampling_params",
    "RequestOutput": "raylane.engine.outputs",
    "RequestOutputKind": "raylane.engine.sampling_params",
    "Resumption": "raylane.engine.request",
    "CompletionOutput": "raylane.engine.outputs",
    "Logprob": "raylane.engine.outputs",
    "LoRARequest": "raylane.engine.lora",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
