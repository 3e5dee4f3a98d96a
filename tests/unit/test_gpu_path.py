"""The GPU path's pieces that run on a CPU: KV-cache sizing after a profiling step, the draft
model's reservation, and NCCL's device binding. Where a test stands in for the GPU (a made-up memory
report, a recorded `init_process_group` call) it says so; `bench/gpu_check.sh` runs the real thing on
a GPU machine."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from raylane.config import EngineConfig, PoolConfig
from raylane.engine.memory_profile import DraftReservation, GiB, MemoryReport, kv_cache_split
from raylane.engine.model_runner import ModelRunner
from raylane.engine.request import Request
from raylane.engine.sampler import Sampler
from raylane.engine.sampling_params import SamplingParams
from raylane.engine.spec_decode.draft_model import draft_reservation
from raylane.parallel import state
from tests.hf_models import make_checkpoint

BLOCK = 2 * GiB // 1000  # a made-up KV block of ~2 MiB


def report(**overrides) -> MemoryReport:
    """Made-up numbers of an 80 GiB GPU after a 16 GiB model loaded and a profiling step peaked
    3 GiB above it (0.5 GiB of which was the profiling step's own small cache)."""
    values = dict(
        total_bytes=80 * GiB,
        free_bytes=62 * GiB,  # 18 GiB in use: the weights, the CUDA context, another process
        allocated_bytes=16 * GiB,
        peak_allocated_bytes=int(19.5 * GiB),
        profile_kv_bytes=GiB // 2,
    )
    return MemoryReport(**(values | overrides))


def test_kv_cache_leaves_room_for_a_full_steps_activations():
    split = kv_cache_split(report(), 0.9, BLOCK)
    assert split.activation_bytes == 3 * GiB  # the peak above the weights, less the throwaway cache
    used = split.in_use_bytes + split.activation_bytes + split.kv_bytes
    assert used <= 0.9 * 80 * GiB < used + BLOCK  # the cache fills the budget, one more block would not fit
    # Sizing from free memory alone (the old way) would have given the activations' 3 GiB to the cache.
    free_only = int(62 * GiB - 0.1 * 80 * GiB) // BLOCK
    assert free_only - split.num_blocks == pytest.approx(3 * GiB / BLOCK, abs=1)


def test_a_draft_model_on_the_same_gpu_gets_its_weights_and_a_matching_cache():
    draft = DraftReservation(weight_bytes=2 * GiB, block_bytes=BLOCK // 4)
    alone, shared = kv_cache_split(report(), 0.9, BLOCK), kv_cache_split(report(), 0.9, BLOCK, draft)
    assert shared.draft_bytes == 2 * GiB + shared.num_blocks * (BLOCK // 4)
    total = shared.in_use_bytes + shared.activation_bytes + shared.draft_bytes + shared.kv_bytes
    assert total <= 0.9 * 80 * GiB
    assert shared.num_blocks < alone.num_blocks


def test_the_decode_graphs_memory_comes_out_of_the_cache():
    """The graphs' pool is held beside every eager step's activations: the cache must leave it room."""
    plain, graphs = kv_cache_split(report(), 0.9, BLOCK), kv_cache_split(report(graph_bytes=GiB), 0.9, BLOCK)
    assert graphs.graph_bytes == GiB and "CUDA graphs 1.00" in graphs.describe()
    used = graphs.in_use_bytes + graphs.activation_bytes + graphs.graph_bytes + graphs.kv_bytes
    assert used <= 0.9 * 80 * GiB < used + BLOCK
    assert plain.num_blocks - graphs.num_blocks == pytest.approx(GiB / BLOCK, abs=1)


def test_no_room_for_the_cache_is_an_error_naming_the_setting_and_the_split():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.25 .*activations 3.00"):
        kv_cache_split(report(), 0.25, BLOCK)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


def test_profile_run_forwards_the_largest_step_and_lets_go_of_its_cache(checkpoint):
    """The profiling step itself, on CPU: `max_num_batched_tokens` (more than one context's worth,
    so two prompts) with logits for `max_num_seqs` rows; afterwards the real cache binds and the
    runner serves a normal step."""
    config = EngineConfig(model=checkpoint, max_num_batched_tokens=300, max_model_len=256, max_num_seqs=8)
    runner = ModelRunner(config)
    profile_kv = runner.profile_run()
    blocks = -(-256 // runner.block_size) + -(-44 // runner.block_size)
    assert profile_kv == (blocks + 1) * runner._block_bytes()  # and the scratch block
    assert all(layer.k_cache is None for layer in runner.model.attention_layers())
    runner.allocate_kv_cache(runner.available_kv_blocks())
    assert runner.num_blocks > blocks


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_draft_reservation_matches_what_the_loaded_draft_holds(checkpoint, tmp_path, kv_cache_dtype):
    """The reservation is computed before the draft loads (from its config, on the meta device): it
    must equal what the draft's runner then holds, weights and KV per block, the KV in the engine's
    cache dtype (a bfloat16 cache under a float32 model holds half the bytes)."""
    draft_path = str(make_checkpoint(tmp_path / "draft", "qwen3", num_hidden_layers=1))
    spec = dict(method="draft_model", num_speculative_tokens=2, model=draft_path)
    config = EngineConfig(
        model=checkpoint, speculative_config=spec, cpu_weight_prepack=False, kv_cache_dtype=kv_cache_dtype
    )
    draft_config = config.model_copy(update=dict(model=draft_path, speculative_config=None, block_size=32))
    draft = ModelRunner(draft_config)
    reservation = draft_reservation(config, draft.dtype, block_size=32, kv_dtype=draft.kv_dtype)
    assert reservation.weight_bytes == draft.weight_bytes()
    assert reservation.block_bytes == draft._block_bytes()


def test_nccl_binds_each_rank_to_its_gpu(monkeypatch):
    """No GPU here: `init_process_group` is recorded, not run, and the current CUDA device is made up."""
    calls = []

    class Recorded(Exception):
        pass

    def record(backend, **kwargs):
        calls.append((backend, kwargs))
        raise Recorded

    monkeypatch.setattr(state.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(state.dist, "init_process_group", record)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with pytest.raises(Recorded):
        state.init_distributed(0, 2, "tcp://127.0.0.1:1", backend="nccl")
    with pytest.raises(Recorded):
        state.init_distributed(0, 2, "tcp://127.0.0.1:1", backend="gloo")
    (nccl, nccl_kwargs), (gloo, gloo_kwargs) = calls
    assert nccl == "nccl" and nccl_kwargs["device_id"] == torch.device("cuda", 3)
    assert gloo == "gloo" and "device_id" not in gloo_kwargs


class HostReads(TorchFunctionMode):
    """Counts the ways a tensor's values reach Python: each one, on a GPU, waits for the device."""

    READS = {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__bool__,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
    }

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_steps_sampling_reads_back_only_the_token_ids():
    """Greedy, sampled, seeded, penalised and min_tokens rows in one batch: the sampler reads the
    logits' device once (the ids), however many rows sample; a GPU step then waits once. Its tokens
    are the ones each row's own settings give when sampled alone."""
    vocab = 64
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, seed=7, top_k=5),
        SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, min_tokens=4, stop_token_ids=[3]),
    ]
    requests = [
        Request(f"r{i}", [1, 2, 3], p, eos_token_ids=frozenset({2}), all_token_ids=[1, 2, 3, 5, 5, 9])
        for i, p in enumerate(params)
    ]
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(0))
    with HostReads() as mode:
        batched = Sampler(torch.Generator().manual_seed(1))(logits, requests)
    assert mode.reads == ["tolist"]
    assert all(0 <= t < vocab for t in batched.token_ids)
    assert batched.token_ids[4] not in (2, 3)  # min_tokens keeps EOS and the stop id out
    # Deterministic rows (greedy, seeded, penalised greedy) match the same request sampled alone.
    for row in (0, 2, 3):
        again = Request(
            f"a{row}", [1, 2, 3], params[row], eos_token_ids=frozenset({2}), all_token_ids=[1, 2, 3, 5, 5, 9]
        )
        alone = Sampler(torch.Generator().manual_seed(99))(logits[row : row + 1].clone(), [again])
        assert alone.token_ids[0] == batched.token_ids[row]


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_device_auto_reserves_a_gpu_per_rank_where_the_cluster_has_gpus(tensor_parallel_size):
    """No GPU here: the cluster's GPUs are a flag. An actor that reserves none sees none, so a pool
    on `device: auto` must reserve them, in-process (the replica) or one per rank's bundle."""
    from raylane.deployments.app import pool_deployment_options

    engine = {"device": "auto", "tensor_parallel_size": tensor_parallel_size}
    pool = PoolConfig.model_validate({"name": "chat", "model": "demo:raylane-llama-tiny", "engine": engine})
    on_gpus, on_cpus = pool_deployment_options(pool, cluster_has_gpus=True), pool_deployment_options(pool)
    assert [b.get("GPU", 0) for b in on_gpus["placement_group_bundles"]] == [1] * tensor_parallel_size
    assert all("GPU" not in b for b in on_cpus["placement_group_bundles"])
    if tensor_parallel_size == 1:
        assert on_gpus["ray_actor_options"]["num_gpus"] == 1 and on_cpus["ray_actor_options"]["num_gpus"] == 0
