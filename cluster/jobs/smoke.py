"""Smoke test of a running cluster: one request per pool and per route; exit 1 on any failure.

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m raylane.cluster.jobs.smoke

Checks, each printed as `ok` or `FAIL`: Serve reports the application RUNNING and every deployment
HEALTHY (when run on the cluster); `/health` answers 200; `/v1/models` lists every pool; a chat
request to each pool by its model id returns text from that pool; a `model: "auto"` request for each
route is served (the route the router took is reported; a different route is a warning only, since
`route_eval` measures accuracy). A pool that `/health` reports unavailable fails without waiting
for its request to time out.
"""

import argparse
import sys

from raylane.cluster.jobs.common import add_endpoint_arguments, call, chat, load_config, serve_details

# A prompt per default route; a configured route uses its first example instead.
ROUTE_PROMPTS = {
    "coding": "Write a Python function that reverses a linked list.\n```python\ndef reverse(head):\n```",
    "reasoning": "Prove step by step that the square root of 2 is irrational.",
    "chat": "Hi! How is your day going?",
}
AUTO = "auto"


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def ok(self, check: str, detail: str = "") -> None:
        self.passed += 1
        print(f"ok    {check}" + (f": {detail}" if detail else ""), flush=True)

    def fail(self, check: str, detail: str) -> None:
        self.failures.append(check)
        print(f"FAIL  {check}: {detail}", flush=True)

    def warn(self, check: str, detail: str) -> None:
        print(f"warn  {check}: {detail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylane.cluster.jobs.smoke", description=__doc__.split("\n")[0])
    add_endpoint_arguments(parser)
    parser.add_argument("--no-routes", action="store_true", help="skip the `model: auto` route requests")
    args = parser.parse_args(argv)
    report = Report()
    details = serve_details(args.app)
    check_serve_status(details, args.app, report)
    config = load_config(args, details)
    unavailable = check_health(args, report)
    pools = check_models(args, config, report)
    for pool_name, model_id in pools:
        check_pool(args, pool_name, model_id, unavailable, report)
    if not args.no_routes:
        for route, prompt in routes(config):
            check_route(args, route, prompt, report)
    print(f"smoke: {report.passed} checks ok, {len(report.failures)} failing", flush=True)
    return 1 if report.failures else 0


def check_serve_status(details: dict | None, app: str, report: Report) -> None:
    if details is None:
        report.warn("serve status", f"not on a Ray cluster with Serve app {app!r}: checking over HTTP only")
        return
    if details["status"] != "RUNNING":
        report.fail("serve status", f"application {app} is {details['status']}: {details.get('message', '')}")
    else:
        report.ok("serve status", f"application {app} RUNNING")
    for name, deployment in details["deployments"].items():
        running = sum(r["state"] == "RUNNING" for r in deployment.get("replicas", []))
        if deployment["status"] != "HEALTHY" or running == 0:
            detail = f"{deployment['status']}, {running} running replicas: {deployment.get('message', '')}"
            report.fail(f"deployment {name}", detail.strip(": "))
        else:
            report.ok(f"deployment {name}", f"{running} running replicas")


def check_health(args, report: Report) -> set[str]:
    response = call(args, "GET", "/health")
    pools = response.body.get("pools", {}) if isinstance(response.body, dict) else {}
    unavailable = {name for name, pool in pools.items() if pool.get("status") == "unavailable"}
    if response.status == 200:
        report.ok("/health", f"{len(pools)} pools ok")
    else:
        names = ", ".join(sorted(unavailable)) or response.error
        report.fail("/health", f"status {response.status}: unavailable: {names}")
    return unavailable


def check_models(args, config, report: Report) -> list[tuple[str, str]]:
    """(pool name, model id) of every pool: from the config, else what /v1/models lists."""
    response = call(args, "GET", "/v1/models")
    listed = [m["id"] for m in response.body.get("data", [])] if response.status == 200 else []
    if response.status != 200:
        report.fail("/v1/models", f"status {response.status}: {response.error}")
    if config is None:
        return [(model, model) for model in listed if model != "all-MiniLM-L6-v2"]
    pools = [(p.name, p.model_id) for p in config.pools]
    missing = [model for _, model in pools if model not in listed]
    if response.status == 200 and missing:
        report.fail("/v1/models", f"does not list {missing}")
    elif response.status == 200:
        report.ok("/v1/models", ", ".join(listed))
    return pools


def check_pool(args, pool: str, model: str, unavailable: set[str], report: Report) -> None:
    check = f"pool {pool}"
    if pool in unavailable:
        report.fail(check, "unavailable (per /health); request not sent")
        return
    response = chat(args, model, [{"role": "user", "content": "Say hello."}])
    served_by = response.headers.get("x-raylane-pool")
    if response.status != 200:
        report.fail(check, f"status {response.status}: {response.error}")
    elif served_by not in (None, pool):
        report.fail(check, f"answered by pool {served_by}")
    else:
        text = response.body["choices"][0]["message"].get("content") or ""
        report.ok(check, f"{response.body['usage']['completion_tokens']} tokens: {text[:40]!r}")


def routes(config) -> list[tuple[str, str]]:
    if config is None:
        return list(ROUTE_PROMPTS.items())
    out = []
    for route in config.router.routes:
        prompt = route.examples[0] if route.examples else ROUTE_PROMPTS.get(route.name, route.name)
        out.append((route.name, prompt))
    return out


def check_route(args, route: str, prompt: str, report: Report) -> None:
    check = f"route {route}"
    response = chat(args, AUTO, [{"role": "user", "content": prompt}])
    if response.status != 200:
        report.fail(check, f"status {response.status}: {response.error}")
        return
    taken = response.headers.get("x-raylane-route")
    pool = response.headers.get("x-raylane-pool")
    fallback = response.headers.get("x-raylane-fallback")
    if taken is not None and taken != route:
        report.warn(check, f"the router chose {taken} for this prompt (see route_eval)")
    report.ok(check, f"served by pool {pool}" + (f" (fallback {fallback})" if fallback else ""))


if __name__ == "__main__":
    sys.exit(main())
