"""The ranks as Ray actors: tensor_parallel_size x expert_parallel_size of them.

The layout is `parallel/state.py`'s; there is one `RankWorker` actor per rank, rank i in bundle i
of a placement group (`placement.py`), each with `cpus_per_rank` CPUs and, where there are
GPUs, one GPU. The ranks join torch.distributed (nccl on GPUs, gloo on CPUs) through a TCP store on
rank 0, load only their shards and take the smallest KV block count any rank can hold. Each step
reaches every rank through a Ray compiled graph (shared-memory channels, built once; cheaper per
step than one actor call per rank: bench/PARALLEL.md compares the two) and only rank 0 returns
logits. A rank that dies, or a step that outlasts `step_timeout_s`, raises `EngineDeadError` naming
the rank; the rest of the group is then killed so nothing waits on it, and `check_health()` keeps
raising.
"""

import logging
import os
import time
import weakref

import ray
import torch
from ray.dag import InputNode, MultiOutputNode
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import AutoConfig

from raylane.config import EngineConfig
from raylane.engine.errors import EngineDeadError, InsufficientResourcesError
from raylane.engine.executor.abstract import Executor
from raylane.engine.executor.placement import acquire, rank_bundle, rank_gpus, use_gpus
from raylane.engine.executor.rank_worker import RankWorker
from raylane.engine.model_runner import ModelInput
from raylane.models.gguf import checkpoint_dir

logger = logging.getLogger(__name__)

# The raylane settings a rank reads (engine/, models/, parallel/), passed to its actor's runtime_env,
# which Ray keeps in the GCS and shows in the dashboard and state API. Only these: never the
# serving process's other variables, such as API keys (RAYLANE_API_KEYS, RAYLANE_API_KEY).
RANK_ENV = ("RAYLANE_CACHE_DIR", "RAYLANE_DEMO_DIR", "RAYLANE_SYNC_COLLECTIVES")
HEALTH_TIMEOUT_S = 10.0


