"""Tensor- and expert-parallel engines on Ray actors (gloo on CPU) behave like one process.

Every worker group here is real: one Ray actor per rank in a placement group, joined over
torch.distributed, fed each step through a compiled graph. Greedy tokens must equal the
single-rank engine's and Hugging Face's; a killed rank must end requests with an error fast.
"""

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from raylane.engine import LLM, AsyncLLM, EngineConfig, EngineDeadError, SamplingParams
from raylane.engine.errors import InsufficientResourcesError
from raylane.engine.executor import UniProcExecutor
from raylane.engine.executor.placement import check_cluster_fits
from raylane.engine.executor.ray_distributed import RayDistributedExecutor
from raylane.engine.llm_engine import LLMEngine
from raylane.engine.model_runner import ModelInput
from tests.hf_models import make_checkpoint
from tests.unit.test_engine_vs_hf import NEW_TOKENS, hf_greedy, prompts

CPUS_PER_RANK = 0.25  # the session cluster is shared with Serve tests: keep every actor fractional
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
SCORED = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)  # every prompt position's logits
ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def engine_of(path, **settings):
    llm = LLM(str(path), num_kv_blocks=128, cpus_per_rank=CPUS_PER_RANK, **settings)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def assert_same_as_hf(outputs, expected, atol=2e-3):
    for out, (hf_tokens, hf_logprobs) in zip(outputs, expected, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == hf_tokens
        for step, entry in enumerate(completion.logprobs):
            for token_id, lp in entry.items():
                assert lp.logprob == pytest.approx(hf_logprobs[step][token_id].item(), abs=atol)


def generate_both(path, prompt_sets, **parallel):
    """(single-rank outputs, parallel outputs, the parallel executor's rank info)."""
    with engine_of(path) as single:
        assert isinstance(single.engine.executor, UniProcExecutor)
        ref = single.generate(prompt_sets, GREEDY)
    with engine_of(path, **parallel) as llm:
        out = llm.generate(prompt_sets, GREEDY)
        info = llm.engine.executor.rank_info
    return ref, out, info


@pytest.fixture(scope="module")
def kv1_llama(tmp_path_factory) -> Path:
    """One KV head: with two ranks each holds a replica of it."""
    return make_checkpoint(tmp_path_factory.mktemp("llama-kv1"), "llama", num_key_value_heads=1)


# --- same tokens as one rank and as Hugging Face ---------------------------------------------


@pytest.mark.parametrize(
    ("family", "tp", "ep"),
    [
        ("llama", 2, 1),
        ("qwen3", 2, 1),
        ("llama-kv1", 2, 1),
        ("mixtral", 1, 2),
        ("qwen3-moe", 1, 2),
        ("qwen3-moe", 2, 2),  # four ranks: two TP groups, experts split over both
    ],
)
def test_parallel_greedy_matches_single_rank_and_hf(ray_cluster, checkpoint, kv1_llama, family, tp, ep):
    path = kv1_llama if family == "llama-kv1" else checkpoint(family)
    prompt_sets = prompts(512)
    ref, out, info = generate_both(path, prompt_sets, tensor_parallel_size=tp, expert_parallel_size=ep)
    assert len(info) == tp * ep and len({i["placement_group_id"] for i in info}) == 1
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert_same_as_hf(out, hf_greedy(str(path), prompt_sets))


@pytest.mark.parametrize(
    ("name", "tp", "ep"), [("raylane-llama-tiny", 2, 1), ("raylane-qwen3-moe-tiny", 1, 2)]
)
def test_demo_models_in_parallel_match_single_rank_and_hf(ray_cluster, demo_models, name, tp, ep):
    path = demo_models[name]
    with engine_of(path) as single:
        tokenizer = single.get_tokenizer()
        prompt_sets = [
            tokenizer.encode(p) for p in ("Ray Serve scales", "def fibonacci(n):", "The capital of")
        ]
        ref = single.generate(prompt_sets, GREEDY)
        ref_scored = single.generate(prompt_sets, SCORED)
    with engine_of(path, tensor_parallel_size=tp, expert_parallel_size=ep) as llm:
        out = llm.generate(prompt_sets, GREEDY)
        scored = llm.generate(prompt_sets, SCORED)
        weights = [i["weight_bytes"] for i in llm.engine.executor.rank_info]
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]
    assert_same_as_hf(out, hf_greedy(str(path), prompt_sets))
    # Prompt logprobs: the prompt positions' logits rows come back from the ranks like the sampling rows.
    for got, want in zip(scored, ref_scored, strict=True):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) and got.prompt_logprobs[0] is None
        for ours, theirs in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert ours.keys() == theirs.keys()
            assert all(ours[t].logprob == pytest.approx(theirs[t].logprob, abs=2e-3) for t in ours)
    full = single.engine.runner.weight_bytes()
    assert max(weights) < 0.75 * full  # each rank holds a shard, not the model


