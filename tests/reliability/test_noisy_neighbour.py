"""One tenant cannot hurt another: a victim key's ordinary traffic keeps its latency while other
keys of the same tier abuse the API in every way the gateway defends against.

App: one pool `chat` (the tiny demo model, 256-token context) behind `auto` routing (the semantic
classifier and RE2 rules), /v1/embeddings on, a 1 MiB body limit, and one tier `standard` for every
key: 600 requests and 30,000 tokens a minute per key, 2 requests at once per key, batches allowed
with 30,000 batch tokens a minute.

The victim runs in a process of its own, as an application would: in each of two loops, `auto` chat
requests of 8 tokens and `/health`, one after another, throughout the run. The attacker runs in
another (scheduled SCHED_IDLE: on a real network it would be another machine, and its own CPU is
not the server's), steered by the test: each abuse class in turn, from a key of its own,
ATTACK_RATE requests a second (RATES: uploads at what a 1 Gb/s link carries; the classes are in
tests/reliability/noisy_attacks.py) for ATTACK_S seconds whatever the answers; before every other
class, a
pause of the same length in which the victim's unloaded latency is sampled (so unloaded and loaded
windows alternate, and the machine's drift over the run weighs on both alike). The report gives the
CPU seconds Serve's proxy and each replica spent in every window (`server_cpu_s`): what a class costs the
server, next to what it costs the victim; `rest` is what everything else on the machine took (the
clients, Ray's own processes), `steal` what the VM's host gave to other guests; a class whose window
lost more than MAX_STEAL_S to them is measured again, once.

Asserted for each class: the victim's p95 latency under 5 s, and within BOUND times its unloaded
p95 (not yet for the classes in NOT_YET_BOUND: reported); no error to the victim (chat or /health);
every answer to the attacker a 2xx, or a 4xx/429 in OpenAI's error shape with a message; and the
memory of the gateway (its process and its workers, which compute embeddings and check grammars:
their proportional set size) and of the batch actor each grows by less than 50 MB: memory of their
own, not the pages of Ray's object store they map as a file's chunks and a line's results pass
between them (shared, reused, and bounded by Ray).
"""

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest

from tests.reliability.conftest import deployed, llama_pool, replica_tree_pss_mb, serve_cpu_s
from tests.reliability.noisy_attacks import (
    ATTACK_S,
    ATTACKS,
    BODY_LIMIT,
    UPLOAD_BUDGET,
    attacker,
    attacker_key,
    chat_body,
)

APP = "noisy"
VICTIM_KEY = "rel-nn-victim"
VICTIM_LOOPS = 2  # ~50 chat requests a window: its p95 is not the second slowest of 25
UNLOADED_EVERY = 2  # an unloaded window before every other class: four in all
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app(api_server, demo_models):
    config = {
        "gateway": {"num_cpus": 0.1, "max_request_body_bytes": BODY_LIMIT},
        "embeddings": {"enabled": True},
        "pools": [
            llama_pool(demo_models, "chat", engine={"max_model_len": 256}, grammar_compile_timeout_s=2)
        ],
        "router": {
            "routes": [
                {"name": "coding", "pool": "chat", "regex": [r"```", r"(?i)\bdef\s+\w+\("]},
                {"name": "chat", "pool": "chat"},
            ],
        },
        "batch": {"max_upload_bytes_per_minute_per_key": UPLOAD_BUDGET},
        "tiers": [
            {
                "name": "standard",
                "priority": 1,
                "requests_per_minute": 600,
                "tokens_per_minute": 30_000,
                "max_concurrent_per_key": 2,
                "batches": True,
                "batch_tokens_per_minute": 30_000,
            }
        ],
        "api_keys": {
            "keys": {key: "standard" for key in [VICTIM_KEY, *map(attacker_key, ATTACKS)]},
            "default_tier": "standard",
        },
    }
    with deployed(api_server, APP, config) as url:
        yield url


# The victim's p95 may grow by at most this factor under each class (and never past 5 s): the
# issue's bound. Where a key's limits let the machine do real CPU work for it outside the pool's
# steps (one large embeddings call a minute, a grammar compile), that work runs in a worker process
# at SCHED_IDLE (raylane/bounded_worker.py): the victim's p95 under those classes was 1.1-1.75x on an
# Intel Xeon and up to 2.4x (embeddings, then a thread of the gateway sharing its GIL) and 3.5-4.3x
# (grammars, then niced to 19 against serving's 15) on an AMD EPYC; since, 1.15-1.5x on the Xeon
# over eight runs, about what an outside SCHED_IDLE process doing the same MiniLM work costs (1.23x,
# one run).
# The attacker's 2 streams at a time (pool flood, slow readers) are held since streams are batched
# (the engine's stream_batching_interval_ms): each costs serving one chunk per 50 ms, not one per
# token (before: 1.3-2.2x on both CPUs; since: 1.0-1.3x on the Xeon).
BOUND = 2
# A window in which the VM's host took more than this of the two cores (`steal`, from /proc/stat) is
# measured again, once: the host's other guests are neither raylane nor the attacker, and at 1-2 s of
# steal in 8 s every class, old and new, came out 1.8-2.7x against ~1.5x in quiet windows.
MAX_STEAL_S = 0.5
# Reported, its answers and memory checked, but its victim p95 not yet held to BOUND (issue #62 stays
# open for it): 1.34-1.70x over three runs of the class alone, 1.19-2.16x in earlier runs. What it
# costs is not raylane's to schedule: Serve's proxy and the gateway replica each pull a request's body
# as fast as the client sends it (`proxy_asgi_receive`, `ASGIReceiveProxy`), whatever the gateway
# reads, so one 64 MiB upload crosses both in ~0.5 s; the victim's requests in that half second take
# 2-4x their time, and they are 5-7% of its window: its p95.
# "batch with huge output lines" was here (1.43-2.2x in four runs) until the batch actor stopped
# parsing and writing again each line's result (~0.3 s of CPU for a 3.6 MB embeddings line) and its
# 150 refusals a window stopped being raised through Ray (a traceback formatted for each): 1.23-1.46x.
NOT_YET_BOUND = {"parallel 64 MiB uploads"}


