"""The batch actor in this process, without Ray: a fake gateway answers its lines. What one key's
batches and uploads may cost the store and the actor: the byte quota over files and results, the
cap per line result, output files in the file quota, output written and served in pages, a restart
mid-way through writing, the global cap on batches, a revoked key, a key's batch budget, and uploads
reserved before their body is read."""

import asyncio
import json
import time
import tracemalloc

import pytest
import pytest_asyncio

from raylane.deployments.batch import output as output_module
from raylane.deployments.batch import runner as runner_module
from raylane.deployments.batch import service as service_module
from raylane.deployments.batch.service import MAX_PAGE_BYTES, BatchService
from raylane.deployments.protocol.batch_answers import BUDGET_EXCEEDED, KEY_REVOKED, usage_of
from raylane.deployments.protocol.errors import OpenAIError

CHAT = "/v1/chat/completions"
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(autouse=True)
def no_metrics_reports(monkeypatch):
    """The actor's metrics go to the app's aggregator actor: none here (and no Ray)."""

    class Quiet:
        def start(self) -> None:
            pass

    monkeypatch.setattr(service_module, "batch_reporter", lambda *args: Quiet())


SERVICES: list = []


@pytest_asyncio.fixture(autouse=True, loop_scope="function")  # the tests' own loop
async def stopped_at_the_end():
    """Each test's actors stop with it (as a dead actor would: mid-line or not)."""
    yield
    while SERVICES:
        service = SERVICES.pop()
        while tasks := [t for t in [service._driver, *service.tasks.values()] if t and not t.done()]:
            for task in tasks:  # (again and again: a wake racing a cancel may swallow it)
                task.cancel()
            await asyncio.wait(tasks, timeout=0.1)


class FakeGateway:
    """`run_batch_line` answering each line with `answer(custom_id, try)`: (status, body dict)."""

    def __init__(self, answer) -> None:
        self.answer, self.tries = answer, {}

    @property
    def run_batch_line(self):
        return self

    def remote(self, key_id: str, url: str, body: bytes):
        custom_id = json.loads(body)["messages"][0]["content"]
        self.tries[custom_id] = self.tries.get(custom_id, 0) + 1
        status, answer = self.answer(custom_id, self.tries[custom_id])

        async def call():
            return status, json.dumps(answer), False, usage_of(answer)  # as the gateway counts it

        return asyncio.ensure_future(call())


def chat_body(text: str, tokens: int = 3) -> dict:
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": tokens, "total_tokens": 2 + tokens},
    }


def make_service(tmp_path, answer=None, **config) -> BatchService:
    settings = {"store": str(tmp_path / "b.sqlite3"), "files_dir": str(tmp_path / "files"), **config}
    service = BatchService("app", settings, max_body_bytes=2**20)
    SERVICES.append(service)
    service._gateway = FakeGateway(answer or (lambda custom_id, _: (200, chat_body(custom_id))))
    return service


def input_file(n: int, prefix: str = "l", **body) -> bytes:
    lines = []
    for i in range(n):
        request = {"model": "m", "messages": [{"role": "user", "content": f"{prefix}{i}"}], **body}
        lines.append(
            json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": CHAT, "body": request})
        )
    return ("\n".join(lines) + "\n").encode()


async def upload(service: BatchService, content: bytes, owner: str = "me", key: str = "k") -> str:
    upload_id = service.begin_upload(owner, key, len(content))
    for i in range(0, len(content), 2**20):
        await service.upload_chunk(upload_id, content[i : i + 2**20])
    return (await service.finish_upload(upload_id, "in.jsonl", "batch"))["id"]


async def run_batch(service: BatchService, content: bytes, owner: str = "me") -> dict:
    file_id = await upload(service, content, owner)
    batch = service.create_batch(owner, "k", file_id, CHAT, None)
    return await ended(service, batch["id"], owner)


async def ended(service: BatchService, batch_id: str, owner: str = "me", timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = service.batch(owner, batch_id)
        if batch["status"] in ENDED:
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} is still {batch['status']}")


async def content(service: BatchService, file_id: str | None, owner: str = "me") -> list[dict]:
    if file_id is None:
        return []
    data, offset = b"", 0
    while page := await service.file_page(owner, file_id, offset, 2**20):
        data, offset = data + page, offset + len(page)
    return [json.loads(line) for line in data.decode().split("\n") if line]


async def test_a_batch_whose_results_would_pass_the_keys_byte_quota_fails_naming_it(tmp_path):
    big = "x" * 20_000
    service = make_service(tmp_path, lambda custom_id, _: (200, chat_body(big)), max_bytes_per_key=200_000)
    batch = await run_batch(service, input_file(30))
    assert batch["status"] == "failed" and batch["output_file_id"] is None
    (error,) = batch["errors"]["data"]
    assert error["code"] == "storage_quota_exceeded" and "batch.max_bytes_per_key" in error["message"]
    # Its results are dropped: the key keeps only its input file, and may use its quota again.
    assert service.quota.usage("me").bytes == len(input_file(30))
    assert service.store.line_bytes(batch["id"]) == 0
    assert (await run_batch(service, input_file(2, "again")))["status"] == "completed"


