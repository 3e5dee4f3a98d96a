"""OpenAI's Batch API, driven by the unmodified `openai` SDK: files, batches, their output and error
files, cancelling, a crash of the batch actor, and interactive requests served ahead of batch lines.

The main test app (demo Llama as `chat`, open mode) and the router app (API keys; its `chat` pool
takes one request at a time)."""

import asyncio
import io
import json
import time

import httpx2
import openai
import pytest
import ray
from openai.types import Completion
from openai.types.chat import ChatCompletion

from raylane.cluster.status import collect, render
from raylane.deployments.batch.service import service_name
from raylane.deployments.detached import NAMESPACE
from tests.integration.test_metrics import scrape, value
from tests.live_servers import ROUTER_APP, ROUTER_KEYS, wait_healthy, wait_until

BOUNDARY = "raylane-test-boundary"

pytestmark = pytest.mark.timeout(300)
ENDED = ("completed", "failed", "expired", "cancelled")


def jsonl(lines: list[dict]) -> io.BytesIO:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return io.BytesIO((text + "\n").encode())


def chat_line(custom_id: str, text: str, model: str = "chat", max_tokens: int = 6) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body | {"temperature": 0},
    }


def submit(client: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    source = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint=endpoint, completion_window="24h")


def wait_ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 180) -> tuple[object, list[str]]:
    """The batch once it has ended, and every status it was seen in on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if batch.status in ENDED:
            return batch, seen
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} still {seen[-1]} after {timeout_s} s")


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_200_line_batch_mixing_endpoints_and_auto_runs_every_line_once(client, api_server):
    """Chat lines to a pool and to `auto`, completions lines, one line that is not JSON and one
    naming no served model: 200 answers, two error lines, one completed batch."""
    lines = []
    for i in range(200):
        if i % 3 == 1:
            body = {"model": "chat", "prompt": f"Item {i}:", "max_tokens": 4, "temperature": 0}
            lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})
        else:
            lines.append(chat_line(f"c{i}", f"Say something about {i}.", "auto" if i % 3 == 2 else "chat", 4))
    lines += [
        '{"custom_id": "broken", "method": "POST", "url": ',
        chat_line("lost", "Hi", model="no-such-model"),
    ]
    batch = submit(client, lines)
    assert batch.status == "validating" and batch.endpoint == "/v1/chat/completions"
    batch, seen = wait_ended(client, batch.id)
    assert batch.status == "completed", batch.errors
    assert set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        202,
        200,
        2,
    )
    output = records(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(f"c{i}" for i in range(200))
    for record in output:
        assert record["error"] is None and record["response"]["status_code"] == 200
        model = Completion if int(record["custom_id"][1:]) % 3 == 1 else ChatCompletion
        model.model_validate(record["response"]["body"])
    failed = {r["custom_id"]: r for r in records(client, batch.error_file_id)}
    assert failed[""]["error"]["code"] == "invalid_json_line" and failed[""]["response"] is None
    assert failed["lost"]["response"]["status_code"] == 404
    assert "no-such-model" in failed["lost"]["response"]["body"]["error"]["message"]
    usage = sum(r["response"]["body"]["usage"]["total_tokens"] for r in output)
    assert batch.usage.total_tokens == usage > 0

    def counted() -> bool:  # the batch actor reports its counts each second: they arrive
        samples = scrape(api_server.url)
        return (
            value(samples, "raylane_batch_lines_total", endpoint="/v1/completions", result="completed") >= 67
            and value(samples, "raylane_batch_lines_total", result="failed") >= 2
            and value(samples, "raylane_batch_tokens_total", kind="output") >= batch.usage.output_tokens
            and value(samples, "raylane_batches", status="completed") >= 1
        )

    wait_until(counted, 30, "the batch's lines, tokens and status in /metrics")


def test_a_batch_line_is_answered_as_the_same_request_sent_alone(client):
    questions = {f"q{i}": f"Say something about the number {i}." for i in range(3)}
    batch, _ = wait_ended(
        client, submit(client, [chat_line(cid, text) for cid, text in questions.items()]).id
    )
    for record in records(client, batch.output_file_id):
        alone = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": questions[record["custom_id"]]}],
            max_tokens=6,
            temperature=0,
        )
        body = record["response"]["body"]
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content


def test_embeddings_and_completions_run_as_batches(client):
    texts = ["a cat on a mat", "the stock market fell"]
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "all-MiniLM-L6-v2", "input": t},
        }
        for i, t in enumerate(texts)
    ]
    batch, _ = wait_ended(client, submit(client, lines, "/v1/embeddings").id)
    assert batch.status == "completed"
    by_id = {
        r["custom_id"]: r["response"]["body"]["data"][0]["embedding"]
        for r in records(client, batch.output_file_id)
    }
    alone = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    for i in range(2):
        assert by_id[f"e{i}"] == pytest.approx(alone.data[i].embedding, abs=1e-5)

    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions"}
    line["body"] = {"model": "chat", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    batch, _ = wait_ended(client, submit(client, [line], "/v1/completions").id)
    (record,) = records(client, batch.output_file_id)
    alone = client.completions.create(model="chat", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert record["response"]["body"]["choices"][0]["text"] == alone.choices[0].text


def test_a_file_repeating_a_custom_id_fails_validation_naming_the_line(client):
    lines = [chat_line("x", "Hello"), chat_line("y", "Hi"), chat_line("x", "Hello again")]
    batch, seen = wait_ended(client, submit(client, lines).id)
    assert batch.status == "failed" and batch.failed_at is not None and "in_progress" not in seen
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [(3, "duplicate_custom_id", "custom_id")]
    assert batch.output_file_id is None


def test_files_can_be_listed_read_and_deleted(client):
    content = jsonl([chat_line("a", "Hello")]).getvalue()
    uploaded = client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose) == ("mine.jsonl", len(content), "batch")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == content
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", content), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
        )


def test_batches_are_listed_newest_first_in_pages(client):
    ids = [submit(client, [chat_line("a", "Hi", max_tokens=1)]).id for _ in range(3)]
    listed = [b.id for b in client.batches.list(limit=2)]  # the SDK follows `after` through the pages
    assert listed[:3] == ids[::-1]
    for batch_id in ids:
        wait_ended(client, batch_id)


def test_a_cancelled_batch_keeps_the_lines_it_finished(client):
    lines = [chat_line(f"l{i}", f"Count to {i}.", max_tokens=40) for i in range(40)]
    batch = submit(client, lines)
    while client.batches.retrieve(batch.id).request_counts.completed < 2:
        time.sleep(0.2)
    rows, app_wide = collect("raylane")  # `raylane status` lists it, with its progress
    (listed,) = [b for b in app_wide["batches"] if b["id"] == batch.id]
    assert listed["status"] == "in_progress" and listed["request_counts"]["completed"] >= 2
    assert batch.id in render(rows, app_wide) and "lines in flight:" in render(rows, app_wide)
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch, seen = wait_ended(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    done = records(client, batch.output_file_id)
    assert 2 <= len(done) < 40 and batch.request_counts.completed == len(done)
    assert len({r["custom_id"] for r in done}) == len(done)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def kill_one(app: str, deployment: str) -> str:
    from tests.reliability.conftest import replica_names

    [victim] = replica_names(app, deployment)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    return victim


def test_a_batch_survives_its_gateway_pool_and_actor_dying_and_runs_no_line_twice(client, api_server):
    """Mid-way through a batch: the gateway replica and the pool replica serving its lines are
    killed, and then the batch actor itself (Ray restarts it; Serve replaces the replicas)."""
    from tests.reliability.conftest import replica_names

    lines = [chat_line(f"l{i}", f"Name the colour number {i}.", max_tokens=24) for i in range(30)]
    batch = submit(client, lines)
    actor = ray.get_actor(service_name("raylane"), namespace=NAMESPACE)

    def counts() -> dict:  # from the batch actor: no gateway needed to ask
        return ray.get(actor.batch.remote(None, batch.id), timeout=30)["request_counts"]

    wait_until(lambda: counts()["completed"] >= 3, 120, "three lines done")
    gateway, pool = kill_one("raylane", "Gateway"), kill_one("raylane", "ModelPool:chat")
    before = counts()  # no line can finish now until a new gateway serves it
    wait_until(lambda: replica_names("raylane", "Gateway") not in ([], [gateway]), 120, "a new gateway")
    wait_healthy(f"{api_server.url}/health", 120)
    try:
        wait_until(lambda: counts()["completed"] > before["completed"], 180, "a line done after the kills")
    except TimeoutError as e:
        state = ray.get(actor.runner_state.remote())
        raise AssertionError(f"{e}; counts {before} -> {counts()}; lines: {state}") from None
    assert counts()["completed"] < 30, "the batch ended before its actor could be killed mid-way"
    ray.kill(actor, no_restart=False)
    batch, _ = wait_ended(client, batch.id, timeout_s=240)
    assert batch.status == "completed" and batch.request_counts.completed == 30
    output = records(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(f"l{i}" for i in range(30))
    assert {r["response"]["status_code"] for r in output} == {200}
    assert replica_names("raylane", "ModelPool:chat") not in ([], [pool])


def test_a_batch_is_taken_up_by_a_new_actor_after_the_app_restarts(client, api_server):
    """As after `raylane serve` is restarted: the batch actor gone for good (as the app's shutdown
    removes it), then a new gateway replica starting. It finds the batch database of the earlier
    run, starts a new actor, and the batch finishes with every line once."""
    from tests.reliability.conftest import replica_names

    lines = [chat_line(f"l{i}", f"Name the fruit number {i}.", max_tokens=24) for i in range(20)]
    batch = submit(client, lines)
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 120, "three lines")
    ray.kill(ray.get_actor("raylane-batch-raylane", namespace="raylane"), no_restart=True)
    gateway = kill_one("raylane", "Gateway")
    wait_until(lambda: replica_names("raylane", "Gateway") not in ([], [gateway]), 120, "a new gateway")
    wait_healthy(f"{api_server.url}/health", 120)

    def actor_alive() -> bool:
        try:
            actor = ray.get_actor("raylane-batch-raylane", namespace="raylane")
            return isinstance(ray.get(actor.active_batches.remote(), timeout=30), list)
        except (ValueError, ray.exceptions.RayError):
            return False

    # Before any call of the Batch API (which would start one too): the gateway's own start did.
    wait_until(actor_alive, 60, "a new batch actor")
    batch, _ = wait_ended(client, batch.id, timeout_s=240)
    assert batch.status == "completed" and batch.request_counts.completed == 20
    output = records(client, batch.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(f"l{i}" for i in range(20))


def test_a_line_whose_call_never_answers_is_cancelled_and_tried_again(router_server):
    """The router app's `chat` pool holds every request while its fault is "hold": the line's call
    gets no answer. Past `batch.line_timeout_s` (5 s there) it is cancelled and the line waits for
    its next try, so a call lost with a gateway replica cannot hold a place in the window for good;
    once the pool answers, the line completes, once."""
    client = openai.OpenAI(base_url=router_server.base_url, api_key=ROUTER_KEYS["standard"], max_retries=0)
    router_server.set_fault("chat", "hold")
    try:
        batch = submit(client, [chat_line("held", "Hi", max_tokens=4)])
        actor = ray.get_actor(service_name(ROUTER_APP), namespace=NAMESPACE)
        wait_until(lambda: ray.get(actor.runner_state.remote()).get("waiting_to_retry"), 60, "a second try")
    finally:
        router_server.set_fault("chat", None)
    batch, _ = wait_ended(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    (record,) = records(client, batch.output_file_id)
    assert (record["custom_id"], record["response"]["status_code"]) == ("held", 200)


def test_another_key_cannot_see_a_keys_batch_or_file(router_server):
    def keyed(tier: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=router_server.base_url, api_key=ROUTER_KEYS[tier], max_retries=0)

    owner, other = keyed("standard"), keyed("premium")
    batch = submit(owner, [chat_line("a", "Hi", max_tokens=1)])
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.input_file_id)
    assert batch.id not in [b.id for b in other.batches.list()]
    assert wait_ended(owner, batch.id)[0].status == "completed"


def test_an_interactive_request_waits_for_no_more_than_the_batch_line_in_flight(router_server):
    """The router app's `chat` pool takes one request at a time. While a batch of long lines runs on
    it, a premium request sent just after a line started waits for that line only: batch lines do
    not queue ahead of it (sent at once as interactive requests of one tier, up to 8 would)."""
    client = openai.OpenAI(base_url=router_server.base_url, api_key=ROUTER_KEYS["standard"], max_retries=0)
    premium = openai.OpenAI(base_url=router_server.base_url, api_key=ROUTER_KEYS["premium"], max_retries=0)
    batch = submit(client, [chat_line(f"l{i}", f"Tell me about {i}.", max_tokens=48) for i in range(10)])

    def completed() -> int:
        return client.batches.retrieve(batch.id).request_counts.completed

    while (before := completed()) < 2:
        time.sleep(0.05)
    while completed() == before:  # a line just finished: the next one has its whole run ahead
        time.sleep(0.02)
    answer = premium.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    served_ahead = completed() - before - 1
    assert answer.choices[0].message.content is not None
    assert served_ahead <= 1, f"{served_ahead} batch lines were served while the premium request waited"
    batch, _ = wait_ended(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 10


def test_an_offline_run_writes_each_line_once_and_resumes_a_partial_output(client, api_server, tmp_path):
    """`raylane batch run` (Ray Data through the app's gateway): an output already holding two
    lines, as an interrupted run leaves it, gets the four others and keeps the two."""
    from raylane.cluster.cli import main

    lines = [chat_line(f"l{i}", f"Write about the sea, part {i}.") for i in range(6)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    earlier = [{"custom_id": "l0", "kept": True}, {"custom_id": "l1", "kept": True}]
    output = tmp_path / "out.jsonl"
    output.write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"custom_id": "l2", "cut sh')
    assert main(["batch", "run", str(source), "--output", str(output), "--app", "raylane"]) == 0
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert written[:2] == earlier
    assert sorted(r["custom_id"] for r in written) == ["", "l0", "l1", "l2", "l3", "l4", "l5"]
    (unreadable,) = [r for r in written if r["custom_id"] == ""]
    assert unreadable["error"]["code"] == "invalid_json_line" and unreadable["response"] is None
    l3 = next(r for r in written if r["custom_id"] == "l3")
    alone = client.chat.completions.create(
        model="chat", messages=lines[3]["body"]["messages"], max_tokens=6, temperature=0
    )
    assert l3["response"]["status_code"] == 200
    assert l3["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content


def test_a_file_is_streamed_back_whole_in_pages(client):
    """A 5 MiB file comes back in several pages of the batch actor, byte for byte."""
    line = json.dumps(chat_line("x", "y" * 4000)) + "\n"
    content = (line * (5 * 2**20 // len(line) + 1)).encode()
    uploaded = client.files.create(file=("big.jsonl", content), purpose="batch")
    assert uploaded.bytes == len(content)
    with client.files.with_streaming_response.content(uploaded.id) as response:
        pieces = list(response.iter_bytes())
    assert b"".join(pieces) == content
    client.files.delete(uploaded.id)


def test_a_tier_that_has_not_opted_in_to_batches_gets_a_403(router_server):
    free = openai.OpenAI(base_url=router_server.base_url, api_key=ROUTER_KEYS["free"], max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="tiers\\[\\].batches"):
        free.files.create(file=("in.jsonl", jsonl([chat_line("a", "Hi")])), purpose="batch")
    with pytest.raises(openai.PermissionDeniedError, match="batches_not_allowed|may not"):
        free.batches.create(input_file_id="file-x", endpoint="/v1/chat/completions", completion_window="24h")


def multipart_head(filename: str) -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


async def test_a_keys_second_upload_while_its_first_is_under_way_is_a_429_with_retry_after(router_server):
    """The router app lets a key upload one file at a time: a second upload sent while the first one's
    body is still coming (slowly, chunked) is turned away at once, telling when to come back; the first
    completes, and the key may upload again."""
    headers = {"authorization": f"Bearer {ROUTER_KEYS['premium']}"}
    line = (json.dumps(chat_line("s", "Hi")) + "\n").encode()
    begun = asyncio.Event()

    async def slow_body():
        yield multipart_head("slow.jsonl")
        begun.set()
        for _ in range(6):
            await asyncio.sleep(0.5)
            yield line
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    async with httpx2.AsyncClient(base_url=router_server.base_url, timeout=60) as http:
        multipart = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
        first = asyncio.create_task(http.post("/files", content=slow_body(), headers=headers | multipart))
        await begun.wait()
        await asyncio.sleep(1.0)  # the gateway has its headers: the upload holds the key's place
        files = {"file": ("fast.jsonl", line)}
        second = await http.post("/files", files=files, data={"purpose": "batch"}, headers=headers)
        first = await first
        again = await http.post("/files", files=files, data={"purpose": "batch"}, headers=headers)
    assert second.status_code == 429, second.text
    assert int(second.headers["retry-after"]) >= 1
    assert "batch.max_concurrent_uploads_per_key" in second.json()["error"]["message"]
    assert first.status_code == 200 and first.json()["bytes"] == 6 * len(line), first.text
    assert again.status_code == 200, again.text


def test_a_line_of_a_key_no_longer_allowed_batches_is_refused_with_the_code_that_stops_its_batch(
    router_server,
):
    """What the batch actor hears for a line whose key is gone from the config (or its Secret), or
    whose tier does not allow batches: a 403 with a code that stops the batch at that line."""
    import hashlib

    from ray import serve

    gateway = serve.get_deployment_handle("Gateway", ROUTER_APP)
    body = json.dumps(chat_line("x", "Hi", max_tokens=1)["body"]).encode()

    def line_for(key_id: str) -> tuple[int, dict]:
        status, text, _, _ = gateway.run_batch_line.remote(key_id, "/v1/chat/completions", body).result(
            timeout_s=60
        )
        return status, json.loads(text)

    def key_id(key: str) -> str:
        return f"key-{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    status, answer = line_for("key-000000000000")  # no such key (any more)
    assert (status, answer["error"]["code"]) == (403, "api_key_revoked")
    status, answer = line_for(key_id(ROUTER_KEYS["free"]))
    assert (status, answer["error"]["code"]) == (403, "batches_not_allowed")
    status, answer = line_for(key_id(ROUTER_KEYS["standard"]))
    assert status == 200 and answer["choices"], answer
