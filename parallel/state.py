"""torch.distributed process groups for tensor and expert parallelism.

One process per rank. `init_distributed` joins the default group and carves it into
tensor-parallel (TP) groups of consecutive ranks and, inside each, expert-parallel (EP)
groups. By default both span all ranks, so attention is tensor-parallel and the MoE
experts are partitioned over the same ranks. EP groups nest inside TP groups because
`FusedMoE` combines partial outputs with an all-reduce, which is only right when every
rank of an EP group holds the same tokens (see `parallel/moe.py`).

Nothing initialised means a single process: rank 0, size 1, every collective a no-op,
so the layers run unchanged in tests and in the in-process executor.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class _Group:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_TP = _Group()
_EP = _Group()


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    tensor_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
) -> None:
    """Join the default group (NCCL on CUDA, else gloo) and build the TP and EP groups.

    `tensor_parallel_size` defaults to `world_size`, `expert_parallel_size` to the TP size.
    With NCCL the caller selects this rank's CUDA device first (`torch.cuda.set_device`).
    """
    tp = tensor_parallel_size or world_size
    ep = expert_parallel_size or tp
    if world_size % tp or tp % ep:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide world_size ({world_size}) and "
            f"expert_parallel_size ({ep}) must divide tensor_parallel_size"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _TP.rank, _TP.size, _TP.group = _new_groups(rank, world_size, tp)
    _EP.rank, _EP.size, _EP.group = _new_groups(rank, world_size, ep)


def _new_groups(rank: int, world_size: int, size: int) -> tuple[int, int, dist.ProcessGroup]:
    """Split ranks into blocks of `size` consecutive ranks; return this rank's block.

    Every rank must create every group, in the same order, so all blocks are built here.
    """
    mine = None
    for start in range(0, world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return rank % size, size, mine


def destroy_distributed() -> None:
    """Leave the process groups and fall back to single-process state."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP.rank, _TP.size, _TP.group = 0, 1, None
    _EP.rank, _EP.size, _EP.group = 0, 1, None


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP.group


def get_ep_rank() -> int:
    return _EP.rank


def get_ep_size() -> int:
    return _EP.size


def get_ep_group() -> dist.ProcessGroup | None:
    return _EP.group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place where possible)."""
    if _TP.size == 1:
        return x
    dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in rank order."""
    if _TP.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x, group=_TP.group)
    return torch.cat(parts, dim=dim)


def expert_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the EP group (in place where possible)."""
    if _EP.size == 1:
        return x
    dist.all_reduce(x, group=_EP.group)
    return x