# -- the victim: ordinary requests back to back, each with its send time, latency and status ---------


async def victim(url: str) -> None:
    """Until stdin closes, in each of VICTIM_LOOPS loops: an `auto` chat request, then /health, one
    after another. Prints one JSON line of samples [kind, sent (monotonic), seconds, status]."""
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
    samples = []
    stop = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read))

    async def loop(http: httpx2.AsyncClient) -> None:
        while not stop.done():
            for kind, send in (
                ("chat", lambda: http.post("/v1/chat/completions", json=chat_body())),
                ("health", lambda: http.get("/health")),
            ):
                sent = time.monotonic()
                try:
                    status = (await send()).status_code
                except httpx2.HTTPError:
                    status = 0
                samples.append([kind, sent, time.monotonic() - sent, status])
            await asyncio.sleep(0.1)

    async with httpx2.AsyncClient(base_url=url, timeout=120, headers=headers) as http:
        await asyncio.gather(*(loop(http) for _ in range(VICTIM_LOOPS)))
    print(json.dumps(samples))


def module_process(*args: str) -> subprocess.Popen:
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "tests.reliability.test_noisy_neighbour", *args]
    return subprocess.Popen(command, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def cpu_spent(before: dict[str, float]) -> dict[str, float]:
    """The CPU seconds since `before` (`serve_cpu_s`): the server's by process, `rest` for everything
    else on the machine (the victim's and attacker's processes, Ray's own), and `steal`."""
    spent = {k: v - before.get(k, 0.0) for k, v in serve_cpu_s(APP).items()}
    spent["rest"] = spent.pop("machine") - sum(v for k, v in spent.items() if k != "steal")
    return {k: round(v, 2) for k, v in spent.items()}


def batch_actor_pss_mb() -> float:
    """The app's batch actor's memory (proportional set size, MiB, without Ray's object store)."""
    import ray

    from raylane.bench.common import process_tree_pss_mib
    from raylane.deployments.batch.service import service_name
    from raylane.deployments.detached import NAMESPACE

    actor = ray.get_actor(service_name(APP), namespace=NAMESPACE)
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    return sum(pss for _, _, pss in process_tree_pss_mib(root=pid, shmem=False).values())


def p95(values: list[float]) -> float:
    """As numpy's percentile computes it (linear between the two nearest samples): of a window's
    ~25 samples it is not the slowest one, as the `exclusive` method's would be."""
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def test_one_key_abusing_the_api_does_not_hurt_another(app, report):
    # Warm up what a run loads once: the classifier, the pool, the embeddings worker and its model
    # (~100 MB, started by the first /v1/embeddings call, here with one turn of long texts as the
    # attack's), the grammar workers (started by the first grammar): the memory bound is on growth,
    # not on first loads.
    auth = {"Authorization": f"Bearer {VICTIM_KEY}"}
    with httpx2.Client(base_url=app, timeout=60, headers=auth) as http:
        for _ in range(3):
            assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200
        for texts in (["warm up " * 200] * 32, [f"word {i}" for i in range(32)]):  # long and short
            embeddings = {"model": "all-MiniLM-L6-v2", "input": texts}
            assert http.post("/v1/embeddings", json=embeddings).status_code == 200
        json_mode = chat_body(response_format={"type": "json_object"})
        assert http.post("/v1/chat/completions", json=json_mode).status_code == 200
        assert http.get("/v1/files").status_code == 200  # the batch actor is up
    memory_before = replica_tree_pss_mb(APP, shmem=False)["Gateway"]
    batch_memory_before = batch_actor_pss_mb()
    victim_process = module_process("--victim", app)
    attacker_process = module_process("--attacker", app)
    windows: dict[str, tuple[float, float]] = {}  # class -> (start, end) monotonic
    unloaded: list[tuple[float, float]] = []
    attacks: dict[str, dict] = {}
    gateway_memory: dict[str, int] = {}  # class -> the gateway's growth after it, MiB
    server_cpu: dict[str, dict[str, float]] = {}  # window -> the server's CPU seconds in it, by process
    stolen: dict[str, float] = {}  # class -> the steal of its first window, when it was measured again
    try:
        assert attacker_process.stdout.readline().strip() == "ready"
        time.sleep(2)  # the victim's process starts
        for i, name in enumerate(ATTACKS):
            time.sleep(1)  # the last class's tail is done
            if i % UNLOADED_EVERY == 0:
                start, cpu_before = time.monotonic(), serve_cpu_s(APP)
                time.sleep(ATTACK_S)
                unloaded.append((start, time.monotonic()))
                server_cpu[f"unloaded {len(unloaded)}"] = cpu_spent(cpu_before)
            for _ in range(2):  # once more if the VM's host took the CPU meanwhile (MAX_STEAL_S)
                attacker_process.stdin.write(name + "\n")
                attacker_process.stdin.flush()
                assert attacker_process.stdout.readline().strip() == "go"
                start, cpu_before = time.monotonic(), serve_cpu_s(APP)
                attacks[name] = json.loads(attacker_process.stdout.readline())
                windows[name] = (start, time.monotonic())
                server_cpu[name] = cpu_spent(cpu_before)
                if server_cpu[name].get("steal", 0) <= MAX_STEAL_S or name in stolen:
                    break
                stolen[name] = server_cpu[name]["steal"]
                time.sleep(1)
            gateway_memory[name] = round(replica_tree_pss_mb(APP, shmem=False)["Gateway"] - memory_before)
    finally:
        attacker_process.stdin.close()
        samples = json.loads(victim_process.communicate("", timeout=120)[0])
        attacker_process.wait(30)
    memory_growth = replica_tree_pss_mb(APP, shmem=False)["Gateway"] - memory_before
    batch_memory_growth = batch_actor_pss_mb() - batch_memory_before

    def latencies(spans, kind="chat") -> list[float]:
        return [s for k, sent, s, _ in samples if k == kind and any(a <= sent < b for a, b in spans)]

    statuses = [status for _, _, _, status in samples]
    assert all(status == 200 for status in statuses), sorted(set(statuses))  # no 5xx, no 429, none lost
    # The unloaded p95 is taken as the loaded one is, over one window of ATTACK_S: the median of the
    # unloaded windows' p95s. (The p95 of all unloaded requests at once is a lower figure than any
    # one window's, which has fewer requests: a loaded window would be judged against it even with
    # no attacker at all.)
    base = statistics.median(p95(latencies([window])) for window in unloaded)
    rows = {}
    unloaded_cpu = [server_cpu[f"unloaded {i + 1}"] for i in range(len(unloaded))]
    front = ("proxy", "Gateway")  # what turns a request away
    front_unloaded = statistics.median(sum(c.get(k, 0) for k in front) for c in unloaded_cpu)
    for name, window in windows.items():
        loaded = latencies([window])
        front_cpu = sum(server_cpu[name].get(k, 0) for k in front) - front_unloaded
        sent = sum(attacks[name]["statuses"].values())
        rows[name] = {
            "victim_p95_ms": f"{base * 1000:.0f} -> {p95(loaded) * 1000:.0f}",
            "victim_requests": len(loaded),
            "attacker_statuses": attacks[name]["statuses"],
            "gateway_memory_growth_mib": gateway_memory[name],
            "server_cpu_s": server_cpu[name],
            "proxy_and_gateway_ms_per_attack": round(1000 * front_cpu / sent),
            "measured_again_after_steal_s": stolen.get(name),
        }
    report(
        "noisy neighbour: unloaded windows",
        victim_p95_ms=[round(p95(latencies([w])) * 1000) for w in unloaded],
        server_cpu_s={
            k: round(statistics.median(c.get(k, 0) for c in unloaded_cpu), 2) for k in unloaded_cpu[0]
        },
    )
    for name, row in rows.items():
        report(f"noisy neighbour: {name}", **row, victim_errors=0)
    report(
        "noisy neighbour: memory",
        gateway_growth_mib=round(memory_growth),
        batch_actor_growth_mib=round(batch_memory_growth),
    )
    for name, row in rows.items():
        assert not attacks[name]["malformed"], (name, attacks[name]["malformed"][:3])
        assert set(map(int, attacks[name]["statuses"])) <= {200, 400, 413, 429}, (name, row)
        loaded = p95(latencies([windows[name]]))
        assert loaded <= (5.0 if name in NOT_YET_BOUND else min(BOUND * base, 5.0)), (name, rows)
    assert memory_growth < 50, memory_growth
    assert batch_memory_growth < 50, batch_memory_growth


if __name__ == "__main__":
    if sys.argv[1] == "--attacker":
        # On a real network the attacker is another machine: here it runs only on CPU the server
        # leaves idle. Ray runs its workers (the server) at nice 15, so nice 19 would still give the
        # attacker 15/36 of a server process's share; SCHED_IDLE gives it about 3/36.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    asyncio.run(victim(sys.argv[2]) if sys.argv[1] == "--victim" else attacker(sys.argv[2]))
