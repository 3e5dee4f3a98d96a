"""torch.distributed process groups for tensor and expert parallelism.

One process per rank; `world_size = tensor_parallel_size (T) * expert_parallel_size (E)`.
Rank r sits at (e, t) = divmod(r, T):

  - TP group: the T consecutive ranks with the same e. Attention, dense MLPs, the embedding
    and the LM head are split over it (one all-reduce per attention block and per dense MLP).
  - EP group: the E ranks with the same t (strided). Experts are partitioned over it.
  - MoE layers: experts are split E ways by EP rank and each expert's intermediate size T ways
    by TP rank, so every rank holds a distinct 1/(T*E) of each MoE layer; the partial outputs
    are summed with one all-reduce over all ranks (`moe_all_reduce`, see `parallel/moe.py`).

Every TP group runs the same batch, so with E > 1 attention is replicated E times. That is what
lets a plain all-reduce combine the experts: every rank holds the same tokens. Data-parallel
attention (each TP group its own batch) would need the all-to-all dispatch `parallel/moe.py`
describes. Rank 0 (e = 0, t = 0) is the one whose logits the engine samples from.

Nothing initialised means a single process: rank 0, size 1, every collective a no-op,
so the layers run unchanged in tests and in the in-process executor.
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(slots=True)
class _Group:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


@dataclass(slots=True)
class CollectiveStats:
    """Calls and wall seconds spent in this process's collectives (benchmarks read and reset it).

    Gloo collectives block, so the time is exact on CPU. NCCL ones return once queued; set
    RAYLANE_SYNC_COLLECTIVES=1 to synchronise around each (slower, but then the time is real).
    """

    calls: int = 0
    seconds: float = 0.0


_TP = _Group()
_EP = _Group()
_MOE = _Group()  # all ranks: every rank holds a distinct part of each MoE layer
collective_stats = CollectiveStats()
_SYNC_COLLECTIVES = os.environ.get("RAYLANE_SYNC_COLLECTIVES") == "1"


def rank_layout(rank: int, tensor_parallel_size: int) -> tuple[int, int]:
    """(ep_rank, tp_rank) of a global rank: consecutive ranks share a TP group."""
    return divmod(rank, tensor_parallel_size)


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    tensor_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
    timeout: timedelta | None = None,
) -> None:
    """Join the default group (NCCL on CUDA, else gloo) and build the TP and EP groups.

    Sizes default so that their product is `world_size` (both omitted: TP over all ranks).
    With NCCL the caller selects this rank's CUDA device first (`torch.cuda.set_device`).
    `timeout` bounds every collective, so a group that lost a rank fails instead of hanging.
    """
    ep = expert_parallel_size or (world_size // tensor_parallel_size if tensor_parallel_size else 1)
    tp = tensor_parallel_size or world_size // ep
    if tp * ep != world_size:
        raise ValueError(
            f"tensor_parallel_size ({tp}) x expert_parallel_size ({ep}) must equal world_size ({world_size})"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        kwargs = {"timeout": timeout} if timeout is not None else {}
        if backend == "nccl":
            # Binds the communicator to this rank's GPU at once (eager init), instead of NCCL guessing
            # a device at the first collective and every later `new_group` paying its own set-up.
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    # Every rank must create every group, in the same order, so all groups are built everywhere.
    ep_rank, tp_rank = rank_layout(rank, tp)
    tp_groups = [list(range(e * tp, (e + 1) * tp)) for e in range(ep)]
    ep_groups = [list(range(t, world_size, tp)) for t in range(tp)]
    _TP.rank, _TP.size, _TP.group = tp_rank, tp, _new_group(tp_groups, ep_rank)
    _EP.rank, _EP.size, _EP.group = ep_rank, ep, _new_group(ep_groups, tp_rank)
    _MOE.rank, _MOE.size, _MOE.group = rank, world_size, dist.group.WORLD


def _new_group(all_groups: list[list[int]], mine: int) -> dist.ProcessGroup | None:
    """Create every group of one kind (all ranks must), return this rank's; None for size 1."""
    if len(all_groups[0]) == 1:
        return None
    groups = [dist.new_group(ranks) for ranks in all_groups]
    return groups[mine]


def destroy_distributed() -> None:
    """Leave the process groups and fall back to single-process state."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for g in (_TP, _EP, _MOE):
        g.rank, g.size, g.group = 0, 1, None


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


def _timed(x: torch.Tensor, op: Callable[[], object]) -> None:
    if _SYNC_COLLECTIVES and x.is_cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    op()
    if _SYNC_COLLECTIVES and x.is_cuda:
        torch.cuda.synchronize(x.device)
    collective_stats.calls += 1
    collective_stats.seconds += time.perf_counter() - start


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place where possible)."""
    if _TP.size == 1:
        return x
    _timed(x, lambda: dist.all_reduce(x, group=_TP.group))
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in rank order."""
    if _TP.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    _timed(x, lambda: dist.all_gather(parts, x, group=_TP.group))
    return torch.cat(parts, dim=dim)


def moe_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over all ranks, each of which computed its own experts' slice (in place)."""
    if _MOE.size == 1:
        return x
    _timed(x, lambda: dist.all_reduce(x, group=_MOE.group))
    return x
