"""Reasoning output through the API: the session's `reasoning` pool parses Qwen3's `<think>` markup.

Its demo model has random weights, so its output is forced with a regex (vLLM's `structured_outputs`
extension): the grammar lets the model pick any tokens that spell the text, and the shipped tokenizer
has no `<think>` token, so the tags arrive split over several tokens and engine outputs. The
expected token counts come from the tokens the server reports (logprobs), not from the parser.

A second app serves a tiny checkpoint whose tokenizer has `<think>` and `</think>` as tokens and whose
chat template opens the thinking, as DeepSeek-R1's does, with the `deepseek_r1` parser."""

import typing
from pathlib import Path

import httpx2
import openai
import pytest
from openai.types.responses import ResponseStreamEvent

THINK = "<think>\nTwo and two make four.\n</think>\n\nFour."
THINK_RE = r"<think>\nTwo and two make four\.\n</think>\n\nFour\."
ASK = [{"role": "user", "content": "What is two and two?"}]
EVENT_MODELS = {
    member.model_fields["type"].annotation.__args__[0]: member
    for member in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def forced(regex: str) -> dict:
    return {"structured_outputs": {"regex": regex}}


def tokens_through_think_end(logprobs) -> int:
    """How many of the reported output tokens it takes to spell `</think>`."""
    text = ""
    for k, token in enumerate(logprobs.content, start=1):
        text += token.token
        if "</think>" in text:
            return k
    raise AssertionError(f"no </think> in {text!r}")


@pytest.fixture(scope="module")
def thought(api_server):
    """The forced thinking, asked once for the module (with the tokens the server generated)."""
    client = openai.OpenAI(base_url=api_server.base_url, api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="reasoning",
        messages=ASK,
        max_tokens=60,
        temperature=0,
        logprobs=True,
        extra_body=forced(THINK_RE),
    )
    assert "".join(t.token for t in r.choices[0].logprobs.content) == THINK + "<|im_end|>"  # EOS counted
    return r


def test_chat_reasoning_content_is_parsed_out(thought):
    message = thought.choices[0].message
    assert message.reasoning_content == "\nTwo and two make four.\n"
    assert message.content == "Four."
    tokens = [t.token for t in thought.choices[0].logprobs.content]
    assert "</think>" not in tokens and "<think>" not in tokens  # the tags were split over tokens
    details = thought.usage.completion_tokens_details
    assert details.reasoning_tokens == tokens_through_think_end(thought.choices[0].logprobs)
    assert 0 < details.reasoning_tokens < thought.usage.completion_tokens


def test_chat_reasoning_streamed(client, thought):
    stream = client.chat.completions.create(
        model="reasoning",
        messages=ASK,
        max_tokens=60,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=forced(THINK_RE),
    )
    reasoning, content, usage, order = "", "", None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None) or ""
            order += ["reasoning"] * bool(piece) + ["content"] * bool(choice.delta.content)
            reasoning += piece
            content += choice.delta.content or ""
    assert reasoning == thought.choices[0].message.reasoning_content
    # The thinking streams in its own field, before the answer (in how many chunks depends on the
    # engine's speed against the stream batching interval).
    assert content == "Four." and order[0] == "reasoning"
    assert "reasoning" not in order[order.index("content") :]
    assert (
        usage.completion_tokens_details.reasoning_tokens
        == thought.usage.completion_tokens_details.reasoning_tokens
    )


