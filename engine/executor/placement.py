"""Resources of a rank group: which placement group its actors go in, and failing fast when none fits.

Rank i runs in bundle i. The group is the one handed in, else the placement group this code
already runs in (`ray.util.get_current_placement_group()`: how a Serve replica created with
`placement_group_bundles` sees its bundles), else one created here with one bundle per rank.
Before creating one, the cluster's nodes are checked against the request, so a group that can
never be placed fails at once with a message naming the missing resource instead of waiting.
"""

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group

from raylane.engine.errors import InsufficientResourcesError

# A driver that runs a draft model (speculative decoding beside tensor-parallel ranks) takes this
# share of rank 0's GPU in bundle 0, and rank 0 the rest: Ray then shows both the same GPU.
DRIVER_GPU_SHARE = 0.05


def rank_bundle(cpus_per_rank: float, use_gpu: bool) -> dict[str, float]:
    return {"CPU": cpus_per_rank, **({"GPU": 1.0} if use_gpu else {})}


def rank_gpus(rank: int, use_gpu: bool, driver_shares_gpu: bool) -> float:
    """The GPU a rank's actor reserves: one, less the driver's share on rank 0 when the driver runs a
    draft model there."""
    if not use_gpu:
        return 0.0
    return 1.0 - DRIVER_GPU_SHARE if rank == 0 and driver_shares_gpu else 1.0


def use_gpus(device: str, given: PlacementGroup | None, world_size: int) -> bool:
    """Whether ranks get one GPU each: device cuda, or auto where the group or cluster has GPUs."""
    if device != "auto":
        return device == "cuda"
    if given is not None:
        return any(b.get("GPU", 0) > 0 for b in given.bundle_specs[:world_size])
    return ray.cluster_resources().get("GPU", 0) > 0


def acquire(
    world_size: int, bundle: dict[str, float], strategy: str, given: PlacementGroup | None, timeout_s: float
) -> tuple[PlacementGroup, bool]:
    """(placement group, whether this engine created it and must remove it)."""
    pg = given or get_current_placement_group()
    if pg is not None:
        check_bundles(pg.bundle_specs, bundle, world_size)
        wait_ready(pg, f"the placement group's first {world_size} bundles", timeout_s)
        return pg, False
    check_cluster_fits(_alive_node_resources(), bundle, world_size, strategy)
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
    try:
        wait_ready(pg, f"{world_size} x {_fmt(bundle)} ({strategy})", timeout_s)
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise
    return pg, True


def check_bundles(specs: list[dict], bundle: dict[str, float], world_size: int) -> None:
    if len(specs) < world_size:
        raise InsufficientResourcesError(
            f"the placement group has {len(specs)} bundles, but {world_size} ranks need one each "
            f"(rank i runs in bundle i, each with {_fmt(bundle)})"
        )
    for i, spec in enumerate(specs[:world_size]):
        for key, need in bundle.items():
            if spec.get(key, 0) < need:
                raise InsufficientResourcesError(
                    f"bundle {i} of the placement group has {key}: {spec.get(key, 0):g}, "
                    f"but rank {i} needs {key}: {need:g}"
                )


def check_cluster_fits(
    nodes: list[dict[str, float]], bundle: dict[str, float], world_size: int, strategy: str
) -> None:
    """Raise naming what is missing if the nodes, even idle, cannot hold `world_size` bundles."""
    for key, need in bundle.items():
        total = sum(node.get(key, 0) for node in nodes)
        if need * world_size > total + 1e-9:
            raise InsufficientResourcesError(
                f"{world_size} ranks need {key}: {need * world_size:g} ({need:g} per rank), "
                f"but the cluster has {key}: {total:g}"
            )
    fits = [min(int(node.get(k, 0) / v + 1e-9) for k, v in bundle.items() if v > 0) for node in nodes]
    if strategy == "STRICT_PACK" and max(fits, default=0) < world_size:
        raise InsufficientResourcesError(
            f"placement_strategy STRICT_PACK puts all {world_size} ranks on one node, but no node holds "
            f"{world_size} x {_fmt(bundle)} (the most one node holds is {max(fits, default=0)}); "
            "set placement_strategy to PACK or SPREAD to spread the group over nodes"
        )
    if strategy == "STRICT_SPREAD" and sum(f > 0 for f in fits) < world_size:
        raise InsufficientResourcesError(
            f"placement_strategy STRICT_SPREAD puts each of the {world_size} ranks on its own node, but only "
            f"{sum(f > 0 for f in fits)} nodes hold {_fmt(bundle)}"
        )
    if sum(fits) < world_size:
        raise InsufficientResourcesError(
            f"{world_size} ranks need {world_size} x {_fmt(bundle)}, but the nodes together hold {sum(fits)}"
        )


def wait_ready(pg: PlacementGroup, what: str, timeout_s: float) -> None:
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise InsufficientResourcesError(
            f"{what} could not be placed within placement_timeout_s={timeout_s:g}s; "
            f"free now: {_fmt(free)} (other work holds the rest)"
        ) from None


def _alive_node_resources() -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
