"""One rank of a worker group, run inside its own Ray actor by `RayDistributedExecutor`.

It joins the torch.distributed groups, loads only its shard (a `ModelRunner` built after
joining, so every layer sees its rank), allocates the KV block count the driver agreed on,
and runs the same forward as every other rank each step. Only rank 0 returns logits; ranks of
the other tensor-parallel groups (expert_parallel_size > 1) skip the LM head altogether.
"""

import socket
import time
from datetime import timedelta

import torch

from raylane.config import EngineConfig
from raylane.engine.model_runner import ModelInput, ModelRunner
from raylane.engine.spec_decode.draft_model import draft_reservation_on

MAX_TIMED_STEPS = 100_000  # per-step timings kept for benchmarks until stats(reset=True)


class RankWorker:
    def __init__(self, config: EngineConfig, rank: int):
        self.config, self.rank = config, rank
        self.runner: ModelRunner | None = None
        self.computes_logits = rank == 0
        self.execute_s: list[float] = []  # per step since the last stats(reset=True)
        self.collective_s: list[float] = []
        if not torch.cuda.is_available():  # ranks sharing a node's cores must not oversubscribe them
            torch.set_num_threads(max(1, int(config.cpus_per_rank)))

    def address(self) -> str:
        """A TCP store address on this node, for every rank to join (asked of rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, init_method: str, backend: str) -> dict:
        """Join the process groups and load this rank's shard; returns what the driver agrees on."""
        import ray

        from raylane.parallel import state

        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves this actor its one GPU
        state.init_distributed(
            self.rank,
            self.config.world_size,
            init_method,
            backend=backend,
            tensor_parallel_size=self.config.tensor_parallel_size,
            expert_parallel_size=self.config.expert_parallel_size,
            timeout=timedelta(seconds=self.config.step_timeout_s),
        )
        anon_before = _memory()["anon"]
        self.runner = ModelRunner(self.config)
        self.computes_logits = state.get_ep_rank() == 0  # rank 0's TP group gathers the logits
        memory = _memory()
        draft = draft_reservation_on(self.runner) if self.rank == 0 else None  # the driver's, on this GPU
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
            "device": str(self.runner.device),
            "gpu_ids": ray.get_gpu_ids(),
            "num_blocks": self.runner.available_kv_blocks(draft),
            "block_size": self.runner.block_size,
            "weight_bytes": self.runner.weight_bytes(),
            "load_anon_bytes": memory["anon"] - anon_before,
            "peak_rss_bytes": memory["peak"],
        }

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, batch: ModelInput) -> torch.Tensor | None:
        from raylane.parallel.state import collective_stats

        start, in_collectives = time.perf_counter(), collective_stats.seconds
        logits = self.runner.execute_model(batch, compute_logits=self.computes_logits)
        if len(self.execute_s) < MAX_TIMED_STEPS:
            self.execute_s.append(time.perf_counter() - start)
            self.collective_s.append(collective_stats.seconds - in_collectives)
        # Through Ray's object store to the driver, which samples: a host tensor.
        return logits.cpu() if self.rank == 0 and logits is not None else None

    def ping(self) -> int:
        return self.rank

    def stats(self, reset: bool = False) -> dict:
        """Per step since the last reset: seconds in execute_model and, of those, in collectives."""
        out = {"rank": self.rank, "execute_s": self.execute_s, "collective_s": self.collective_s}
        if reset:
            self.execute_s, self.collective_s = [], []
        return out


def _memory() -> dict[str, int]:
    """Anonymous resident bytes (what the process itself allocated, not mapped files) and peak RSS."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return {"anon": fields.get("RssAnon", 0), "peak": fields.get("VmHWM", 0)}
