"""LLM-aware autoscaling of a pool: Serve's autoscaler with a policy that reads the engine's state.

Serve's default policy scales on requests in flight per replica (`target_ongoing_requests`), which
for an LLM mixes a short chat with a 4,000-token generation and says nothing of the KV cache. Each
`ModelPool` replica reports what the engine knows (`ModelPool.record_autoscaling_stats`: requests
waiting to be scheduled, the share of KV blocks in use), Serve averages them over its look-back window,
and `LLMAutoscalingPolicy` asks for the most replicas any of three targets calls for:

- requests in flight / `target_ongoing_requests` (Serve's own signal, kept as the floor);
- requests waiting in the engines / `target_waiting_requests` (the batch is full: more arrive than
  one replica's engine admits);
- replicas x mean KV use / `target_kv_cache_usage` (long contexts fill the cache before the batch).

Serve applies `min_replicas`/`max_replicas` and the up/downscale delays around it
(`ray.serve.autoscaling_policy._apply_autoscaling_config`), so a step in load scales up after
`upscale_delay_s` and back down once every signal has been low for `downscale_delay_s`. The policy runs
in Serve's controller, which imports it by name from this module.
"""

from __future__ import annotations

import math
from typing import Any

WAITING = "num_requests_waiting"
KV_USAGE = "kv_cache_usage"


class LLMAutoscalingPolicy:
    """Serve instantiates the class once with the deployment's `policy_kwargs`, then calls it every
    autoscaling tick with an `AutoscalingContext`."""

    def __init__(
        self,
        target_ongoing_requests: float,
        target_waiting_requests: float | None = None,
        target_kv_cache_usage: float | None = None,
    ) -> None:
        self.target_ongoing = target_ongoing_requests
        self.target_waiting = target_waiting_requests
        self.target_kv = target_kv_cache_usage

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        replicas = ctx.current_num_replicas
        if replicas == 0:  # Serve's cold start path decides; nothing to measure yet
            return ctx.target_num_replicas, {}
        wants = {"ongoing": ctx.total_num_requests / self.target_ongoing}
        metrics = ctx.aggregated_metrics or {}
        waiting = metrics.get(WAITING) or {}
        if self.target_waiting and waiting:
            wants["waiting"] = sum(waiting.values()) / self.target_waiting
        kv = metrics.get(KV_USAGE) or {}
        if self.target_kv and kv:
            wants["kv_cache_usage"] = replicas * (sum(kv.values()) / len(kv)) / self.target_kv
        reason = max(wants, key=wants.__getitem__)
        desired = wants[reason]
        if math.isnan(desired):
            desired, reason = replicas, "no_data"
        return desired, {"raylane_scale_reason": reason}
