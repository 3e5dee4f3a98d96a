from __future__ import annotations

import functools
import json
import re
import time

import jsonschema
import pytest
import torch

from raylane.engine.structured_output import GrammarMatcherState, StructuredOutputManager
from raylane.engine.structured_params import StructuredOutputParams
from tests.tokenizers_for_tests import make_tokenizer

PAD = 24  # the model's logits are wider than the tokenizer: padded ids must never be allowed
MAX_STEPS = 400

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "dev", "ops"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
EBNF = r"""
root ::= greeting " " target ("!" | ".")
greeting ::= "hello" | "hi" | "hey"
target ::= "world" | [a-z] [a-z0-9]{0,7}
"""


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(1000)


@pytest.fixture(scope="module")
def manager(tok):
    return StructuredOutputManager(tok, vocab_size=len(tok) + PAD)


@functools.cache
def closing_bias(vocab_size: int) -> torch.Tensor:
    """Boost tokens with `"`, `}` or `]` so unbounded parts (free JSON strings, nesting) end soon;
    masking correctness does not depend on the distribution."""
    tok = make_tokenizer(1000)
    bias = torch.zeros(vocab_size)
    bias[[i for i in range(len(tok)) if any(c in tok.decode([i]) for c in '"}]')]] = 4.0
    return bias


