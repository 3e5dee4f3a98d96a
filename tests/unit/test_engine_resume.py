"""An engine request resumed after the output another replica had produced (`Resumption`): greedy, it
goes on exactly as the undisturbed request did, and its DELTA outputs carry only what comes after the
text already sent, wherever the cut falls (inside a UTF-8 character, inside a possible stop string).
Penalties, the grammar and `max_tokens` count the tokens produced before."""

import json

import jsonschema
import pytest

from raylane.engine import LLM, RequestOutputKind, Resumption, SamplingParams

PROMPT = "tell me a story"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(demo_models) -> LLM:
    return LLM(str(demo_models["raylane-llama-tiny"]), num_kv_blocks=256)


def run(llm: LLM, params: SamplingParams, resume: Resumption | None = None):
    """(text, token ids, finish reason) per sample from the DELTA outputs only (what a stream sends),
    and sample 0's text as sent after each of its tokens (before the last output's flush)."""
    engine = llm.engine
    request_id = engine.add_request(PROMPT, params.clone(output_kind=RequestOutputKind.DELTA), resume=resume)
    n = params.n
    text, ids, reasons, sent = [""] * n, [[] for _ in range(n)], [None] * n, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == request_id
            for comp in out.outputs:
                text[comp.index] += comp.text
                ids[comp.index] += comp.token_ids
                reasons[comp.index] = comp.finish_reason or reasons[comp.index]
                if comp.index == 0 and comp.token_ids:
                    assert len(comp.token_ids) == 1  # one token per step: `sent` is per token
                    sent.append(text[0])
    return text, ids, reasons, sent


def test_every_cut_point_resumes_to_the_same_tokens_and_text(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [text], [ids], _, sent = run(llm, params)
    # Some tokens add no text at once (part of a UTF-8 character): cuts after them resume held-back bytes.
    assert any(sent[k] == sent[k - 1] for k in range(1, 24))
    for cut in range(1, 24):
        [rest], [more], [reason], _ = run(llm, params, Resumption((tuple(ids[:cut]),)))
        assert more == ids[cut:], cut  # max_tokens counts the tokens produced before
        assert reason == "length"
        assert sent[cut - 1] + rest == text, cut


def test_a_stop_string_found_across_the_cut_ends_the_resumed_request(llm):
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [text], _, _, _ = run(llm, plain)
    stop = text[20:24]  # appears in the undisturbed text, so the request stops there
    params = plain.clone(stop=[stop])
    [stopped], [stopped_ids], [why], sent = run(llm, params)
    assert why == "stop" and stop not in stopped
    for cut in range(1, len(stopped_ids)):
        [rest], [more], [reason], _ = run(llm, params, Resumption((tuple(stopped_ids[:cut]),)))
        assert reason == "stop" and more == stopped_ids[cut:], cut
        assert sent[cut - 1] + rest == stopped, cut


def test_penalties_count_the_tokens_produced_before(llm):
    # A negative penalty makes the output repeat what it has produced, the resumed part included.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=-1.0)
    _, [ids], _, _ = run(llm, params)
    assert ids != run(llm, params.clone(frequency_penalty=0.0))[1][0]  # the penalty matters here
    _, [more], _, _ = run(llm, params, Resumption((tuple(ids[:20]),)))
    assert more == ids[20:]


def test_a_grammar_resumes_advanced_over_the_tokens_produced_before(llm):
    params = SamplingParams(temperature=0, max_tokens=200, structured={"json_schema": SCHEMA})
    [text], [ids], [reason], sent = run(llm, params)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    cut = len(ids) // 2
    [rest], [more], [again], _ = run(llm, params, Resumption((tuple(ids[:cut]),)))
    assert again == "stop" and more == ids[cut:]
    jsonschema.validate(json.loads(sent[cut - 1] + rest), SCHEMA)
    with pytest.raises(ValueError, match="resume: token"):  # output the grammar forbids
        llm.engine.add_request(PROMPT, params, resume=Resumption(((ids[0], ids[0], ids[0], ids[0]),)))


def test_samples_resume_individually_and_an_ended_one_is_not_run_again(llm):
    params = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    _, [a, b], _, _ = run(llm, params)
    resume = Resumption((tuple(a), tuple(b[:10])), finish_reasons=("length", None))
    [text_a, _], [more_a, more_b], [reason_a, reason_b], _ = run(llm, params, resume)
    assert more_a == [] and text_a == "" and reason_a == "length"  # sent already: nothing again
    assert more_b == b[10:] and reason_b == "length"


def test_a_resumption_that_no_longer_fits_the_context_is_refused(llm):
    room = llm.engine.max_model_len - len(llm.engine.tokenize(PROMPT))
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    with pytest.raises(ValueError, match="no room"):
        llm.engine.add_request(PROMPT, params, resume=Resumption(((1,) * room,)))
