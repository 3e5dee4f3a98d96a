"""One replica's inference engine (vLLM-shaped): `LLM` offline, `AsyncLLM` for serving."""

from cluster.config import EngineConfig
from engine.async_llm import AsyncLLM
from engine.errors import EngineDeadError, InsufficientResourcesError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request import Resumption
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "EngineDeadError",
    "InsufficientResourcesError",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "RequestOutputKind",
    "Resumption",
    "CompletionOutput",
    "Logprob",
]