def test_actor_call_broadcast_gives_the_same_logits(ray_cluster, checkpoint):
    """The slower per-rank actor calls (kept for the benchmark) run the same step."""
    config = EngineConfig(
        model=checkpoint("llama"), num_kv_blocks=16, tensor_parallel_size=2, cpus_per_rank=CPUS_PER_RANK
    )
    batch = ModelInput(
        token_ids=list(range(5, 25)),
        positions=list(range(20)),
        block_tables=[[3, 7]],
        context_lens=[20],
        query_lens=[20],
        sample_indices=[4, 19],
    )
    expected = UniProcExecutor(config.model_copy(update={"tensor_parallel_size": 1})).execute_model(batch)
    executor = RayDistributedExecutor(config, compiled_graph=False)
    try:
        torch.testing.assert_close(executor.execute_model(batch), expected, atol=1e-4, rtol=0)
    finally:
        executor.shutdown()


def test_ranks_get_raylane_settings_but_never_the_api_keys(ray_cluster, checkpoint, monkeypatch, tmp_path):
    """A rank actor's runtime_env is kept in the GCS and shown by Ray's dashboard and state API, and
    its process runs model code: the serving process's API keys must not be copied into it."""
    import ray

    monkeypatch.setenv("RAYLANE_API_KEYS", "sk-tenant-secret premium")  # api_keys.env in k8s/configs
    monkeypatch.setenv("RAYLANE_API_KEY", "sk-ops-secret")  # the ops jobs' key
    monkeypatch.setenv("RAYLANE_CACHE_DIR", str(tmp_path))  # a setting the ranks read
    # A runtime_env of its own means fresh worker processes (torch imports): on a loaded machine
    # they take longer than the default minute to come up.
    config = EngineConfig(
        model=checkpoint("llama"),
        num_kv_blocks=16,
        tensor_parallel_size=2,
        cpus_per_rank=CPUS_PER_RANK,
        placement_timeout_s=300,
    )
    executor = RayDistributedExecutor(config, compiled_graph=False)

    def seen(_worker) -> tuple[dict, dict]:
        import os

        env = {k: v for k, v in os.environ.items() if k.startswith("RAYLANE_")}
        return env, ray.get_runtime_context().runtime_env.get("env_vars", {})

    try:
        for worker in executor.workers:
            env, runtime_env = ray.get(worker.__ray_call__.remote(seen))
            assert env.get("RAYLANE_CACHE_DIR") == str(tmp_path)
            for secret in ("sk-tenant-secret premium", "sk-ops-secret"):
                assert secret not in env.values() and secret not in runtime_env.values()
    finally:
        executor.shutdown()


# --- failures ----------------------------------------------------------------------------


async def test_killed_rank_ends_requests_with_an_error_and_fails_health(ray_cluster, checkpoint):
    import ray

    engine = AsyncLLM(
        model=checkpoint("llama"), num_kv_blocks=64, tensor_parallel_size=2, cpus_per_rank=CPUS_PER_RANK
    )
    await engine.check_health()
    progress = [0, 0]

    async def run(i: int):
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async for out in engine.generate(list(range(3 + i, 40 + i)), params):
            progress[i] = len(out.outputs[0].token_ids)

    tasks = [asyncio.create_task(run(i)) for i in range(2)]
    while min(progress) < 3:  # both requests are decoding
        await asyncio.sleep(0.01)
    killed_at = time.monotonic()
    ray.kill(engine.engine.executor.workers[1])
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert time.monotonic() - killed_at < 30
    for result in results:
        assert isinstance(result, EngineDeadError) and "rank 1 of 2" in str(result)
    assert max(progress) < 400
    with pytest.raises(EngineDeadError, match="rank 1 of 2"):
        await asyncio.wait_for(engine.check_health(), timeout=10)
    with pytest.raises(EngineDeadError):  # a new request fails at once instead of hanging
        await asyncio.wait_for(anext(engine.generate([5, 6, 7])), timeout=10)
    engine.shutdown()