def generate(manager: StructuredOutputManager, state: GrammarMatcherState, seed: int, greedy: bool) -> str:
    """Sample from the masked distribution of random logits until the matcher accepts EOS."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(MAX_STEPS):
        logits = torch.randn(manager.vocab_size, generator=gen) + closing_bias(manager.vocab_size)
        state.apply_mask(logits)
        assert torch.isinf(logits[-PAD:]).all()
        if greedy:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        assert state.accept_token(token), f"sampled a masked token {token}"
        if state.is_terminated():
            assert token in manager.stop_token_ids
            return make_tokenizer(1000).decode(out)
        out.append(token)
    raise AssertionError(f"no EOS after {MAX_STEPS} steps: {make_tokenizer(1000).decode(out)!r}")


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "t1"])
def test_json_object(manager, greedy):
    state = manager.new_matcher(StructuredOutputParams(json_object=True))
    for seed in range(5):
        state.reset()
        assert isinstance(json.loads(generate(manager, state, seed, greedy)), dict)


@pytest.mark.parametrize("flexible", [True, False], ids=["any_ws", "compact"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "t1"])
def test_json_schema(manager, greedy, flexible):
    params = StructuredOutputParams(json_schema=SCHEMA, whitespace_flexible=flexible)
    for seed in range(20):
        text = generate(manager, manager.new_matcher(params), seed, greedy)
        jsonschema.validate(json.loads(text), SCHEMA)
        if not flexible:  # no whitespace outside string literals
            assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', '""', text)), text


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "t1"])
def test_regex(manager, greedy):
    params = StructuredOutputParams(regex=r"\d{3}-[a-z]{2,4}")
    for seed in range(10):
        text = generate(manager, manager.new_matcher(params), seed, greedy)
        assert re.fullmatch(r"\d{3}-[a-z]{2,4}", text), text


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "t1"])
def test_ebnf(manager, greedy):
    params = StructuredOutputParams(grammar=EBNF)
    for seed in range(10):
        text = generate(manager, manager.new_matcher(params), seed, greedy)
        assert re.fullmatch(r"(hello|hi|hey) (world|[a-z][a-z0-9]{0,7})[!.]", text), text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "structured:"),
        ({"json_object": True, "regex": "a"}, "structured:"),
        ({"json_schema": "{not json"}, "structured.json_schema"),
        ({"json_schema": [1, 2]}, "structured.json_schema"),
        ({"json_schema": {"type": "integer", "minimum": "zero"}}, "structured.json_schema"),
        ({"json_schema": {"type": "nope"}}, "structured.json_schema"),
        ({"regex": "(ab"}, "structured.regex"),
        ({"regex": 5}, "structured.regex"),
        ({"grammar": 'root ::= "a" undefined_rule'}, "structured.grammar"),
        ({"grammar": 'start ::= "a"'}, "structured.grammar"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)) as e:
        StructuredOutputParams(**kwargs)
    assert "/project/cpp" not in str(e.value)


def test_length_bounded_strings_reject_control_characters(manager):
    # xgrammar#800: a maxLength string admitted a raw tab (strict json.loads fails) and surrogates.
    for params in (StructuredOutputParams(json_schema=SCHEMA), StructuredOutputParams(json_object=True)):
        state = manager.new_matcher(params)
        assert state.matcher.accept_string('{"name": "ab')
        assert not state.matcher.accept_string("\t")
        assert not state.matcher.accept_string(b"\xed\xb1\xa2")  # UTF-8-encoded surrogate
        assert state.matcher.accept_string('c"')


def test_compile_cache_and_schema_as_string(manager):
    a = manager.compile(StructuredOutputParams(json_schema=SCHEMA))
    assert manager.compile(StructuredOutputParams(json_schema=json.dumps(SCHEMA))) is a
    assert manager.compile(StructuredOutputParams(json_schema=SCHEMA, whitespace_flexible=False)) is not a


def allowed(manager: StructuredOutputManager, state: GrammarMatcherState) -> set[int]:
    logits = torch.zeros(manager.vocab_size)
    state.apply_mask(logits)
    return set(torch.nonzero(~torch.isinf(logits)).flatten().tolist())


def test_termination_rollback_reset(manager, tok):
    state = manager.new_matcher(StructuredOutputParams(regex="ab"))
    start = allowed(manager, state)
    assert tok.encode("a")[0] in start and manager.stop_token_ids[0] not in start
    assert not state.accept_token(tok.encode("z")[0])  # rejected tokens leave the state alone
    for t in tok.encode("a") + tok.encode("b"):
        assert state.accept_token(t)
    assert state.is_completed() and not state.is_terminated()
    assert allowed(manager, state) == set(manager.stop_token_ids)  # complete: only EOS
    assert state.accept_token(manager.stop_token_ids[0]) and state.is_terminated()
    assert allowed(manager, state) == set(manager.stop_token_ids)  # terminated: still only EOS
    state.rollback(2)  # undo EOS and "b"
    assert not state.is_terminated() and allowed(manager, state) == {
        i for i in range(len(tok)) if tok.decode([i]) == "b"
    }
    state.reset()
    assert allowed(manager, state) == start and state.num_accepted == 0


def test_batched_masks_match_per_row_and_skip_others(manager, tok):
    params = [
        StructuredOutputParams(json_object=True),
        StructuredOutputParams(regex=r"\d+"),
        StructuredOutputParams(json_schema=SCHEMA),
    ]
    states = [manager.new_matcher(p) for p in params]
    states[0].accept_token(tok.encode("{")[0])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, manager.vocab_size, generator=gen)
    expected = logits.clone()
    for row, state in zip([0, 2, 4], states, strict=True):
        state.apply_mask(expected[row])
    manager.apply_masks(logits, [0, 2, 4], states)
    assert torch.equal(logits, expected)
    assert not torch.isinf(logits[[1, 3]]).any()  # unconstrained rows untouched
    # The pure-torch backend (what non-CUDA accelerators use) gives the same result.
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(5, manager.vocab_size)
    for row, state in zip([0, 2, 4], states, strict=True):
        state.matcher.fill_next_token_bitmask(mask, row)
    native = torch.randn(5, manager.vocab_size, generator=gen)
    cpu = native.clone()
    xgr.apply_token_bitmask_inplace(
        native, mask, vocab_size=manager.vocab_size, indices=[0, 2, 4], backend="torch_native"
    )
    xgr.apply_token_bitmask_inplace(cpu, mask, vocab_size=manager.vocab_size, indices=[0, 2, 4])
    assert torch.equal(native, cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_on_cuda(manager):
    states = [manager.new_matcher(StructuredOutputParams(json_object=True)) for _ in range(3)]
    logits = torch.randn(4, manager.vocab_size)
    gpu = logits.cuda()
    manager.apply_masks(logits, [0, 1, 3], states)
    manager.apply_masks(gpu, [0, 1, 3], states)
    assert torch.equal(gpu.cpu(), logits)
    row = torch.randn(manager.vocab_size, device="cuda")
    states[0].apply_mask(row)
    assert torch.equal(torch.isinf(row.cpu()), torch.isinf(logits[0]))


def test_batch_mask_overhead_report():
    """Batch of 8 JSON-schema requests on a ~4k vocab: prints the per-step masking cost."""
    tok4k = make_tokenizer(4096)
    mgr = StructuredOutputManager(tok4k, vocab_size=len(tok4k))
    params = StructuredOutputParams(json_schema=SCHEMA)
    states = [mgr.new_matcher(params) for _ in range(8)]
    gen = torch.Generator().manual_seed(0)
    rows = list(range(8))
    times, steps = [], 0
    while steps < 200 and not all(s.is_completed() or s.is_terminated() for s in states):
        logits = torch.randn(8, mgr.vocab_size, generator=gen)
        t0 = time.perf_counter()
        mgr.apply_masks(logits, rows, states)
        times.append(time.perf_counter() - t0)
        for state, token in zip(
            states, torch.multinomial(logits.softmax(-1), 1, generator=gen).flatten().tolist(), strict=True
        ):
            if not state.is_terminated():
                assert state.accept_token(token)
        steps += 1
    times.sort()
    print(
        f"\nmask batch=8 vocab={mgr.vocab_size}: median {times[len(times) // 2] * 1e6:.0f} us/step, "
        f"p90 {times[int(len(times) * 0.9)] * 1e6:.0f} us/step over {len(times)} steps"
    )


def test_params_pickle_and_copy():
    # Params travel gateway -> replica through Ray (pickle) and SamplingParams.clone (deepcopy).
    import copy
    import pickle

    p = StructuredOutputParams(json_schema=json.dumps(SCHEMA), whitespace_flexible=False)
    assert isinstance(p.json_schema, dict)
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p)):
        assert q == p and q.key() == p.key() and q.kind == "json_schema"


def nested_any_of(depth: int) -> dict:
    """A schema whose check, build and compile take time exponential in `depth` (10: 94 KB of JSON, ~6 s
    of checking, building and compiling on the 2-core box of 2026-12-02)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {
            "anyOf": [{"type": "object", "properties": {"a": schema}}, {"type": "array", "items": schema}]
        }
    return schema


