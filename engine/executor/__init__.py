"""Where the model runs: in this process (one rank) or on a group of Ray actors (one per rank).

`LLMEngine` drives an `Executor` (`abstract.py`): `execute_model(ModelInput)` returns the sampled
rows' logits, `num_blocks` is the KV block count every rank holds, `check_health()` raises
`EngineDeadError` once a rank is gone, `shutdown()` releases the ranks.

- `UniProcExecutor` (`uniproc.py`): one `ModelRunner` in this process; Ray is not imported.
- `RayDistributedExecutor` (`ray_distributed.py`): one `RankWorker` actor per rank
  (`rank_worker.py`), rank i in bundle i of a placement group (`placement.py`).
"""

from raylane.config import EngineConfig
from raylane.engine.executor.abstract import Executor
from raylane.engine.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "make_executor"]


def make_executor(config: EngineConfig, placement_group=None) -> Executor:
    """In-process for one rank (unless a placement group is handed in or Ray is asked for)."""
    backend = config.distributed_executor_backend
    one_rank = config.world_size == 1 and placement_group is None
    if backend == "uni" or (backend == "auto" and one_rank):
        if placement_group is not None:
            raise ValueError("placement_group: the in-process executor ('uni') runs in no placement group")
        return UniProcExecutor(config)
    from raylane.engine.executor.ray_distributed import RayDistributedExecutor  # imports Ray: only for actors

    return RayDistributedExecutor(config, placement_group)