def test_rank_killed_while_idle_fails_health_and_the_next_request(ray_cluster, checkpoint):
    import ray

    config = EngineConfig(
        model=checkpoint("llama"), num_kv_blocks=64, tensor_parallel_size=2, cpus_per_rank=CPUS_PER_RANK
    )
    engine = LLMEngine(config)
    engine.check_health()
    ray.kill(engine.executor.workers[0])  # the rank that returns logits; the kill lands asynchronously
    deadline = time.monotonic() + 20
    while True:
        try:
            engine.check_health()
        except EngineDeadError as e:
            assert "rank 0 of 2 died" in str(e)
            break
        assert time.monotonic() < deadline, "check_health did not notice the dead rank"
        time.sleep(0.05)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(EngineDeadError, match="rank 0 of 2 died"):
        engine.step()
    engine.shutdown()


def test_more_ranks_than_resources_fails_fast_naming_what_is_missing(ray_cluster, checkpoint):
    groups_before = len(ray_cluster.util.placement_group_table())
    start = time.monotonic()
    with pytest.raises(
        InsufficientResourcesError, match=r"need CPU: 24 \(12 per rank\).*cluster has CPU: 16"
    ):
        LLM(checkpoint("llama"), tensor_parallel_size=2, cpus_per_rank=12)
    with pytest.raises(InsufficientResourcesError, match=r"need GPU: 2 \(1 per rank\).*cluster has GPU: 0"):
        LLM(checkpoint("llama"), tensor_parallel_size=2, cpus_per_rank=CPUS_PER_RANK, device="cuda")
    assert time.monotonic() - start < 10
    assert len(ray_cluster.util.placement_group_table()) == groups_before  # nothing was reserved


