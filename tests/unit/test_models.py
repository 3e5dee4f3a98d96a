"""Models and parallel layers against Hugging Face transformers on tiny random checkpoints.

Our models run the engine's way (flattened tokens of several requests, a paged KV
cache, chunked prefill, one-token decode steps); every logit must match the HF
model's plain forward over the whole sequence.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

from raylane.models import MissingWeightError, UnsupportedModelError, build_attention_metadata, load_model
from raylane.models.decoder import MLP
from raylane.models.moe import SparseMoeBlock
from raylane.parallel import state
from raylane.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from raylane.parallel.moe import FusedMoE
from tests.hf_models import FAMILIES, VOCAB_SIZE, load_hf_model, make_checkpoint

BLOCK_SIZE, NUM_BLOCKS = 16, 64
ATOL = 1e-4


class PagedRunner:
    """Drives a model like the engine: KV caches bound per layer, one flattened batch per step.

    Sequence s owns blocks scattered over the cache (not contiguous), so a wrong
    slot mapping or block table shows up as wrong logits.
    """

    def __init__(self, model):
        self.model = model
        shape = (NUM_BLOCKS, *model.kv_cache_shape_per_block(BLOCK_SIZE))
        dtype = model.lm_head.weight.dtype
        for attn in model.attention_layers():
            attn.bind_kv_cache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    @staticmethod
    def block_table(seq_id: int) -> list[int]:
        return [NUM_BLOCKS - 1 - (seq_id + 4 * k) for k in range(8)]

    @torch.no_grad()
    def step(self, batch: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """batch: (seq_id, all tokens so far, how many at the end are new) -> logits of the new ones."""
        ids = torch.tensor([t for _, tokens, n in batch for t in tokens[len(tokens) - n :]])
        positions = torch.cat([torch.arange(len(tokens) - n, len(tokens)) for _, tokens, n in batch])
        meta = build_attention_metadata(
            [self.block_table(s) for s, _, _ in batch],
            [len(tokens) for _, tokens, _ in batch],
            [n for _, _, n in batch],
            BLOCK_SIZE,
            sliding_window=self.model.sliding_window,
        )
        logits = self.model.compute_logits(self.model(ids, positions, meta))
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), VOCAB_SIZE)
        return list(logits.split([n for _, _, n in batch]))


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family_ckpt(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, make_checkpoint(tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


# --- every family against HF ---------------------------------------------------------


def test_batched_prefill_matches_hf(family_ckpt):
    _, path = family_ckpt
    model, _ = load_model(path)
    hf = load_hf_model(path)
    prompts = [prompt(5, 1), prompt(33, 2), prompt(17, 3)]  # cross block boundaries
    outs = PagedRunner(model).step([(i, p, len(p)) for i, p in enumerate(prompts)])
    for p, out in zip(prompts, outs, strict=True):
        torch.testing.assert_close(out, hf_logits(hf, p), atol=ATOL, rtol=0)


def test_decode_through_cache_matches_hf(family_ckpt):
    _, path = family_ckpt
    model, _ = load_model(path)
    hf = load_hf_model(path)
    runner = PagedRunner(model)
    seqs = [prompt(7, 4), prompt(20, 5)]
    last = runner.step([(i, s, len(s)) for i, s in enumerate(seqs)])
    for _ in range(6):  # both requests decode in the same step, greedily
        for seq, logits in zip(seqs, last, strict=True):
            seq.append(int(logits[-1].argmax()))
        last = runner.step([(i, s, 1) for i, s in enumerate(seqs)])
        for seq, logits in zip(seqs, last, strict=True):
            torch.testing.assert_close(logits[0], hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_hf(family_ckpt):
    _, path = family_ckpt
    model, _ = load_model(path)
    hf = load_hf_model(path)
    runner = PagedRunner(model)
    long, short = prompt(40, 6), prompt(9, 7)
    first = runner.step([(0, long[:23], 23)])[0]
    # The second chunk shares its step with another request's whole prefill.
    second, other = runner.step([(0, long, 17), (1, short, 9)])
    ref = hf_logits(hf, long)
    torch.testing.assert_close(first, ref[:23], atol=ATOL, rtol=0)
    torch.testing.assert_close(second, ref[23:], atol=ATOL, rtol=0)
    torch.testing.assert_close(other, hf_logits(hf, short), atol=ATOL, rtol=0)


def test_model_interface(family_ckpt):
    family, path = family_ckpt
    model, config = load_model(path)
    assert model.num_layers == len(model.attention_layers()) == config.num_hidden_layers
    assert model.kv_cache_shape_per_block(BLOCK_SIZE) == (BLOCK_SIZE, 2, 16)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (family == "llama-tied")


def test_loads_in_bfloat16(llama_ckpt):
    model, _ = load_model(llama_ckpt, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    p = prompt(12, 8)
    out = PagedRunner(model).step([(0, p, 12)])[0]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, hf_logits(load_hf_model(llama_ckpt), p), atol=0.3, rtol=0)


# --- MoE checkpoint layouts and Qwen3-MoE options ----------------------------------------


def tensor_names(path: Path) -> list[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize(
    ("family", "per_expert_name"),
    [
        ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w3.weight"),
        ("qwen3-moe", "model.layers.0.mlp.experts.3.up_proj.weight"),
    ],
)
def test_per_expert_and_fused_expert_layouts_load(tmp_path, family, per_expert_name):
    per_expert = make_checkpoint(tmp_path / "per_expert", family)
    assert per_expert_name in tensor_names(per_expert)  # what published checkpoints look like
    fused = tmp_path / "fused"
    load_hf_model(per_expert).save_pretrained(fused, save_original_format=False)
    names = tensor_names(fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)

    p = prompt(21, 9)
    ref = hf_logits(load_hf_model(per_expert), p)
    for path in (per_expert, fused):
        out = PagedRunner(load_model(path)[0]).step([(0, p, len(p))])[0]
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "sparse_layers"),
    [
        ({"norm_topk_prob": False}, [0, 1]),
        ({"mlp_only_layers": [0]}, [1]),
        ({"decoder_sparse_step": 2}, [1]),
    ],
)
def test_qwen3_moe_options(tmp_path, overrides, sparse_layers):
    path = make_checkpoint(tmp_path, "qwen3-moe", **overrides)
    model, _ = load_model(path)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock if i in sparse_layers else MLP for i in range(2)]
    p = prompt(19, 10)
    out = PagedRunner(model).step([(0, p, len(p))])[0]
    torch.testing.assert_close(out, hf_logits(load_hf_model(path), p), atol=ATOL, rtol=0)


# --- loading: sharded checkpoints and errors ---------------------------------------------


def test_sharded_checkpoint_loads(tmp_path, llama_ckpt):
    with safe_open(llama_ckpt / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (tmp_path / "config.json").write_text((llama_ckpt / "config.json").read_text())

    p = prompt(15, 11)
    sharded = PagedRunner(load_model(tmp_path)[0]).step([(0, p, 15)])[0]
    single = PagedRunner(load_model(llama_ckpt)[0]).step([(0, p, 15)])[0]
    torch.testing.assert_close(sharded, single, atol=0, rtol=0)


def test_unsupported_architecture_names_it(tmp_path, llama_ckpt):
    config = json.loads((llama_ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(llama_ckpt / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as err:
        load_model(tmp_path)
    assert "LlamaForCausalLM" in str(err.value) and "Qwen3MoeForCausalLM" in str(err.value)


@pytest.mark.parametrize(
    ("family", "dropped"),
    [
        ("llama", "model.layers.1.self_attn.k_proj.weight"),
        ("llama", "model.norm.weight"),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.2.w3.weight"),
        ("qwen3-moe", "model.layers.1.self_attn.q_norm.weight"),
    ],
)
def test_missing_tensor_names_it(tmp_path, family, dropped):
    path = make_checkpoint(tmp_path, family)
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != dropped}  # noqa: SIM118
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingWeightError, match=dropped.replace(".", r"\.")):
        load_model(path)


def test_tied_checkpoint_without_lm_head_loads(tmp_path):
    path = make_checkpoint(tmp_path, "llama-tied")
    assert "lm_head.weight" not in tensor_names(path)
    model, _ = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_files_name_the_path(tmp_path, llama_ckpt):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((llama_ckpt / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "model.safetensors")):
        load_model(tmp_path)


# --- shard math of the parallel layers, every rank simulated in one process ---------------


def test_parallel_state_defaults_to_one_process():
    assert (state.get_tp_rank(), state.get_tp_size(), state.get_tp_group()) == (0, 1, None)
    assert (state.get_ep_rank(), state.get_ep_size(), state.get_ep_group()) == (0, 1, None)
    x = torch.randn(3, 4)
    assert state.tensor_model_parallel_all_reduce(x) is x
    assert state.tensor_model_parallel_all_gather(x, dim=-1) is x


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_qkv_parallel_linear_shards(tp_size):
    """8 query heads, 2 KV heads: at tp 4 and 8 each KV head is replicated on 2 and 4 ranks."""
    hidden, head, heads, kv_heads = 32, 4, 8, 2
    torch.manual_seed(0)
    wq, wk, wv = (
        torch.randn(heads * head, hidden),
        torch.randn(kv_heads * head, hidden),
        torch.randn(8, hidden),
    )
    bq, bk, bv = torch.randn(heads * head), torch.randn(kv_heads * head), torch.randn(kv_heads * head)
    x = torch.randn(5, hidden)
    full_q, full_k, full_v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    qs = []
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True, tp_rank=rank, tp_size=tp_size)
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        qs.append(q)
        # This rank's query heads are [rank*n, (rank+1)*n); their KV head is head // (heads // kv_heads).
        kv_head = rank * layer.num_heads // (heads // kv_heads)
        kv_cols = slice(kv_head * head, (kv_head + layer.num_kv_heads) * head)
        torch.testing.assert_close(k, full_k[:, kv_cols])
        torch.testing.assert_close(v, full_v[:, kv_cols])
    torch.testing.assert_close(torch.cat(qs, dim=-1), full_q)


def test_merged_column_and_row_parallel_reproduce_the_mlp():
    hidden, inter, tp_size = 16, 24, 4
    torch.manual_seed(0)
    w_gate, w_up, w_down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(3, hidden)
    full = (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T
    partial_sums = []
    for rank in range(tp_size):
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], tp_rank=rank, tp_size=tp_size)
        gate_up.weight.weight_loader(gate_up.weight, w_gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, w_up, 1)
        down = RowParallelLinear(inter, hidden, tp_rank=rank, tp_size=tp_size)
        down.weight.weight_loader(down.weight, w_down)
        gate, up = gate_up(x).chunk(2, dim=-1)
        partial_sums.append(down(torch.nn.functional.silu(gate) * up))  # all-reduce is a no-op here
    torch.testing.assert_close(sum(partial_sums), full)


def test_row_parallel_bias_is_added_once():
    layer = RowParallelLinear(8, 4, bias=True, tp_rank=1, tp_size=2)
    bias = torch.randn(4)
    layer.bias.weight_loader(layer.bias, bias)
    layer.weight.weight_loader(layer.weight, torch.zeros(4, 8))
    assert layer.weight.shape == (4, 4)
    torch.testing.assert_close(layer(torch.randn(2, 4)), bias.expand(2, 4))


def test_vocab_parallel_embedding_and_lm_head_shards():
    """Vocab 10 over 4 ranks: shards of 3 rows, the last one padded."""
    vocab, dim, tp_size = 10, 6, 4
    weight, ids, hidden = torch.randn(vocab, dim), torch.tensor([0, 3, 5, 9, 2]), torch.randn(2, dim)
    embedded, logits = [], []
    for rank in range(tp_size):
        embed = VocabParallelEmbedding(vocab, dim, tp_rank=rank, tp_size=tp_size)
        embed.weight.weight_loader(embed.weight, weight)
        head = ParallelLMHead(vocab, dim, tp_rank=rank, tp_size=tp_size)
        head.weight.weight_loader(head.weight, weight)
        embedded.append(embed(ids))  # rows of other ranks' ids are zero; all-reduce is a no-op here
        logits.append(head(hidden))
    torch.testing.assert_close(sum(embedded), weight[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], hidden @ weight.T)


def test_fused_moe_uneven_expert_split_raises():
    with pytest.raises(ValueError, match="6 experts"):
        FusedMoE(num_experts=6, top_k=2, hidden_size=8, intermediate_size=4, ep_rank=0, ep_size=4)


def test_fused_moe_expert_parallel_ranks_sum_to_the_full_layer():
    experts, hidden, inter = 4, 8, 6
    torch.manual_seed(0)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    x = torch.randn(7, hidden)
    weights, ids = torch.rand(7, 2), torch.stack([torch.randperm(experts)[:2] for _ in range(7)])

    def run(ep_rank: int, ep_size: int, per_expert: bool) -> torch.Tensor:
        moe = FusedMoE(experts, 2, hidden, inter, ep_rank=ep_rank, ep_size=ep_size)
        if per_expert:
            for e in range(experts):  # other ranks' experts are skipped by the loader
                moe.w13.weight_loader(moe.w13, w13[e, :inter], "gate", e)
                moe.w13.weight_loader(moe.w13, w13[e, inter:], "up", e)
                moe.w2.weight_loader(moe.w2, w2[e], "down", e)
        else:
            moe.w13.weight_loader(moe.w13, w13)
            moe.w2.weight_loader(moe.w2, w2)
        return moe(x, ids, weights)

    full = run(0, 1, per_expert=False)
    torch.testing.assert_close(run(0, 2, True) + run(1, 2, True), full)
    torch.testing.assert_close(run(0, 2, False) + run(1, 2, False), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_grouped_path_matches_the_per_expert_path(dtype):
    """The CUDA path (both expert GEMMs as grouped GEMMs, no host sync) against the per-expert loop,
    run here on CPU, where `F.grouped_mm` has a reference implementation. Under expert parallelism,
    with experts that get no token and pairs routed to the other rank, both must agree."""
    experts, hidden, inter, tokens = 8, 16, 8, 11
    torch.manual_seed(1)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    x = torch.randn(tokens, hidden, dtype=dtype)
    ids = torch.stack([torch.randperm(experts - 2)[:2] for _ in range(tokens)])  # experts 6, 7 idle
    weights = torch.rand(tokens, 2)
    for ep_rank, ep_size in [(0, 1), (0, 2), (1, 2)]:
        moe = FusedMoE(experts, 2, hidden, inter, ep_rank=ep_rank, ep_size=ep_size).to(dtype)
        moe.w13.weight_loader(moe.w13, w13.to(dtype))
        moe.w2.weight_loader(moe.w2, w2.to(dtype))
        tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
        grouped = moe._forward_grouped(x, ids, weights)
        torch.testing.assert_close(grouped, moe._forward_per_expert(x, ids, weights), **tol)
        assert grouped.abs().sum() > 0


# --- real tensor and expert parallelism: 2 gloo ranks --------------------------------------


def _tp_worker(rank: int, world_size: int, init_method: str, checkpoints: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    state.init_distributed(rank, world_size, init_method, backend="gloo")
    try:
        for name, path in checkpoints.items():
            model, _ = load_model(path)
            prompts = [prompt(9, 12), prompt(20, 13)]
            outs = PagedRunner(model).step([(i, p, len(p)) for i, p in enumerate(prompts)])
            torch.save([o.clone() for o in outs], Path(out_dir) / f"{name}-rank{rank}.pt")
    finally:
        state.destroy_distributed()


def test_two_ranks_over_gloo_match_hf(tmp_path):
    """TP=2 over attention, MLPs and each expert's intermediate size; `llama-kv1` has 1 KV head,
    so both ranks replicate it. (Expert parallelism runs through the engine in tests/integration.)"""
    checkpoints = {
        "llama": make_checkpoint(tmp_path / "llama", "llama"),
        "llama-kv1": make_checkpoint(tmp_path / "llama-kv1", "llama", num_key_value_heads=1),
        "qwen2": make_checkpoint(tmp_path / "qwen2", "qwen2"),
        "mixtral": make_checkpoint(tmp_path / "mixtral", "mixtral"),
        "qwen3-moe": make_checkpoint(tmp_path / "qwen3-moe", "qwen3-moe"),
    }
    init = f"file://{tmp_path / 'dist-init'}"
    mp.spawn(_tp_worker, args=(2, init, checkpoints, str(tmp_path)), nprocs=2, join=True)
    prompts = [prompt(9, 12), prompt(20, 13)]
    for name, path in checkpoints.items():
        hf = load_hf_model(path)
        for rank in range(2):  # every rank ends with the full, identical logits
            outs = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            for p, out in zip(prompts, outs, strict=True):
                torch.testing.assert_close(
                    out, hf_logits(hf, p), atol=ATOL, rtol=0, msg=f"{name} rank {rank}"
                )


def test_sliding_window_attention_matches_hf(tmp_path):
    path = make_checkpoint(tmp_path, "mixtral", sliding_window=8)
    model, _ = load_model(path)
    assert model.sliding_window == 8
    runner, long = PagedRunner(model), prompt(30, 14)
    first = runner.step([(0, long[:20], 20)])[0]
    second = runner.step([(0, long, 10)])[0]
    ref = hf_logits(load_hf_model(path), long)
    torch.testing.assert_close(torch.cat([first, second]), ref, atol=ATOL, rtol=0)


def test_mixed_sliding_and_full_attention_layers_are_refused(tmp_path):
    path = make_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding-window and full attention"):
        load_model(path)


def test_the_mlp_activations_are_transformers_own_and_an_unknown_one_is_named():
    """raylane's activation table (kept apart from transformers.activations for start-up time)
    computes what transformers' ACT2FN does for each name it accepts."""
    from transformers.activations import ACT2FN

    from raylane.models.decoder import ACTIVATIONS

    x = torch.randn(64, 32) * 4
    for name, fn in ACTIVATIONS.items():
        torch.testing.assert_close(fn(x), ACT2FN[name](x), msg=name)
    with pytest.raises(ValueError, match="hidden_act 'mish'"):
        MLP(32, 64, "mish")