def test_bounded_compile_refuses_a_catastrophic_schema_then_serves_the_next(manager):
    """A grammar past the limit is refused (the worker that compiled it is killed, not waited on);
    the next one compiles in a fresh worker, and the engine only deserializes what it gets."""
    import asyncio

    from raylane.engine.grammar_compiler import GrammarCompileService

    info = manager.tokenizer_info.serialize_json()

    async def fetch() -> str:
        return info

    service = GrammarCompileService(fetch, timeout_s=1.0)
    try:
        hostile = StructuredOutputParams(json_schema=nested_any_of(10), check=False)
        with pytest.raises(ValueError, match=r"structured\.json_schema: too complex"):
            asyncio.run(service.prepare(hostile))
        assert service._worker.restarts == 1
        params = StructuredOutputParams(json_schema=SCHEMA)
        asyncio.run(service.prepare(params))
        assert params.compiled is not None
        state = manager.new_matcher(params)
        assert state.matcher.accept_string('{"name": "ab", "age": 3')
        assert not state.matcher.accept_string("]")
        bad = StructuredOutputParams(regex="(ab", check=False)  # checked in the worker: named
        with pytest.raises(ValueError, match=r"structured\.regex"):
            asyncio.run(service.prepare(bad))
    finally:
        service.close()


def test_grammar_text_size_is_bounded():
    from raylane.engine.structured_params import MAX_GRAMMAR_CHARS

    with pytest.raises(ValueError, match=r"structured\.regex: too large"):
        StructuredOutputParams(regex="a" * (MAX_GRAMMAR_CHARS + 1))


def test_a_replica_starts_its_grammar_forkserver_before_any_grammar_arrives():
    """Pools and gateways call `start_forkserver` when they start: the forkserver their grammar
    workers fork from (importing torch and xgrammar, seconds of CPU) then runs before the first
    request with a grammar, which would otherwise wait for it (a cold start measured 4.8 s, warm
    0.24 s, on the 2-core CI machine). In a fresh process, so no earlier test has started it."""
    import subprocess
    import sys

    script = """
import os, time
from raylane.bounded_worker import start_forkserver
from raylane.engine.grammar_compiler import COMPILE_PRELOAD
start_forkserver(COMPILE_PRELOAD)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    for pid in os.listdir("/proc"):
        try:
            parent = int(open(f"/proc/{pid}/stat").read().split(")")[-1].split()[1]) if pid.isdigit() else 0
            if parent != os.getpid():
                continue
            cmdline = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if "forkserver" in cmdline and "raylane.engine.structured_output" in cmdline:
            print("forkserver up")
            raise SystemExit
    time.sleep(0.2)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert out.stdout.strip() == "forkserver up", out.stderr[-2000:]


def test_a_pools_compiles_are_shared_per_key_and_a_failing_grammar_costs_the_worker_once(manager):
    """The key travels with the compile: a compile that ran out its time holds one of its key's
    places for as long again (other keys' places untouched), and the same grammar sent again, by
    anyone, is refused from the pool's memory of failures without reaching the worker."""
    import asyncio

    from raylane.engine.grammar_compiler import GrammarCompileService

    info = manager.tokenizer_info.serialize_json()

    async def fetch() -> str:
        return info

    async def main(service: GrammarCompileService) -> None:
        hostile = StructuredOutputParams(json_schema=nested_any_of(10), check=False)
        with pytest.raises(ValueError, match="too complex") as first:
            await service.prepare(hostile, tenant="A")
        assert service._worker.pending == {"A": 1} and service._worker.restarts == 1
        again = StructuredOutputParams(json_schema=nested_any_of(10), check=False)
        with pytest.raises(ValueError, match="too complex") as second:
            await service.prepare(again, tenant="B")
        assert str(second.value) == str(first.value) and service._worker.restarts == 1
        params = StructuredOutputParams(json_schema=SCHEMA)
        await service.prepare(params, tenant="B")
        assert params.compiled is not None

    service = GrammarCompileService(fetch, timeout_s=1.0)
    try:
        asyncio.run(main(service))
    finally:
        service.close()
