"""The demo checkpoints load and run with plain Hugging Face; their tokenizer behaves like a chat model's."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raylane.models.demo import DEMO_MODELS, create_demo_models

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 °C in Paris."},
    {"role": "user", "content": "Merci ! Et à Tokyo ?"},
]


@pytest.fixture(scope="module")
def demo_dir(demo_models: dict[str, Path]) -> Path:
    """The folder of conftest's session-wide demo models (created once, shared with other tests)."""
    return demo_models[DEMO_MODELS[0]].parent


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path):
    return AutoTokenizer.from_pretrained(demo_dir / DEMO_MODELS[0], local_files_only=True)


@pytest.mark.parametrize("name", DEMO_MODELS)
def test_model_loads_and_generates(demo_dir: Path, name: str) -> None:
    # local_files_only: everything must come from the folder, never the Hub.
    model = AutoModelForCausalLM.from_pretrained(demo_dir / name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / name, local_files_only=True)
    assert model.dtype == torch.float32
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tokenizer)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello!"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt_len = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, prompt_len + 8)
    # Random weights, but greedy decoding is still deterministic.
    again = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(out, again)


def test_models_are_a_dense_llama_and_a_qwen3_moe(demo_dir: Path) -> None:
    llama = json.loads((demo_dir / "raylane-llama-tiny" / "config.json").read_text())
    moe = json.loads((demo_dir / "raylane-qwen3-moe-tiny" / "config.json").read_text())
    assert llama["model_type"] == "llama" and llama["num_key_value_heads"] < llama["num_attention_heads"]
    assert (
        moe["model_type"] == "qwen3_moe" and moe["num_local_experts"] == 8 and moe["num_experts_per_tok"] == 2
    )


@pytest.mark.parametrize(
    "text",
    [
        "Crème brûlée, jalapeño, Straße, naïve façade",
        "你好，世界！東京は晴れです。안녕하세요",
        "Launch 🚀, party 🎉, family 👨‍👩‍👧, flag 🇫🇷, ❤️",
        "  mixed\tws\n\ndef f(x):\n    return {'π': 3.14159}  # ≈ \u200b\x00",
    ],
)
def test_tokenizer_round_trips_text_exactly(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens(demo_dir: Path, tokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    # Tool-call markers are model output, so decoding with skip_special_tokens keeps them.
    ids = tokenizer.encode("<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"
    generation = json.loads((demo_dir / DEMO_MODELS[0] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def test_chat_template_renders_tool_conversation(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in system
    assert rest == (
        "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>tool\n{"temperature": 21}<|im_end|>\n'
        "<|im_start|>assistant\nIt is 21 °C in Paris.<|im_end|>\n"
        "<|im_start|>user\nMerci ! Et à Tokyo ?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_without_tools_or_generation_prompt(tokenizer) -> None:
    messages = [m for m in CONVERSATION if m["role"] in ("system", "user")][:2]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
    )


def test_create_again_keeps_existing_models(demo_dir: Path) -> None:
    files = sorted(p for p in demo_dir.rglob("*") if p.is_file())
    before = {p: p.stat().st_mtime_ns for p in files}
    assert create_demo_models(demo_dir) == {name: demo_dir / name for name in DEMO_MODELS}
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert sorted(p for p in demo_dir.rglob("*") if p.is_file()) == files


def test_force_rewrites_the_same_weights(demo_dir: Path, tmp_path: Path) -> None:
    name = DEMO_MODELS[0]
    weights = create_demo_models(tmp_path, names=[name])[name] / "model.safetensors"
    first_write = weights.stat().st_mtime_ns
    create_demo_models(tmp_path, force=True, names=[name])
    assert weights.stat().st_mtime_ns != first_write
    # Same seed, same bytes: every run writes the same demo model.
    assert weights.read_bytes() == (demo_dir / name / "model.safetensors").read_bytes()


def test_unknown_model_name_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="raylane-llama-tiny"):
        create_demo_models(tmp_path, names=["raylane-gpt-huge"])