class RayDistributedExecutor(Executor):
    """One Ray actor per rank. `placement_group`: use its first world_size bundles (see
    `placement.py` for the default). `compiled_graph=False` sends each step as one actor
    call per rank instead (slower; kept to measure the difference)."""

    def __init__(self, config: EngineConfig, placement_group=None, compiled_graph: bool = True):
        self.config, self.world_size = config, config.world_size
        self.hf_config = AutoConfig.from_pretrained(checkpoint_dir(config.model))
        check_parallel_layout(self.hf_config, config)
        if not ray.is_initialized():
            ray.init()
        use_gpu = use_gpus(config.device, placement_group, self.world_size)
        backend = config.distributed_backend
        self.backend = ("nccl" if use_gpu else "gloo") if backend == "auto" else backend
        self.bundle = rank_bundle(config.cpus_per_rank, use_gpu)
        self.placement_group, owns_pg = acquire(
            self.world_size,
            self.bundle,
            config.placement_strategy,
            placement_group,
            config.placement_timeout_s,
        )
        self.workers: list = []
        self._dag = None
        self._dead: EngineDeadError | None = None
        # What to release on shutdown, failure or garbage collection (the finalizer must not hold self).
        owned_pg = self.placement_group if owns_pg else None
        self._owned = {"workers": self.workers, "dag": None, "placement_group": owned_pg, "failed": False}
        self._release = weakref.finalize(self, _release, self._owned)
        try:
            self._start_workers(use_gpu)
            if compiled_graph:
                self._dag = self._owned["dag"] = self._compile()
        except BaseException:
            self.shutdown()
            raise

    # -- start-up ------------------------------------------------------------------------------

    def _start_workers(self, use_gpu: bool) -> None:
        actor_class = ray.remote(concurrency_groups={"health": 1})(RankWorker)
        env = {k: v for k, v in os.environ.items() if k in RANK_ENV}
        for rank in range(self.world_size):
            options = dict(
                num_cpus=self.config.cpus_per_rank,
                num_gpus=rank_gpus(rank, use_gpu, self.config.uses_draft_model),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, rank),
                max_restarts=0,
            )
            if env:
                options["runtime_env"] = {"env_vars": env}
            self.workers.append(actor_class.options(**options).remote(self.config, rank))
        self._wait_scheduled()
        address = ray.get(self.workers[0].address.remote())
        infos = self._results([w.start.remote(address, self.backend) for w in self.workers], reraise=True)
        self.rank_info = infos
        self.num_blocks = min(info["num_blocks"] for info in infos)
        self.block_size = infos[0]["block_size"]
        if any(info["block_size"] != self.block_size for info in infos):
            raise ValueError(
                f"block_size: the ranks chose different KV block sizes on their devices "
                f"({[info['block_size'] for info in infos]}); set engine.block_size"
            )
        if self.config.uses_draft_model:
            self.draft_device = draft_device(infos[0])
        self._results([w.allocate_kv_cache.remote(self.num_blocks) for w in self.workers], reraise=True)
        logger.info(
            "%d ranks (tp %d x ep %d, %s) on nodes %s; %d KV blocks",
            self.world_size,
            self.config.tensor_parallel_size,
            self.config.expert_parallel_size,
            self.backend,
            sorted({i["node_id"][:8] for i in infos}),
            self.num_blocks,
        )

    def _wait_scheduled(self) -> None:
        """Fail fast when the bundles have no room for the actors (e.g. a Serve replica's bundle 0
        already taken by the replica itself)."""
        pings = [w.ping.options(concurrency_group="health").remote() for w in self.workers]
        ready, waiting = ray.wait(pings, num_returns=len(pings), timeout=self.config.placement_timeout_s)
        if waiting:
            ranks = [pings.index(ref) for ref in waiting]
            raise InsufficientResourcesError(
                f"ranks {ranks} were not scheduled within placement_timeout_s="
                f"{self.config.placement_timeout_s:g}s: their placement group bundles have no free "
                f"{self.bundle} (rank i runs in bundle i, next to whatever else that bundle holds)"
            )
        ray.get(ready)

    def _compile(self):
        with InputNode() as batch:
            dag = MultiOutputNode([w.execute_model.bind(batch) for w in self.workers])
        return dag.experimental_compile()

    # -- steps -----------------------------------------------------------------------------------

    def execute_model(self, batch: ModelInput) -> torch.Tensor:
        if self._dead is not None:
            raise self._dead
        try:
            if self._dag is not None:
                outputs = ray.get(self._dag.execute(batch), timeout=self.config.step_timeout_s)
            else:
                calls = [w.execute_model.remote(batch) for w in self.workers]
                outputs = self._results(calls, timeout=self.config.step_timeout_s)
        except EngineDeadError:
            raise
        except Exception as e:
            raise self._fail(e) from e
        return outputs[0]

    def _results(self, refs: list, timeout: float | None = None, reraise: bool = False) -> list:
        """Every rank's result of one call, failing as soon as any rank fails (the others may be
        blocked in a collective with it). `reraise` keeps a rank's own exception (start-up errors
        such as a missing weight) instead of turning it into `EngineDeadError`."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results, pending = [None] * len(refs), list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise self._fail(TimeoutError(f"ranks {sorted(rank_of[r] for r in pending)} timed out"))
            try:
                results[rank_of[ready[0]]] = ray.get(ready[0])
            except Exception as e:
                if reraise:
                    raise
                raise self._fail(e, rank_of[ready[0]]) from e
        return results

    def _fail(self, error: BaseException, rank: int | None = None) -> EngineDeadError:
        """Mark the group dead and kill what is left of it, so no rank stays blocked in a collective.

        The first error seen may be a survivor's (a collective that lost its peer), so ranks that
        no longer answer are named as the cause when there are any."""
        if self._dead is None:
            n = self.world_size
            dead = self._dead_ranks()
            if dead:
                what = f"rank {dead[0]} of {n} died" if len(dead) == 1 else f"ranks {dead} of {n} died"
            elif isinstance(error, TimeoutError):
                limit = self.config.step_timeout_s
                what = f"the {n} ranks did not finish a step within step_timeout_s={limit:g}s"
            else:
                rank = rank if rank is not None else self._rank_of(error)
                what = f"rank {rank} of {n} failed" if rank is not None else f"the {n} ranks failed"
            first_line = (str(error).strip().splitlines() or [""])[0]
            self._dead = EngineDeadError(
                f"engine worker group is dead: {what} ({type(error).__name__}: {first_line})"
            )
            logger.error("%s", self._dead)
            self._owned["failed"] = True
            self._release()
        return self._dead

    def _dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        pings = [w.ping.options(concurrency_group="health").remote() for w in self.workers]
        ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        dead = []
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=0)
            except ray.exceptions.RayActorError:
                dead.append(rank)
            except Exception:  # noqa: BLE001 - alive but busy (or stuck): not what died
                pass
        return dead

    def _rank_of(self, error: BaseException) -> int | None:
        actor_id = getattr(error, "actor_id", None)
        for rank, worker in enumerate(self.workers):
            if actor_id is not None and worker._actor_id.hex() == actor_id:
                return rank
        return None

    # -- health and shutdown -------------------------------------------------------------------

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        pings = [w.ping.options(concurrency_group="health").remote() for w in self.workers]
        self._results(pings, timeout=HEALTH_TIMEOUT_S)

    def rank_stats(self, reset: bool = False) -> list[dict]:
        """Per-rank step and collective timings (benchmarks)."""
        return ray.get([w.stats.options(concurrency_group="health").remote(reset) for w in self.workers])

    def shutdown(self) -> None:
        self._release()


def _release(owned: dict) -> None:
    """Stop the compiled graph, kill the rank actors, remove a placement group we created.

    A healthy group tears its graph down first (a clean stop); a failed one is killed first, since
    a rank blocked in a collective would hold up the teardown."""
    if not ray.is_initialized():
        return
    if not owned["failed"]:
        _teardown(owned["dag"])
    for worker in owned["workers"]:
        ray.kill(worker)
    if owned["failed"]:
        # Ray logs each dead actor's cancelled loop as an error; the engine has said what failed.
        dag_logger = logging.getLogger("ray.dag.compiled_dag_node")
        level, dag_logger.level = dag_logger.level, logging.CRITICAL
        try:
            _teardown(owned["dag"])
        finally:
            dag_logger.setLevel(level)
    if owned["placement_group"]:
        ray.util.remove_placement_group(owned["placement_group"])


def _teardown(dag) -> None:
    if dag is None:
        return
    try:
        dag.teardown()
    except Exception:  # noqa: BLE001 - shutting down anyway; the channels go with the actors
        logger.debug("compiled graph teardown failed", exc_info=True)


def check_parallel_layout(hf_config, config: EngineConfig) -> None:
    """Refuse sizes the model cannot be split into before any actor starts."""
    tp, ep = config.tensor_parallel_size, config.expert_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp or (kv_heads % tp if tp < kv_heads else tp % kv_heads):
        raise ValueError(
            f"tensor_parallel_size: {tp} does not split {heads} attention heads and {kv_heads} KV heads "
            "evenly (KV heads are split, or replicated when ranks outnumber them)"
        )
    if ep == 1:
        return
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if not experts:
        arch = (getattr(hf_config, "architectures", None) or ["this model"])[0]
        raise ValueError(f"expert_parallel_size: {arch} has no experts; use tensor_parallel_size")
    if experts % ep:
        raise ValueError(f"expert_parallel_size: {ep} does not split {experts} experts evenly")


def draft_device(rank0: dict) -> torch.device:
    """Where the draft model of speculative decoding runs in this process (the driver): rank 0's GPU,
    whose KV cache left room for it (a Serve replica reserves a share of that GPU: deployments/app.py),
    or the CPU when the ranks run on CPUs. `rank0`: rank 0's start-up info."""
    if not rank0["device"].startswith("cuda"):
        return torch.device("cpu")
    gpu = str(rank0["gpu_ids"][0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible is not None else [str(i) for i in range(torch.cuda.device_count())]
    same_node = rank0["node_id"] == ray.get_runtime_context().get_node_id()
    if not same_node or gpu not in ids:
        raise InsufficientResourcesError(
            f"speculative_config: the draft model runs in the engine's driver, beside rank 0 on GPU {gpu} "
            f"of node {rank0['node_id'][:8]}, but this process cannot see that GPU (CUDA_VISIBLE_DEVICES="
            f"{visible!r}); run the engine in a Serve replica (which shares rank 0's GPU) or on that node"
        )
    return torch.device("cuda", ids.index(gpu))