def test_sizes_the_model_cannot_be_split_into_are_refused(checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not split 4 attention heads"):
        LLM(checkpoint("llama"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="expert_parallel_size: LlamaForCausalLM has no experts"):
        LLM(checkpoint("llama"), expert_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size: 3 does not split 4 experts"):
        LLM(checkpoint("mixtral"), expert_parallel_size=3)


@pytest.mark.parametrize(
    ("nodes", "strategy", "message"),
    [
        ([{"CPU": 1}, {"CPU": 1}], "STRICT_PACK", "no node holds 2 x {CPU: 0.6}.*PACK or SPREAD"),
        ([{"CPU": 4}], "STRICT_SPREAD", "only 1 nodes hold {CPU: 0.6}"),
        ([{"CPU": 1}, {"CPU": 0.5}], "SPREAD", r"the nodes together hold 1"),
    ],
)
def test_placement_checks_name_the_strategy_that_cannot_fit(nodes, strategy, message):
    with pytest.raises(InsufficientResourcesError, match=message):
        check_cluster_fits(nodes, {"CPU": 0.6}, 2, strategy)
    check_cluster_fits([{"CPU": 2}, {"CPU": 2}], {"CPU": 0.6}, 2, strategy)


# --- placement groups from outside: handed in, or the one the caller runs in -------------------


def test_engine_uses_a_placement_group_handed_in(ray_cluster, checkpoint):
    ray = ray_cluster
    pg = ray.util.placement_group([{"CPU": CPUS_PER_RANK}] * 2)
    ray.get(pg.ready(), timeout=30)
    config = EngineConfig(
        model=checkpoint("qwen3"), num_kv_blocks=64, tensor_parallel_size=2, cpus_per_rank=CPUS_PER_RANK
    )
    engine = LLMEngine(config, placement_group=pg)
    try:
        assert {i["placement_group_id"] for i in engine.executor.rank_info} == {pg.id.hex()}
        engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_health()
    finally:
        engine.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "CREATED"  # not ours to remove
    ray.util.remove_placement_group(pg)


def test_engine_inside_an_actor_uses_that_actors_placement_group(ray_cluster, checkpoint):
    """What a Serve replica with `placement_group_bundles` does: bundle 0 holds it and rank 0."""
    ray = ray_cluster
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0.1)
    class Replica:
        def run(self, model: str) -> tuple[list[int], list[str]]:
            llm = LLM(model, num_kv_blocks=64, tensor_parallel_size=2, cpus_per_rank=CPUS_PER_RANK)
            out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            pg_ids = [i["placement_group_id"] for i in llm.engine.executor.rank_info]
            llm.engine.shutdown()
            return out[0].outputs[0].token_ids, pg_ids

    pg = ray.util.placement_group([{"CPU": 0.1 + CPUS_PER_RANK}, {"CPU": CPUS_PER_RANK}])
    ray.get(pg.ready(), timeout=30)
    replica = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    try:
        tokens, pg_ids = ray.get(replica.run.remote(checkpoint("llama")), timeout=120)
    finally:
        ray.kill(replica)
        ray.util.remove_placement_group(pg)
    assert pg_ids == [pg.id.hex()] * 2
    single = LLM(checkpoint("llama"), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert tokens == single.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids


def run_with_its_own_ray(script: str, *args: str) -> dict:
    """Run `script` (which starts a Ray of its own) in a subprocess; the dict it printed as RESULT."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULT "))


# --- a group spread over two nodes -------------------------------------------------------------

TWO_NODES = """
import json, sys
import ray
from ray.cluster_utils import Cluster
from raylane.engine import LLM, SamplingParams
from raylane.engine.errors import InsufficientResourcesError

path = sys.argv[1]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)  # a second raylet: a second node on the same machine
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
result = {}
try:
    LLM(path, tensor_parallel_size=2, cpus_per_rank=0.6)  # STRICT_PACK: no node holds both ranks
except InsufficientResourcesError as e:
    result["strict_pack_error"] = str(e)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
llm = LLM(path, num_kv_blocks=64, tensor_parallel_size=2, cpus_per_rank=0.6, placement_strategy="SPREAD")
result["nodes"] = [info["node_id"] for info in llm.engine.executor.rank_info]
result["tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
llm.engine.shutdown()
result["single"] = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64).generate(prompts, params)]
ray.shutdown()
cluster.shutdown()
print("RESULT " + json.dumps(result))
"""


def test_spread_places_a_tensor_parallel_group_across_two_nodes(checkpoint):
    """Its own Ray (two raylets on this machine) in a subprocess: the session's Ray stays one node."""
    result = run_with_its_own_ray(TWO_NODES, checkpoint("llama"))
    assert "STRICT_PACK" in result["strict_pack_error"] and "SPREAD" in result["strict_pack_error"]
    assert len(set(result["nodes"])) == 2
    assert result["tokens"] == result["single"]


# --- a draft model beside tensor-parallel ranks, on a Serve replica's bundles ---------------------

FAKE_GPUS = """
import json, sys
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from raylane.config import PoolConfig
from raylane.deployments.app import pool_deployment_options

path = sys.argv[1]
# Ray is told of two GPUs this machine does not have: it schedules and sets CUDA_VISIBLE_DEVICES as on a
# GPU node, and the ranks, finding no CUDA, run on the CPU (gloo).
ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
engine = dict(tensor_parallel_size=2, cpus_per_rank=0.25, distributed_backend="gloo",
              num_kv_blocks=64, speculative_config=spec)
pool = PoolConfig.model_validate({"name": "chat", "model": path, "engine": engine})
options = pool_deployment_options(pool, cluster_has_gpus=True)
pg = ray.util.placement_group(options["placement_group_bundles"], strategy="STRICT_PACK")
ray.get(pg.ready(), timeout=60)


def refusal(rank0):
    from raylane.engine.executor.ray_distributed import draft_device

    try:
        return str(draft_device(rank0))
    except Exception as e:
        return f"{type(e).__name__}: {e}"


@ray.remote
class Replica:
    def run(self):
        from raylane.engine import LLM, SamplingParams
        from raylane.engine.executor.ray_distributed import draft_device

        llm = LLM(path, **engine)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.spec_decode_stats
        rank0 = llm.engine.executor.rank_info[0]
        on_a_gpu = dict(rank0, device="cuda:0")  # what rank 0 reports on a real GPU
        result = {
            "replica_gpus": ray.get_gpu_ids(),
            "rank_gpus": [info["gpu_ids"] for info in llm.engine.executor.rank_info],
            "draft_device": str(llm.engine.executor.draft_device),
            "draft_device_on_a_gpu": str(draft_device(on_a_gpu)),
            "rank_1s_gpu": refusal(dict(on_a_gpu, gpu_ids=llm.engine.executor.rank_info[1]["gpu_ids"])),
            "tokens": tokens,
            "drafted": stats.num_draft_tokens,
            "accepted": stats.num_accepted_tokens,
        }
        llm.engine.shutdown()
        plain = LLM(path, num_kv_blocks=64).generate(prompts, params)
        result["plain"] = [o.outputs[0].token_ids for o in plain]
        return result


strategy = PlacementGroupSchedulingStrategy(pg, 0)
replica = Replica.options(**options["ray_actor_options"], scheduling_strategy=strategy).remote()
print("RESULT " + json.dumps(ray.get(replica.run.remote(), timeout=240)))
ray.shutdown()
"""


def test_a_draft_model_shares_rank_0s_gpu_with_the_replica_that_runs_it(checkpoint):
    """A Serve replica of a tensor-parallel pool with a draft model: the replica runs the draft, so
    it reserves a share of bundle 0's GPU, and rank 0 the rest; Ray shows both the same GPU. The
    GPUs are Ray's count only (its own Ray in a subprocess, told of two GPUs), the model runs on CPU:
    the speculative tokens equal plain decoding's, and the draft device rank 0's GPU would give is
    that GPU as the replica sees it, and one it cannot see is an error."""
    result = run_with_its_own_ray(FAKE_GPUS, checkpoint("llama"))
    assert len(result["replica_gpus"]) == 1 and result["rank_gpus"][0] == result["replica_gpus"]
    assert result["rank_gpus"][1] != result["rank_gpus"][0]
    assert result["draft_device"] == "cpu"  # the ranks found no CUDA
    assert result["draft_device_on_a_gpu"] == "cuda:0"  # the one GPU the replica sees
    # A draft beside a rank whose GPU this process cannot see is refused, naming the setting.
    assert result["rank_1s_gpu"].startswith("InsufficientResourcesError: speculative_config: ")
    assert result["tokens"] == result["plain"]
    assert result["accepted"] == result["drafted"] > 0  # the draft is the target itself


@pytest.mark.parametrize("family", ["qwen3", "llama-kv1"])
def test_lora_adapters_under_tensor_parallelism_give_peft_greedy_output(
    ray_cluster, checkpoint, kv1_llama, family, tmp_path
):
    """Two ranks, each holding its shard of every adapter (A's input columns on o/down, B's output
    rows on q/k/v/gate/up, a KV head's B on both ranks that replicate it): a batch mixing the base
    model and two adapters gives each prompt PEFT's greedy answer."""
    from raylane.engine import LoRARequest
    from tests.unit.test_lora import ADAPTERS, PROMPTS, greedy, make_adapter, peft_greedy

    path = str(kv1_llama) if family == "llama-kv1" else checkpoint(family)
    loras = [None] + [
        LoRARequest(name, i + 1, str(make_adapter(path, tmp_path / name, i, *ADAPTERS[name])))
        for i, name in enumerate(["attn-r4", "all-r8"])
    ]
    with engine_of(path, tensor_parallel_size=2, enable_lora=True) as llm:
        outs = llm.generate(PROMPTS * len(loras), greedy(), lora_request=[x for x in loras for _ in PROMPTS])
    got = [list(out.outputs[0].token_ids) for out in outs]
    assert got == [tokens for lora in loras for tokens in peft_greedy(path, lora)]
