"""Mixture-of-experts families: Mixtral and Qwen3-MoE.

Both route each token to its top-k experts by a softmax over a replicated router
gate, then run `raylane.parallel.moe.FusedMoE`, which holds this expert-parallel rank's
experts. They differ in whether the top-k weights are renormalised and in which
layers are sparse.
"""

import torch
from torch import nn
from transformers import PreTrainedConfig

from raylane.models.decoder import MLP, DecoderForCausalLM
from raylane.parallel.layers import ReplicatedLinear
from raylane.parallel.moe import FusedMoE, topk_softmax


class SparseMoeBlock(nn.Module):
    """Router gate (replicated on every rank) + this rank's experts."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str = "silu",
    ):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = topk_softmax(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, topk_ids, topk_weights)


class MixtralForCausalLM(DecoderForCausalLM):
    """Every layer is sparse; the top-k weights always sum to one."""

    expert_weight_names = {"gate": "w1", "up": "w3", "down": "w2"}
    # Published checkpoints say `block_sparse_moe`; transformers 5 renamed the module `mlp`.
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    def make_mlp(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
            hidden_act=config.hidden_act,
        )


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Sparse every `decoder_sparse_step`-th layer except `mlp_only_layers`; optional renormalisation."""

    qk_norm = True
    expert_weight_names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

    def make_mlp(self, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        sparse = (
            layer_idx not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        )
        if not sparse:
            return MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            hidden_act=config.hidden_act,
        )