def test_unterminated_thinking_is_all_reasoning(client):
    for stream in (False, True):
        r = client.chat.completions.create(
            model="reasoning",
            messages=ASK,
            max_tokens=8,
            temperature=0,
            extra_body=forced(r"<think>\n(still thinking ){30}"),
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        if stream:
            chunks = list(r)
            reasoning = "".join(
                getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
            )
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            message = r.choices[0].message
            reasoning, content, usage = message.reasoning_content, message.content or "", r.usage
            assert r.choices[0].finish_reason == "length"
        assert reasoning and ("\n" + "still thinking " * 30).startswith(reasoning) and content == ""
        assert usage.completion_tokens == 8 == usage.completion_tokens_details.reasoning_tokens


def test_an_answer_without_thinking_has_no_reasoning(client):
    r = client.chat.completions.create(
        model="reasoning", messages=ASK, max_tokens=20, temperature=0, extra_body=forced(r"Just four\.")
    )
    message = r.choices[0].message
    assert message.content == "Just four." and getattr(message, "reasoning_content", None) is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_responses_reasoning_item(client, thought):
    r = client.responses.create(
        model="reasoning",
        input=ASK[0]["content"],
        max_output_tokens=60,
        temperature=0,
        extra_body=forced(THINK_RE),
    )
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nTwo and two make four.\n"
    assert r.output_text == "Four."
    expected = thought.usage.completion_tokens_details.reasoning_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == expected


def test_responses_reasoning_streamed_events(client):
    events = [
        EVENT_MODELS[e.type].model_validate(e.to_dict())
        for e in client.responses.create(
            model="reasoning",
            input=ASK[0]["content"],
            max_output_tokens=60,
            temperature=0,
            stream=True,
            extra_body=forced(THINK_RE),
        )
    ]
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert events[2].item.type == "reasoning"
    thinking = kinds[4 : kinds.index("response.reasoning_text.done")]
    assert thinking and set(thinking) == {"response.reasoning_text.delta"}
    assert kinds[kinds.index("response.reasoning_text.done") : first_text] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == "\nTwo and two make four.\n"
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Four."


def test_reasoning_effort_is_checked_and_echoed(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="reasoning", input="Hi", reasoning={"effort": "extreme"})
    assert e.value.body["param"] == "reasoning.effort"
    r = client.responses.create(
        model="reasoning", input="Hi", reasoning={"effort": "low"}, max_output_tokens=2
    )
    assert r.reasoning.effort == "low"


# -- a checkpoint whose tokenizer and chat template carry the markup ---------------------------------

R1_APP = "reasoning-r1"
R1_RE = r"Two and two make four\.\n</think>\n\nFour\."


def make_thinking_checkpoint(path: Path) -> Path:
    """A tiny random Llama with the shipped tokenizer plus `<think>`/`</think>` as tokens, and the demo
    chat template with the assistant's turn opened by `<think>\\n` (DeepSeek-R1's way)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raylane.models.demo import ASSETS, load_tokenizer
    from tests.hf_models import TINY_CONFIG

    tokenizer = load_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    opening = "{{- '<|im_start|>assistant\\n' -}}"
    template = (ASSETS / "chat_template.jinja").read_text()
    assert opening in template
    tokenizer.chat_template = template.replace(opening, "{{- '<|im_start|>assistant\\n<think>\\n' -}}")
    config = LlamaConfig(
        **TINY_CONFIG
        | dict(
            vocab_size=-(-len(tokenizer) // 64) * 64,
            initializer_range=0.15,
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=None,
            tie_word_embeddings=True,
            dtype="float32",
        )
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def r1(api_server, tmp_path_factory):
    """(client, base URL) of an app whose pool `r1` serves that checkpoint with `deepseek_r1`."""
    from tests.reliability.conftest import deployed

    path = make_thinking_checkpoint(tmp_path_factory.mktemp("thinker"))
    engine = {"max_num_seqs": 4, "num_kv_blocks": 64, "cpus_per_rank": 0.25, "seed": 0}
    pool = {"name": "r1", "model": str(path), "engine": engine, "reasoning_parser": "deepseek_r1"}
    with deployed(api_server, R1_APP, {"pools": [pool]}) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120), url


def test_a_chat_template_that_opens_the_thinking(r1):
    client, url = r1
    prompt = httpx2.post(
        f"{url}/tokenize", json={"model": "r1", "messages": ASK, "return_token_strs": True}, timeout=60
    ).json()["token_strs"]
    assert "<think>" in prompt[-3:]  # one token, at the end of the prompt the template writes
    r = client.chat.completions.create(
        model="r1", messages=ASK, max_tokens=40, temperature=0, logprobs=True, extra_body=forced(R1_RE)
    )
    message = r.choices[0].message
    assert message.reasoning_content == "Two and two make four.\n" and message.content == "Four."
    expected = tokens_through_think_end(r.choices[0].logprobs)
    assert r.usage.completion_tokens_details.reasoning_tokens == expected
    stream = client.chat.completions.create(
        model="r1", messages=ASK, max_tokens=40, temperature=0, stream=True, extra_body=forced(R1_RE)
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == "Four."
    response = client.responses.create(
        model="r1", input=ASK[0]["content"], max_output_tokens=40, temperature=0, extra_body=forced(R1_RE)
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == message.reasoning_content
    assert response.usage.output_tokens_details.reasoning_tokens == expected