async def test_an_upload_past_the_keys_byte_quota_is_refused_before_its_body_is_read(tmp_path):
    service = make_service(tmp_path, max_bytes_per_key=10_000)
    await upload(service, b"x" * 6_000)
    with pytest.raises(OpenAIError) as refused:
        service.begin_upload("me", "k", 6_000)  # declared: no byte sent yet
    assert refused.value.status == 429 and refused.value.param == "batch.max_bytes_per_key"
    await upload(service, b"x" * 3_000, owner="someone else")  # another key's quota is its own


async def test_an_oversize_line_result_is_that_lines_error_and_the_batch_goes_on(tmp_path):
    def answer(custom_id, _):
        return 200, chat_body("y" * (5_000 if custom_id == "l1" else 10))

    service = make_service(tmp_path, answer, max_line_result_bytes=4096)
    batch = await run_batch(service, input_file(3))
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    (failed,) = await content(service, batch["error_file_id"])
    assert failed["custom_id"] == "l1" and failed["error"]["code"] == "line_result_too_large"
    assert "batch.max_line_result_bytes" in failed["error"]["message"]


async def test_a_batchs_output_and_error_files_count_against_the_keys_file_quota(tmp_path):
    service = make_service(tmp_path, max_files_per_key=3)
    file_id = await upload(service, input_file(2))
    batch = service.create_batch("me", "k", file_id, CHAT, None)  # input + its two output files: 3
    with pytest.raises(OpenAIError, match="batch.max_files_per_key"):
        service.begin_upload("me", "k", 10)
    batch = await ended(service, batch["id"])
    assert batch["output_file_id"] and batch["error_file_id"] is None  # no error file: its place is back
    assert [f["purpose"] for f in service.files("me", None, 10, None, "asc")] == ["batch", "batch_output"]
    await upload(service, b"{}")  # the third file
    with pytest.raises(OpenAIError, match="batch.max_files_per_key"):
        await upload(service, b"{}")


async def test_writing_a_large_output_holds_a_page_of_it_not_the_whole(tmp_path):
    """Forty lines of 1 MiB each: the batch's output file is written, and read back, a page at a
    time; the actor's allocations (lines run one at a time here) stay within a few pages, whatever the
    size of the output (without pages: twice the output)."""
    answer = lambda custom_id, _: (200, chat_body("z" * 2**20))  # noqa: E731
    service = make_service(tmp_path, answer, max_concurrency=1)
    file_id = await upload(service, input_file(40))
    tracemalloc.start()
    try:
        batch = service.create_batch("me", "k", file_id, CHAT, None)
        batch = await ended(service, batch["id"])
        _, written_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        size = service.file("me", batch["output_file_id"])["bytes"]
        offset = 0
        while page := await service.file_page("me", batch["output_file_id"], offset, 2**30):
            assert len(page) <= MAX_PAGE_BYTES
            offset += len(page)
        _, served_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batch["status"] == "completed" and offset == size > 40 * 2**20
    bound = 16 * 2**20  # three 4 MiB pages and a few lines
    assert written_peak < bound, f"{written_peak / 2**20:.0f} MiB held to write {size / 2**20:.0f} MiB"
    assert served_peak < bound, f"{served_peak / 2**20:.0f} MiB held to serve {size / 2**20:.0f} MiB"


async def test_an_actor_restarted_while_writing_an_output_goes_on_from_its_last_page(tmp_path, monkeypatch):
    monkeypatch.setattr(output_module, "PAGE_BYTES", 4096)
    service = make_service(tmp_path, lambda custom_id, _: (200, chat_body("w" * 1000)))
    store = service.store
    saves, save = [0], store.save_output_state

    def crash_on_the_fourth_page(batch_id, state):
        saves[0] += 1
        if saves[0] == 5:  # its first save starts the writing; then a page each
            raise asyncio.CancelledError("the actor died")  # nothing of it runs after this
        save(batch_id, state)

    monkeypatch.setattr(store, "save_output_state", crash_on_the_fourth_page)
    file_id = await upload(service, input_file(30))
    batch = service.create_batch("me", "k", file_id, CHAT, None)
    while batch["id"] in service.tasks or saves[0] < 5:
        await asyncio.sleep(0.02)
    assert service.batch("me", batch["id"])["status"] == "finalizing"

    restarted = make_service(tmp_path)
    read: list[tuple[int, int]] = []
    results = restarted.store.results
    monkeypatch.setattr(
        restarted.store,
        "results",
        lambda b, first, last: read.append((first, last)) or results(b, first, last),
    )
    restarted._drive()
    batch = await ended(restarted, batch["id"])
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 30
    output = await content(restarted, batch["output_file_id"])
    assert sorted(r["custom_id"] for r in output) == sorted(f"l{i}" for i in range(30))
    assert read[0][0] > 1, f"the restarted actor wrote the output again from line {read[0][0]}"


