"""The attacker of tests/reliability/test_noisy_neighbour.py: one coroutine per abuse class, each
sending one request and answering (status, what is wrong with an error's shape or None), and
`attacker(url)`, which runs a class per line of stdin, each from its own key, in a process of its own."""

import asyncio
import json
import sys
import time

import httpx2

BODY_LIMIT = 2**20
# 20 requests a second: each one Serve's proxy and the gateway replica turn away costs them ~13 ms of
# CPU together (`server_cpu_s`; Serve's own path, with no work of raylane's past the rate limit), so
# a flood's refusals alone take a quarter of one of the two cores. At 30 a second (0.4 of a core) the
# victim's p95 was 1.3-1.6x run alone but 1.7-4.0x inside the whole suite on the slower CPUs (the
# session's other apps idling alongside, the attacker then at nice 19): a measure of Serve's
# per-request floor, not of raylane.
ATTACK_S, ATTACK_RATE, ATTACKERS = 8.0, 20, 16

# What the attacker sends, one request each; all from one key.
TEXT = "please explain this " * 8
PATHOLOGICAL = ("a" * 30 + "!") * 1000 + " " * 20_000 + "(" * 5000 + "```" + "x=" * 10_000
COSTLY_GRAMMAR = {  # 40 enum strings of 2,000 characters: seconds to compile (test_bad_input)
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"enum": ["x" * 2000 + str(i) for i in range(40)]}},
}


def chat_body(content: str = TEXT, **extra) -> dict:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


# -- the attacker: one coroutine per abuse class, each one request; returns (status, error or None) --


async def answer(response: httpx2.Response) -> tuple[int, str | None]:
    """The status, and for an error what is wrong with its shape (None: OpenAI's, with a message)."""
    body = await response.aread()
    if response.status_code < 400:
        return response.status_code, None
    try:
        error = json.loads(body)["error"]
        ok = isinstance(error["message"], str) and error["message"] and "type" in error
    except (ValueError, KeyError, TypeError):
        ok = False
    return response.status_code, None if ok else body[:200].decode(errors="replace")


