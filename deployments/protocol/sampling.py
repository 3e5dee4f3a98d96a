"""OpenAI request fields -> the engine's `SamplingParams`, checked in the gateway.

Everything a client can get wrong is found here, before a pool is involved, and reported as a 400
naming the parameter: ranges the schema cannot express, combinations (top_logprobs without
logprobs), unsupported features, bad JSON schemas and tool definitions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from raylane.deployments.protocol.errors import from_engine_value_error, invalid
from raylane.deployments.protocol.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingRequest,
)
from raylane.deployments.protocol.tool_calls import tool_call_grammar
from raylane.engine.sampling_params import SamplingParams
from raylane.engine.structured_params import StructuredOutputParams


@dataclass(slots=True)
class ToolPlan:
    """What to do about tools: which to show the model, whether to parse its calls, how to finish."""

    mode: str = "none"  # none | auto | required | named
    tools: list[dict] | None = None  # OpenAI tool objects for the chat template
    parallel: bool = True

    @property
    def parse(self) -> bool:
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        """The output is grammar-constrained to tool calls (a named function, or `required`)."""
        return self.mode in ("named", "required")

    @property
    def finish_reason(self) -> str:
        # OpenAI reports "stop", not "tool_calls", when the request named the function to call.
        return "stop" if self.mode == "named" else "tool_calls"


def chat_params(req: ChatCompletionRequest) -> tuple[SamplingParams, ToolPlan]:
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true.")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    plan, tool_grammar = _tool_plan(req)
    response_format, structured = _response_format(req), _structured_outputs(req)
    if structured is not None and (response_format is not None or tool_grammar is not None):
        raise invalid(
            "structured_outputs",
            "structured_outputs is a request's only output constraint: drop response_format and the "
            "forced tool choice, or structured_outputs.",
        )
    # A forced tool call is constrained by the tool's schema, as OpenAI does: response_format would
    # constrain text, and a forced call writes none (it is still checked above: a bad schema is a 400).
    constraint = tool_grammar or response_format or structured
    params = _sampling_params(req, req.max_output_tokens, logprobs, constraint, _prompt_logprobs(req))
    return params, plan


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.suffix:
        raise invalid("suffix", "suffix is not supported.", code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise invalid("best_of", "best_of must equal n (only the sampled choices are returned).")
    if isinstance(req.prompt, list) and not req.prompt:
        raise invalid("prompt", "prompt must not be empty.")
    max_tokens = req.max_tokens
    if max_tokens == 0:
        # The echoed prompt alone (with its logprobs): the engine samples one token, which the pool
        # drops (deployments/pool/serving_completion.py), so the engine has no special case for it.
        if not req.echo:
            raise invalid("max_tokens", "max_tokens must be at least 1 (0 only together with echo).")
        if req.min_tokens:
            raise invalid("min_tokens", "min_tokens must be 0 when max_tokens is 0.")
        max_tokens = 1
    prompt_logprobs = _prompt_logprobs(req)
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens carry logprobs (vLLM)
        prompt_logprobs = req.logprobs if req.prompt_logprobs is None else req.prompt_logprobs
    return _sampling_params(req, max_tokens, req.logprobs, _structured_outputs(req), prompt_logprobs)


def _prompt_logprobs(req: SamplingRequest) -> int | None:
    """vLLM's `prompt_logprobs` (bounded by the schema). A stream carries none: with a stream, a
    value above 0 is a 400 and 0 is accepted and ignored, as in vLLM."""
    if req.stream and req.prompt_logprobs:
        raise invalid("prompt_logprobs", "prompt_logprobs are not available when stream is true.")
    return None if req.stream else req.prompt_logprobs


def _sampling_params(
    req: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    structured,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if req.logit_bias:
        raise invalid("logit_bias", "logit_bias is not supported.", code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true.")
    kwargs = dict(
        n=req.n,
        max_tokens=max_tokens,
        temperature=_default(req.temperature, 1.0),
        top_p=_default(req.top_p, 1.0),
        top_k=_default(req.top_k, 0),
        min_p=_default(req.min_p, 0.0),
        seed=None if req.seed is None else req.seed % 2**63,  # the engine adds the choice index
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=_default(req.min_tokens, 0),
        presence_penalty=_default(req.presence_penalty, 0.0),
        frequency_penalty=_default(req.frequency_penalty, 0.0),
        repetition_penalty=_default(req.repetition_penalty, 1.0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_engine_value_error(e) from None


def grammar_param(req: SamplingRequest) -> str | None:
    """The request field whose grammar work (schema checks, grammar builds) the request asks for, or
    None when it asks for none: that work is what the gateway bounds (raylane.engine.grammar_compiler)."""
    if isinstance(req, ChatCompletionRequest):
        if isinstance(req.response_format, ResponseFormatJsonObject | ResponseFormatJsonSchema):
            return "response_format"
        if req.tools:
            return "tools"
    return "structured_outputs" if req.structured_outputs is not None else None


def _default(value, default):
    return default if value is None else value


def _response_format(req: ChatCompletionRequest) -> StructuredOutputParams | None:
    fmt = req.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        return _structured("response_format", json_object=True)
    if isinstance(fmt, ResponseFormatJsonSchema):
        if fmt.json_schema.schema_ is None:
            raise invalid("response_format.json_schema.schema", "a JSON schema is required.")
        return _structured("response_format.json_schema.schema", json_schema=fmt.json_schema.schema_)
    return None


def _structured_outputs(req: SamplingRequest) -> StructuredOutputParams | None:
    spec = req.structured_outputs
    if spec is None:
        return None
    if spec.choice is not None:
        grammar = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return _structured("structured_outputs.choice", grammar=grammar)
    if spec.json_ is not None:
        return _structured("structured_outputs.json", json_schema=spec.json_)
    if spec.regex is not None:
        return _structured("structured_outputs.regex", regex=spec.regex)
    return _structured("structured_outputs.grammar", grammar=spec.grammar)


def _structured(param: str, **kwargs) -> StructuredOutputParams:
    # Compact JSON (no free whitespace): with any whitespace allowed, weak models pad JSON with
    # blanks until max_tokens runs out; the output is the same JSON either way.
    try:
        return StructuredOutputParams(whitespace_flexible=False, **kwargs)
    except ValueError as e:
        message = str(e).split(": ", 1)[-1]
        raise invalid(param, f"Invalid '{param}': {message}") from None


def _tool_plan(req: ChatCompletionRequest) -> tuple[ToolPlan, StructuredOutputParams | None]:
    choice, tools = req.tool_choice, req.tools or []
    if not tools:
        if choice in (None, "none", "auto"):
            return ToolPlan(), None
        raise invalid("tool_choice", "tool_choice is only allowed when tools are specified.")
    functions = [t.function.model_dump(exclude_none=True) for t in tools]
    _check_tools(functions)
    parallel = req.parallel_tool_calls is not False
    shown = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan("none"), None
    if choice in (None, "auto"):
        return ToolPlan("auto", shown, parallel), None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and named not in {f["name"] for f in functions}:
        raise invalid("tool_choice", f"tool_choice names function {named!r}, which is not in tools.")
    try:
        grammar = tool_call_grammar(functions, only=named, parallel=parallel)
    except ValueError as e:
        raise invalid("tools", str(e)) from None
    structured = _structured("tools", grammar=grammar)
    return ToolPlan("named" if named else "required", shown, parallel), structured


def _check_tools(functions: list[dict]) -> None:
    import jsonschema

    seen: set[str] = set()
    for i, fn in enumerate(functions):
        if fn["name"] in seen:
            raise invalid(f"tools[{i}].function.name", f"duplicate function name {fn['name']!r}.")
        seen.add(fn["name"])
        params = fn.get("parameters")
        if params is None:
            continue
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            raise invalid(f"tools[{i}].function.parameters", f"Invalid schema: {e.message}") from None
