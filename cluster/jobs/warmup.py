"""Warm the cluster up so that the first user request sees no cold start.

    ray job submit ... -- python -m raylane.cluster.jobs.warmup [--system-prompts prompts.yaml]

1. Waits until every pool has its minimum replicas running (at least one) and the application is
   RUNNING; exits 1 if that does not happen within `--wait`.
2. Sends each pool a one-token request per configured system prompt, several times over so that
   every replica is likely to see it (Serve picks replicas itself): the prompt's KV blocks then sit
   in each replica's prefix cache. Without prompts it sends one short request per pool, which
   still pays each replica's first-step costs.

`--system-prompts` is YAML: `{POOL: [PROMPT, ...]}`; the key `"*"` applies to every pool.
"""

import argparse
import sys
import time
from pathlib import Path

import yaml

from raylane.cluster.jobs.common import add_endpoint_arguments, chat, load_config, serve_details


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylane.cluster.jobs.warmup", description=__doc__.split("\n")[0])
    add_endpoint_arguments(parser)
    parser.add_argument("--system-prompts", type=Path, help="YAML {pool: [prompt, ...]} ('*': all pools)")
    parser.add_argument("--wait", type=float, default=900.0, help="seconds to wait for replicas (900)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per prompt per running replica (2)")
    args = parser.parse_args(argv)
    config = load_config(args)
    if config is None:
        print(
            "warmup: no config: pass --config or run on the cluster Serve deployed from one", file=sys.stderr
        )
        return 2
    replicas = wait_for_replicas(args, config)
    if replicas is None:
        return 1
    prompts = yaml.safe_load(args.system_prompts.read_text()) if args.system_prompts else {}
    failed = 0
    for pool in config.pools:
        pool_prompts = [*(prompts.get("*") or []), *(prompts.get(pool.name) or [])] or [None]
        sends = max(1, replicas.get(pool.name, 1)) * max(1, args.rounds)
        start = time.monotonic()
        for prompt in pool_prompts:
            messages = ([{"role": "system", "content": prompt}] if prompt else []) + [
                {"role": "user", "content": "Hi."}
            ]
            for _ in range(sends):
                response = chat(args, pool.model_id, messages, max_tokens=1)
                if response.status != 200:
                    failed += 1
                    print(f"FAIL  pool {pool.name}: status {response.status}: {response.error}", flush=True)
                    break
        took = time.monotonic() - start
        what = f"{len(pool_prompts)} system prompt(s)" if pool_prompts != [None] else "a first request"
        print(f"ok    pool {pool.name}: {what} x {sends} in {took:.1f}s", flush=True)
    return 1 if failed else 0


def wait_for_replicas(args, config) -> dict[str, int] | None:
    """Pool name -> running replicas once each pool has its minimum (None after --wait)."""
    from raylane.deployments.app import pool_deployment_name

    deadline = time.monotonic() + args.wait
    while True:
        details = serve_details(args.app)
        if details is None:  # not on the cluster: trust that the pools answer
            return {}
        running = {
            pool.name: sum(
                r["state"] == "RUNNING"
                for r in details["deployments"].get(pool_deployment_name(pool.name), {}).get("replicas", [])
            )
            for pool in config.pools
        }
        short = {
            p.name: running[p.name] for p in config.pools if running[p.name] < max(1, p.replicas.min_replicas)
        }
        if not short and details["status"] == "RUNNING":
            print("ok    replicas: " + ", ".join(f"{k} {v}" for k, v in running.items()), flush=True)
            return running
        if time.monotonic() > deadline:
            print(
                f"FAIL  replicas: still short after {args.wait:.0f}s: {short} ({details['status']})",
                flush=True,
            )
            return None
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
