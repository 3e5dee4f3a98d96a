"""The app's detached named actors (the response store, the batch actor, the metrics aggregator):
each created by the first replica that asks for it (the others get it by name), outliving every
replica, and brought back by Ray when it dies (`max_restarts=-1`)."""

from __future__ import annotations

from typing import Any

NAMESPACE = "raylane"


def detached_actor(cls: type, name: str, *args: Any, **options: Any):
    """The handle of actor `name` running `cls(*args)`, created here if it does not exist yet."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return (
        ray.remote(cls)
        .options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,
            # In no replica's placement group: Serve's replicas capture their children, and removing
            # the group when that replica dies or scales down would take the actor with it.
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
            **options,
        )
        .remote(*args)
    )


def end_detached(name: str) -> bool:
    """Kill actor `name` (its app is going away on a cluster that stays up); whether there was one."""
    import ray

    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    except ValueError:  # no such actor
        return False
    return True
