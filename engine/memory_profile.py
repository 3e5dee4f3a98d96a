"""How much of a GPU the KV cache gets: the arithmetic after a profiling run, as vLLM sizes it.

Sizing the cache from free memory alone (what was free after the weights loaded) leaves no room for
the activations of a full step, and a first large batch then runs out of memory. So the runner first
forwards a dummy batch of `max_num_batched_tokens` tokens (the largest step the scheduler can make)
and reads the allocator's peak; the cache gets what is left under `gpu_memory_utilization` once
everything in use now, that peak, the decode CUDA graphs' memory (the largest graph captured once on a
throwaway cache: the others share its pool) and a draft model are counted. The numbers come in a
`MemoryReport` (from `torch.cuda` on a GPU; tests pass made-up ones), so this module is pure
arithmetic and runs anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """One device's memory after the weights loaded and the profiling step ran."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free now, as the driver says (other processes and the CUDA context count as used)
    allocated_bytes: int  # held by this process's tensors now (the weights)
    peak_allocated_bytes: int  # the allocator's peak during the profiling step
    profile_kv_bytes: int = 0  # the small cache the profiling step wrote to, part of the peak
    graph_bytes: int = 0  # what the decode CUDA graphs will hold (0: none captured)


@dataclass(frozen=True, slots=True)
class DraftReservation:
    """What a speculative-decoding draft model on the same device will take: its weights, and a KV
    cache with as many blocks as the target's. Its activations are not counted: in the target's
    process it runs between the target's steps, on fewer tokens, inside the memory the target's peak
    already reserved. Beside tensor-parallel ranks it runs in the driver, another process, whose CUDA
    context and activations come out of the headroom that `gpu_memory_utilization` leaves."""

    weight_bytes: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class KVCacheSplit:
    """Where the budget `total * gpu_memory_utilization` goes; start-up logs it."""

    budget_bytes: int
    in_use_bytes: int  # weights, CUDA context, other processes
    weight_bytes: int
    activation_bytes: int
    graph_bytes: int  # the decode CUDA graphs' memory pool, held beside every eager step's activations
    draft_bytes: int  # draft weights + its KV cache
    kv_bytes: int  # the target's KV cache
    num_blocks: int

    def describe(self) -> str:
        return (
            f"GPU memory budget {self.budget_bytes / GiB:.2f} GiB: in use {self.in_use_bytes / GiB:.2f} "
            f"(weights {self.weight_bytes / GiB:.2f}), activations {self.activation_bytes / GiB:.2f}, "
            f"CUDA graphs {self.graph_bytes / GiB:.2f}, draft {self.draft_bytes / GiB:.2f}, "
            f"KV cache {self.kv_bytes / GiB:.2f} GiB "
            f"({self.num_blocks} blocks)"
        )


def kv_cache_split(
    report: MemoryReport,
    gpu_memory_utilization: float,
    block_bytes: int,
    draft: DraftReservation | None = None,
) -> KVCacheSplit:
    """The number of KV blocks that fit, and the split that explains it.

    Raises ValueError naming `gpu_memory_utilization` when not even one block fits, with the split,
    so an operator sees whether weights, activations or another process took the memory."""
    budget = int(report.total_bytes * gpu_memory_utilization)
    in_use = report.total_bytes - report.free_bytes
    activations = max(0, report.peak_allocated_bytes - report.allocated_bytes - report.profile_kv_bytes)
    draft_weights = draft.weight_bytes if draft else 0
    per_block = block_bytes + (draft.block_bytes if draft else 0)
    left = budget - in_use - activations - report.graph_bytes - draft_weights
    num_blocks = max(0, left // per_block)
    split = KVCacheSplit(
        budget_bytes=budget,
        in_use_bytes=in_use,
        weight_bytes=report.allocated_bytes,
        activation_bytes=activations,
        graph_bytes=report.graph_bytes,
        draft_bytes=draft_weights + num_blocks * (per_block - block_bytes),
        kv_bytes=num_blocks * block_bytes,
        num_blocks=num_blocks,
    )
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV cache: "
            f"{split.describe()}; raise gpu_memory_utilization, lower max_num_batched_tokens, "
            "enforce_eager: true (no CUDA graphs), or use more GPUs (tensor_parallel_size)"
        )
    return split
