"""Text-level behaviour on the demo checkpoints: chat templates, stop strings, streaming, JSON output."""

import json

import jsonschema
import pytest

from raylane.engine import LLM, AsyncLLM, RequestOutputKind, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(demo_models) -> LLM:
    return LLM(str(demo_models["raylane-llama-tiny"]), num_kv_blocks=256)


def test_json_schema_output_always_parses_and_validates(llm):
    params = [
        SamplingParams(temperature=1.0, max_tokens=400, seed=seed, structured={"json_schema": SCHEMA})
        for seed in range(12)
    ]
    outputs = llm.generate(["Describe a user as JSON:"] * len(params), params)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_json_mode_gives_a_json_object(llm):
    out = llm.generate("{", SamplingParams(temperature=0, max_tokens=300, structured={"json_object": True}))
    assert isinstance(json.loads(out[0].outputs[0].text), dict)


def test_regex_constraint(llm):
    out = llm.generate(
        "Code:", SamplingParams(temperature=0.8, seed=3, structured={"regex": r"[A-Z]{3}-\d{4}"})
    )
    assert out[0].outputs[0].text[:3].isupper() and out[0].outputs[0].text[3] == "-"
    assert len(out[0].outputs[0].text) == 8


def test_chat_applies_the_template_and_stops_at_end_of_turn(llm):
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64))[0]
    rendered = tokenizer.decode(out.prompt_token_ids)
    assert rendered.startswith("<|im_start|>system\nBe brief.")
    assert "<|im_start|>user\nHi there<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert "<|im_end|>" not in out.outputs[0].text


def test_stop_string_trims_the_text(llm):
    free = llm.generate("Once", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = free.text[10:14]  # a piece of what the model will say
    assert stop.strip()
    out = llm.generate("Once", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == free.text[: free.text.index(stop)]


async def test_streamed_deltas_add_up_to_the_offline_text(demo_models, llm):
    # Every step's tokens as they come: the tiny model's 30 steps fit in one batching interval.
    engine = AsyncLLM(
        model=str(demo_models["raylane-llama-tiny"]), num_kv_blocks=64, stream_batching_interval_ms=0
    )
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    deltas, tokens = [], []
    async for out in engine.generate("Streaming is", params):
        deltas.append(out.outputs[0].text)
        tokens.extend(out.outputs[0].token_ids)
    engine.shutdown()
    offline = llm.generate("Streaming is", params.clone(output_kind=RequestOutputKind.CUMULATIVE))[0].outputs[
        0
    ]
    assert "".join(deltas) == offline.text
    assert tokens == offline.token_ids
    assert len(deltas) > 5  # really streamed, not one final chunk


def test_the_grammar_machinery_is_built_while_the_engine_starts_not_by_the_first_grammar(
    demo_models, monkeypatch
):
    """Importing xgrammar and reading the vocabulary happen on a thread of their own while the engine
    starts. Built by the step that admits the first request with a grammar, they stalled every other
    stream on the replica (~70 ms with this model's 4,096 tokens; test_noisy_neighbour's victim)."""
    import threading

    from raylane.engine.structured_output import StructuredOutputManager

    built_on = []
    init = StructuredOutputManager.__init__

    def recording_init(self, *args, **kwargs):
        built_on.append(threading.current_thread().name)
        init(self, *args, **kwargs)

    monkeypatch.setattr(StructuredOutputManager, "__init__", recording_init)
    llm = LLM(str(demo_models["raylane-llama-tiny"]), num_kv_blocks=64)
    for thread in threading.enumerate():
        if thread.name == "xgrammar-init":
            thread.join()
    out = llm.generate("{", SamplingParams(temperature=0, max_tokens=100, structured={"json_object": True}))
    assert isinstance(json.loads(out[0].outputs[0].text), dict)
    assert built_on == ["xgrammar-init"]  # once, before the request, and not on the step loop