async def pathological_auto(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    return await answer(await http.post("/v1/chat/completions", json=chat_body(PATHOLOGICAL)))


HUGE = b'{"model": "auto", "messages": [{"role": "user", "content": "' + b"a" * (4 * BODY_LIMIT) + b'"}]}'


async def huge_body(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    headers = {"content-type": "application/json"}
    return await answer(await http.post("/v1/chat/completions", content=HUGE, headers=headers))


async def huge_fields(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    big = "u" * 200_000
    bodies = [
        chat_body(user=big),
        chat_body(prompt_cache_key=big),
        chat_body(metadata={f"k{i}": "v" * 500 for i in range(200)}),
        chat_body(stop=["s" * 100] * 1000),
    ]
    body = bodies[int(time.monotonic() * 10) % len(bodies)]
    return await answer(await http.post("/v1/chat/completions", json=body))


SENT = {"tokenize or embeddings": 0}


async def big_tokenize_and_embeddings(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    SENT["tokenize or embeddings"] += 1
    if SENT["tokenize or embeddings"] % 2 == 0:  # the first is an embeddings call, the costlier
        body = {"model": "chat", "prompt": "tokenize me " * 60_000}
        return await answer(await http.post("/tokenize", json=body))
    body = {"model": "all-MiniLM-L6-v2", "input": ["embed this sentence please " * 40] * 256}
    return await answer(await http.post("/v1/embeddings", json=body))


async def detokenize_flood(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    """/detokenize of 150,000 ids (past the pool's context: charged as many tokens, then a 400 from
    the pool) and of 250 (decoded): each charged its tokens and admitted like a generation."""
    SENT["detokenize"] = SENT.get("detokenize", 0) + 1
    count = 150_000 if SENT["detokenize"] % 2 else 250
    body = {"model": "chat", "tokens": [5 + i % 500 for i in range(count)]}
    return await answer(await http.post("/detokenize", json=body))


async def pool_flood(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    body = chat_body(max_tokens=200, ignore_eos=True, stream=True)
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        return await answer(response)


async def grammar_flood(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    body = chat_body(response_format=COSTLY_GRAMMAR)
    return await answer(await http.post("/v1/chat/completions", json=body))


async def slow_reader(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    """A stream whose client reads its first chunk, then nothing for seconds, then hangs up."""
    body = chat_body(max_tokens=200, ignore_eos=True, stream=True)
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return await answer(response)
        async for _ in response.aiter_raw():
            await asyncio.sleep(3)
            break
        return 200, None


EMBEDDINGS_MODEL = "all-MiniLM-L6-v2"
# One batch input: embeddings lines of 512 short inputs (~3.6 MB of JSON each: under
# batch.max_line_result_bytes, so kept and written out) and of 2,048 (~15 MB: computed until past
# the cap, then that line's error).
BATCH_INPUT = "".join(
    json.dumps(
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {
                "model": EMBEDDINGS_MODEL,
                "input": [f"word {j}" for j in range(512 if i % 2 else 2048)],
            },
        }
    )
    + "\n"
    for i in range(16)
).encode()
BOUNDARY = "rel-nn-boundary"
UPLOAD_HEADERS = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def multipart(content: bytes, filename: str) -> bytes:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    )
    return head.encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()


async def upload_batch_input(http: httpx2.AsyncClient) -> None:
    response = await http.post(
        "/v1/files", content=multipart(BATCH_INPUT, "embed.jsonl"), headers=UPLOAD_HEADERS
    )
    assert response.status_code == 200, response.text
    SENT["batch input"] = response.json()["id"]


async def huge_output_batch(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    body = {"input_file_id": SENT["batch input"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
    response = await http.post("/v1/batches", json=body)
    if response.status_code == 200:
        SENT.setdefault("batches", []).append(response.json()["id"])
    return await answer(response)


async def end_batches(http: httpx2.AsyncClient) -> None:
    """Cancels the class's batches and waits until each has stopped (its next window is unloaded)."""
    for batch_id in SENT.get("batches", []):
        await http.post(f"/v1/batches/{batch_id}/cancel")
    for batch_id in SENT.get("batches", []):
        while (await http.get(f"/v1/batches/{batch_id}")).json()["status"] in (
            "validating",
            "in_progress",
            "finalizing",
            "cancelling",
        ):
            await asyncio.sleep(0.5)


# A 64 MiB upload (batch.max_file_bytes), JSONL of 4 KiB chat lines; sent as a whole, never read.
UPLOAD_LINE = (
    json.dumps(
        {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": chat_body("x" * 3900)}
    )
    + "\n"
).encode()
BIG_UPLOAD = multipart(UPLOAD_LINE * (64 * 2**20 // len(UPLOAD_LINE)), "big.jsonl")
# The attacker's key may start one such upload a minute (batch.max_upload_bytes_per_minute_per_key):
# at 2 uploads at once and no budget, 20 of them (1.3 GB) went through one window, the proxy and the
# gateway spending ~11 ms of CPU per MiB, and the victim's p95 was 3.9x (one run, an install running beside).
UPLOAD_BUDGET = 64 * 2**20


async def big_upload(http: httpx2.AsyncClient) -> tuple[int, str | None]:
    response = await http.post("/v1/files", content=BIG_UPLOAD, headers=UPLOAD_HEADERS)
    if response.status_code == 200:
        SENT.setdefault("files", []).append(response.json()["id"])
    return await answer(response)


async def delete_uploads(http: httpx2.AsyncClient) -> None:
    for file_id in SENT.get("files", []):
        await http.delete(f"/v1/files/{file_id}")


ATTACKS = {
    "pathological text via auto": pathological_auto,
    "huge bodies": huge_body,
    "huge field values": huge_fields,
    "oversized /tokenize and embeddings": big_tokenize_and_embeddings,
    "/detokenize flood": detokenize_flood,
    "one key flooding a pool": pool_flood,
    "grammar-compile flood": grammar_flood,
    "slow readers": slow_reader,
    "batch with huge output lines": huge_output_batch,
    "parallel 64 MiB uploads": big_upload,
}
# A client's network bounds the bytes it can send: 20 uploads of 64 MiB a second is 10 Gb/s from one
# client, which loopback carries at the cost of the kernel's and the proxy's CPU (Serve's proxy reads
# a body whatever the gateway answers: ~70 ms of proxy and gateway CPU per refused upload). Two a
# second is a 1 Gb/s link's worth.
RATES = {"parallel 64 MiB uploads": 2}
BEFORE = {"batch with huge output lines": upload_batch_input}  # run before the class's window
AFTER = {"batch with huge output lines": end_batches, "parallel 64 MiB uploads": delete_uploads}  # in it


async def run_attack(http: httpx2.AsyncClient, attack, rate: float = ATTACK_RATE) -> dict:
    """`attack` at `rate` requests a second for ATTACK_S, whatever the answers (no backoff, at
    most ATTACKERS at once): the statuses, and error answers not in OpenAI's shape."""
    statuses, malformed, running = {}, [], set()

    async def one() -> None:
        status, wrong = await attack(http)
        statuses[status] = statuses.get(status, 0) + 1
        if wrong is not None:
            malformed.append([status, wrong])

    start = time.monotonic()
    for i in range(int(ATTACK_S * rate)):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        if len(running) < ATTACKERS:
            task = asyncio.create_task(one())
            running.add(task)
            task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    return {"statuses": statuses, "malformed": malformed}


def attacker_key(attack: str) -> str:
    """Each class's own key: its limits are not spent by the class before it."""
    return f"rel-nn-attacker-{list(ATTACKS).index(attack)}"


async def attacker(url: str) -> None:
    """For each line `NAME` on stdin: that class's `run_attack`, printed as one JSON line."""
    limits = httpx2.Limits(max_connections=ATTACKERS * 2)
    async with httpx2.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await http.get("/health")  # connected and warm before the first window
        print("ready", flush=True)
        while name := (await asyncio.to_thread(sys.stdin.readline)).strip():
            http.headers["Authorization"] = f"Bearer {attacker_key(name)}"
            if name in BEFORE:
                await BEFORE[name](http)
            print("go", flush=True)
            result = await run_attack(http, ATTACKS[name], RATES.get(name, ATTACK_RATE))
            if name in AFTER:
                await AFTER[name](http)
            print(json.dumps(result), flush=True)
