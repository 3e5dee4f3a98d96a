"""torch.distributed groups, tensor-parallel layers and the expert-parallel MoE layer."""
