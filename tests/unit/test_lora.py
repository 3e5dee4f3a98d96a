"""LoRA adapters in the engine against Hugging Face PEFT on tiny random checkpoints.

Adapters are made by PEFT itself (`get_peft_model` with random A and B, `save_pretrained`), of
several ranks and target modules; the engine's greedy output with an adapter must be PEFT's, with
the adapter unmerged and merged into the weights, alone or mixed in one batch with the base model
and other adapters.
"""

import math
import shutil
from pathlib import Path

import pytest
import torch

from raylane.engine import LLM, LoRARequest, SamplingParams
from raylane.parallel.lora import LoRALayer
from tests.hf_models import make_checkpoint

PROMPTS = [[5, 9, 11, 3, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]
MAX_TOKENS = 10
ADAPTERS = {  # name -> (rank, alpha, target modules, rslora)
    "attn-r4": (4, 8, ["q_proj", "v_proj"], False),
    "all-r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp-r16": (16, 8, ["gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(base: str, out: Path, seed: int, rank: int, alpha: int, targets: list[str], rslora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    peft = get_peft_model(model, config)  # init_lora_weights=False: B random too (PEFT's default B is zero)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)  # an update of the base's size, not one that drowns it
    peft.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, checkpoint, tmp_path_factory):
    base = checkpoint(request.param)
    folder = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {
        name: LoRARequest(name, i + 1, str(make_adapter(base, folder / name, i, *spec)))
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    return base, adapters


@torch.no_grad()
def peft_greedy(base: str, adapter: LoRARequest | None, merged: bool = False) -> list[list[int]]:
    """Greedy continuation of every prompt by transformers (with PEFT's adapter), EOS ignored."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter.lora_path)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    outputs = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        for _ in range(MAX_TOKENS):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        outputs.append(tokens[len(prompt) :])
    return outputs


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def engine_greedy(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    outs = llm.generate(PROMPTS * (len(loras) // len(PROMPTS)), greedy(), lora_request=loras)
    return [list(out.outputs[0].token_ids) for out in outs]


def test_each_adapter_gives_peft_greedy_output_unmerged_and_merged(family):
    base, adapters = family
    with LLM(base, num_kv_blocks=64, enable_lora=True, max_loras=4, max_lora_rank=16) as llm:
        for adapter in adapters.values():
            got = engine_greedy(llm, [adapter] * len(PROMPTS))
            assert got == peft_greedy(base, adapter), adapter.lora_name
            assert got == peft_greedy(base, adapter, merged=True), adapter.lora_name
            assert got != peft_greedy(base, None), adapter.lora_name  # the adapter changes the answer


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(family):
    """Base model and three adapters in one batch (each prompt under each), with two slots only: the
    third adapter waits for a slot, then evicts the least recently used."""
    base, adapters = family
    loras = [None, *adapters.values()]
    with LLM(base, num_kv_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        alone = {lora: engine_greedy(llm, [lora] * len(PROMPTS)) for lora in loras}
        mixed = engine_greedy(llm, [lora for lora in loras for _ in PROMPTS])
    assert mixed == [out for lora in loras for out in alone[lora]]
    with LLM(base, num_kv_blocks=64) as plain:
        assert alone[None] == engine_greedy(plain, [None] * len(PROMPTS))


def test_the_prefix_cache_never_shares_kv_between_adapters(checkpoint, tmp_path):
    """The same 40-token prompt first under the base model, then under an adapter: the second
    finds no block of the first in the cache (its KV differs), so its answer is PEFT's."""
    base = checkpoint("llama")
    adapter = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", 0, *ADAPTERS["all-r8"])))
    prompt = list(range(10, 50))
    with LLM(base, num_kv_blocks=64, block_size=16, enable_lora=True) as llm:
        llm.generate([prompt], greedy())
        again = llm.generate([prompt], greedy())[0]
        under_adapter = llm.generate([prompt], greedy(), lora_request=adapter)[0]
    assert again.num_cached_tokens == 32  # the base model's second run reuses its two full blocks
    assert under_adapter.num_cached_tokens == 0


def test_adapters_the_engine_cannot_serve_are_refused_naming_the_problem(checkpoint, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = checkpoint("llama")
    big = LoRARequest("big", 1, str(make_adapter(base, tmp_path / "big", 0, 32, 32, ["q_proj"], False)))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    embed = get_peft_model(model, LoraConfig(r=4, target_modules=["embed_tokens"]))
    embed.save_pretrained(tmp_path / "embed")
    wider = make_checkpoint(tmp_path / "wider", "llama", hidden_size=96)  # an adapter of another model
    other = LoRARequest("other", 3, str(make_adapter(str(wider), tmp_path / "o", 0, 4, 8, ["q_proj"], False)))
    with LLM(base, num_kv_blocks=64, enable_lora=True, max_lora_rank=16) as llm:
        for lora, message in [
            (big, "rank 32; this engine serves ranks 1-16"),
            (LoRARequest("embed", 2, str(tmp_path / "embed")), "targets \\['embed_tokens'\\]"),
            (other, "not this model's"),
            (LoRARequest("missing", 4, str(tmp_path / "nowhere")), "cannot read"),
        ]:
            with pytest.raises(ValueError, match=f"lora_request: .*{message}"):
                llm.generate([PROMPTS[0]], greedy(), lora_request=lora)
        assert (
            len(llm.generate([PROMPTS[0]], greedy())[0].outputs[0].token_ids) == MAX_TOKENS
        )  # still serving
    with LLM(base, num_kv_blocks=64) as plain, pytest.raises(ValueError, match="enable_lora"):
        plain.generate([PROMPTS[0]], greedy(), lora_request=big)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_quantized_base_weights(checkpoint, tmp_path, quantization):
    """With int8 or int4 base weights the update is added in float: each adapter changes the
    quantized model's answer, and a batch mixing base and adapters gives what each gets alone."""
    base = checkpoint("llama")
    loras = [None] + [
        LoRARequest(name, i + 1, str(make_adapter(base, tmp_path / name, i, *ADAPTERS[name])))
        for i, name in enumerate(["attn-r4", "all-r8"])
    ]
    with LLM(base, num_kv_blocks=128, enable_lora=True, quantization=quantization) as llm:
        alone = [engine_greedy(llm, [lora] * len(PROMPTS)) for lora in loras]
        mixed = engine_greedy(llm, [lora for lora in loras for _ in PROMPTS])
    assert mixed == [out for outs in alone for out in outs]
    assert alone[0] != alone[1] and alone[0] != alone[2]


def poisoned_copy(adapter: LoRARequest, out: Path, value: float, lora_id: int) -> LoRARequest:
    """A copy of `adapter` with one weight of its first tensor set to `value`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter.lora_path, out)
    tensors = load_file(out / "adapter_model.safetensors")
    first = sorted(tensors)[0]
    tensors[first].view(-1)[0] = value
    save_file(tensors, out / "adapter_model.safetensors")
    return LoRARequest(out.name, lora_id, str(out))


def test_non_finite_or_huge_adapter_weights_are_refused(checkpoint, tmp_path):
    base = checkpoint("llama")
    good = LoRARequest("good", 1, str(make_adapter(base, tmp_path / "good", 0, *ADAPTERS["attn-r4"])))
    with LLM(base, num_kv_blocks=64, enable_lora=True, max_lora_rank=16) as llm:
        for i, (value, message) in enumerate([(math.nan, "NaN or infinite"), (math.inf, "NaN or infinite"),
                                              (1e6, "beyond 1000")]):  # fmt: skip
            bad = poisoned_copy(good, tmp_path / f"bad{i}", value, 10 + i)
            with pytest.raises(ValueError, match=message):
                llm.generate([PROMPTS[0]], greedy(), lora_request=bad)
            with pytest.raises(ValueError, match=message):
                llm.engine.check_lora(bad.lora_path)  # what POST /v1/load_lora_adapter asks first
        assert engine_greedy(llm, [good] * len(PROMPTS)) == peft_greedy(base, good)


def test_a_slot_holding_nan_leaves_every_other_row_of_the_step_as_it_was(checkpoint, tmp_path):
    """Whatever one slot holds (here NaN written into it behind the checks), the base model's rows and
    another adapter's rows in the same steps are token-identical to a run without it: each slot's
    update reaches its own rows only (0 x NaN is NaN: a mask that multiplies would spread it)."""
    base = checkpoint("llama")
    a, b = (
        LoRARequest(name, i + 1, str(make_adapter(base, tmp_path / name, i, *ADAPTERS[name])))
        for i, name in enumerate(["attn-r4", "all-r8"])
    )
    with LLM(base, num_kv_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        clean = engine_greedy(llm, [None] * len(PROMPTS) + [b] * len(PROMPTS))
        engine_greedy(llm, [a] * len(PROMPTS))  # `a` resident in its slot
        runner = llm.engine.executor.runner
        slot = llm.engine.scheduler.lora_slots.slot_of(a)
        for layer in (m for m in runner.model.modules() if isinstance(m, LoRALayer)):
            for sub in range(len(layer.sub_sizes)):
                layer.lora_b[:, layer.columns(sub, slot)] = math.nan
            layer.repack()
        mixed = engine_greedy(llm, [None] * len(PROMPTS) + [a] * len(PROMPTS) + [b] * len(PROMPTS))
    n = len(PROMPTS)
    assert mixed[:n] + mixed[2 * n :] == clean


def test_an_adapters_files_changing_under_a_running_engine_fail_nothing(checkpoint, tmp_path):
    """An adapter is read once, when first asked for: its files replaced by garbage or removed later
    (while it is evicted from its slot and loaded again) change nothing and end no step."""
    base = checkpoint("llama")
    a, b = (
        LoRARequest(name, i + 1, str(make_adapter(base, tmp_path / name, i, *ADAPTERS[name])))
        for i, name in enumerate(["attn-r4", "all-r8"])
    )
    with LLM(base, num_kv_blocks=128, enable_lora=True, max_loras=1, max_lora_rank=16) as llm:
        first = engine_greedy(llm, [a] * len(PROMPTS))
        (Path(a.lora_path) / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        engine_greedy(llm, [b] * len(PROMPTS))  # evicts `a` from the one slot
        shutil.rmtree(b.lora_path)
        assert engine_greedy(llm, [a] * len(PROMPTS)) == first  # loaded again, from memory
        assert engine_greedy(llm, [b] * len(PROMPTS))  # still served


def test_a_request_waiting_for_an_adapter_slot_does_not_hold_up_the_requests_behind_it(checkpoint, tmp_path):
    """One slot, pinned by a running request of adapter `a`: a request of adapter `b` waits for it,
    and a base-model request that arrived after `b` runs meanwhile, then `b` once the slot frees."""
    base = checkpoint("llama")
    a, b = (
        LoRARequest(name, i + 1, str(make_adapter(base, tmp_path / name, i, *ADAPTERS[name])))
        for i, name in enumerate(["attn-r4", "all-r8"])
    )
    with LLM(base, num_kv_blocks=128, enable_lora=True, max_loras=1, max_lora_rank=16) as llm:
        engine = llm.engine
        engine.add_request(PROMPTS[0], greedy().clone(max_tokens=40), request_id="a", lora_request=a)
        engine.step()
        engine.add_request(PROMPTS[0], greedy(), request_id="b", lora_request=b)
        engine.add_request(PROMPTS[1], greedy(), request_id="base")
        engine.step()
        running = {r.request_id for r in engine.scheduler.running}
        assert running == {"a", "base"} and [r.request_id for r in engine.scheduler.waiting] == ["b"]
        done = set()
        while engine.has_unfinished_requests():
            done |= {out.request_id for out in engine.step() if out.finished}
        assert done == {"a", "b", "base"}