async def test_the_cluster_runs_at_most_max_active_batches(tmp_path):
    service = make_service(tmp_path, max_active_batches=2)
    file_id = await upload(service, input_file(1))
    first = service.create_batch("me", "k", file_id, CHAT, None)
    second = service.create_batch("you", "k2", await upload(service, input_file(1), "you"), CHAT, None)
    with pytest.raises(OpenAIError, match="batch.max_active_batches") as refused:
        service.create_batch("me", "k", file_id, CHAT, None)  # both still validating
    assert refused.value.status == 429 and refused.value.retry_after
    await ended(service, first["id"])
    await ended(service, second["id"], "you")
    assert service.create_batch("me", "k", file_id, CHAT, None)["status"] == "validating"


async def test_a_revoked_keys_batch_stops_at_its_next_line_keeping_what_it_did(tmp_path, monkeypatch):
    revoked = {"error": {"message": "The API key is no longer valid.", "code": KEY_REVOKED}}

    def answer(custom_id, _):
        return (403, revoked) if int(custom_id[1:]) >= 3 else (200, chat_body(custom_id))

    service = make_service(tmp_path, answer, max_concurrency=1)
    batch = await run_batch(service, input_file(10))
    assert batch["status"] == "cancelled" and batch["errors"]["data"][0]["code"] == KEY_REVOKED
    done = await content(service, batch["output_file_id"])
    assert sorted(r["custom_id"] for r in done) == ["l0", "l1", "l2"]
    assert sum(service._gateway.tries.values()) == 4  # nothing sent after the refusal


async def test_a_line_over_its_keys_batch_budget_waits_for_it_and_never_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "RETRY_S", (0.01, 0.02))
    over = {"error": {"message": "over budget", "code": BUDGET_EXCEEDED}}

    def answer(custom_id, tries):
        return (429, over) if tries <= 5 else (200, chat_body(custom_id))

    service = make_service(tmp_path, answer, line_retries=1)
    batch = await run_batch(service, input_file(3))
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3


async def test_a_keys_uploads_past_its_cap_are_refused_with_retry_after(tmp_path):
    service = make_service(tmp_path, max_concurrent_uploads_per_key=1, max_files_per_key=1)
    first = service.begin_upload("me", "k", 100)
    with pytest.raises(OpenAIError) as refused:
        service.begin_upload("me", "k", 100)
    assert refused.value.status == 429 and refused.value.retry_after
    assert "batch.max_concurrent_uploads_per_key" in refused.value.message
    # The file quota was reserved by the first: another key of the same owner (open mode's one
    # owner) cannot take the last file while the first upload's body is still coming.
    with pytest.raises(OpenAIError, match="batch.max_files_per_key"):
        service.begin_upload("me", "other-client", 100)
    await service.upload_chunk(first, b"{}")
    assert (await service.finish_upload(first, "a.jsonl", "batch"))["bytes"] == 2
    await service.abort_upload(service.begin_upload("you", "k3", 100))  # an aborted upload frees its place
    assert service.quota.usage("you").files == 0


async def test_a_keys_upload_bytes_a_minute_are_bounded_and_unsent_bytes_come_back(tmp_path):
    """Each key's uploads take their declared size from its budget before a byte is read (Serve's
    proxy moves a body whatever the gateway does with it): past it a 429 naming the setting, with a
    Retry-After; an upload that sent less than it declared gives the rest back; other keys are apart."""
    service = make_service(
        tmp_path, max_upload_bytes_per_minute_per_key=1000, max_concurrent_uploads_per_key=4
    )
    first = service.begin_upload("me", "k", 600)
    with pytest.raises(OpenAIError) as refused:
        service.begin_upload("me", "k", 600)
    assert refused.value.status == 429 and refused.value.code == "upload_rate_exceeded"
    assert "batch.max_upload_bytes_per_minute_per_key" in refused.value.message
    assert 1 <= refused.value.retry_after <= 60
    await service.abort_upload(service.begin_upload("you", "k2", 900))  # another key's budget is its own
    await service.upload_chunk(first, b"x" * 100)
    await service.finish_upload(first, "a.jsonl", "batch")  # sent 100 of 600: 500 come back
    await service.abort_upload(service.begin_upload("me", "k", 800))


async def test_uploads_of_all_keys_at_once_are_capped(tmp_path):
    """Each upload's body can sit in a gateway replica's memory while it arrives (Serve buffers it):
    past `batch.max_concurrent_uploads` of all keys, a 429 naming it; a finished one frees its place."""
    service = make_service(tmp_path, max_concurrent_uploads=2)
    first = service.begin_upload("a", "ka", 10)
    service.begin_upload("b", "kb", 10)
    with pytest.raises(OpenAIError) as refused:
        service.begin_upload("c", "kc", 10)
    assert refused.value.status == 429 and "batch.max_concurrent_uploads" in refused.value.message
    await service.finish_upload(first, "a.jsonl", "batch")
    service.begin_upload("c", "kc", 10)
