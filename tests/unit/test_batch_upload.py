"""The gateway's side of an upload to /v1/files, without Ray: the body is parsed as it arrives and
the file goes to the batch actor in chunks; the gateway never holds it whole."""

import asyncio
import tracemalloc
from types import SimpleNamespace

import pytest

from raylane.config import TierConfig
from raylane.config.batch import BatchConfig
from raylane.deployments.gateway.batch_api import BatchApi
from raylane.deployments.protocol.errors import OpenAIError
from raylane.router import Principal

BOUNDARY = b"unit-test-boundary"
BLOCK = b"0123456789abcdef" * 4096  # 64 KiB, sent again and again: the test allocates no body


class Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        """Sent at once, as Ray sends a call (awaiting it is only waiting for its answer)."""
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.fn(*args))
        return future


class FakeActor:
    """The batch actor's upload calls: counts the chunks it is handed, keeps none."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.aborted: list[str] = []
        self.begin_upload = Remote(lambda owner, key_id, declared: "u1")
        self.upload_chunk = Remote(lambda upload_id, chunk: self.chunks.append(len(chunk)))
        self.finish_upload = Remote(lambda upload_id, name, purpose: {"id": "file-1", "filename": name})
        self.abort_upload = Remote(lambda upload_id: self.aborted.append(upload_id))
        # The gateway's calls go through BatchService.answer(method, *args).
        self.answer = Remote(lambda method, *args: getattr(self, method).fn(*args))


class FakeRequest:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY.decode()}"}

    async def stream(self):
        yield b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield (
            b"--"
            + BOUNDARY
            + b'\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        )
        for _ in range(self.blocks):
            yield BLOCK
        yield b"\r\n--" + BOUNDARY + b"--\r\n"


def batch_api(actor: FakeActor, max_file_bytes: int = 64 * 2**20) -> BatchApi:
    config = SimpleNamespace(batch=BatchConfig(max_file_bytes=max_file_bytes), gateway=None)
    api = BatchApi("app", config)
    api._service = actor
    return api


PRINCIPAL = Principal("key-a", TierConfig(name="standard", priority=1, batches=True))


async def test_a_32_mib_upload_passes_through_the_gateway_in_chunks_never_whole():
    actor = FakeActor()
    api = batch_api(actor)
    tracemalloc.start()
    try:
        record = await api.upload(FakeRequest(blocks=512), PRINCIPAL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert record == {"id": "file-1", "filename": "big.jsonl"}
    assert sum(actor.chunks) == 512 * len(BLOCK) == 32 * 2**20 and max(actor.chunks) <= 2**20 + len(BLOCK)
    assert peak < 4 * 2**20, f"the gateway held {peak / 2**20:.1f} MiB of a 32 MiB upload"


async def test_an_upload_past_the_file_limit_is_stopped_and_its_reservation_given_back():
    actor = FakeActor()
    with pytest.raises(OpenAIError) as refused:
        await batch_api(actor, max_file_bytes=2**20).upload(FakeRequest(blocks=64), PRINCIPAL)
    assert refused.value.status == 413 and actor.aborted == ["u1"]
    assert sum(actor.chunks) <= 2**20 + 64 * 1024 + len(BLOCK)  # it stopped reading there


async def test_a_key_the_actor_refused_is_refused_here_until_its_retry_after():
    """A flood of uploads from a key over its budget costs the batch actor one refusal: the rest are
    turned away by the gateway with what is left of the Retry-After, and another key is not."""
    actor = FakeActor()
    calls = []

    def begin(owner, key_id, declared):
        calls.append(key_id)
        if key_id == "key-a":
            raise OpenAIError("over budget", status=429, code="upload_rate_exceeded", retry_after=30)
        return "u2"

    actor.begin_upload = Remote(begin)
    api = batch_api(actor)
    for _ in range(5):
        with pytest.raises(OpenAIError) as refused:
            await api.upload(FakeRequest(blocks=1), PRINCIPAL)
        assert refused.value.status == 429 and refused.value.code == "upload_rate_exceeded"
        assert 0 < refused.value.retry_after <= 30
    other = Principal("key-b", PRINCIPAL.tier)
    assert (await api.upload(FakeRequest(blocks=1), other))["id"] == "file-1"
    assert calls == ["key-a", "key-b"]


async def test_a_refusal_for_uploads_in_progress_is_asked_again_next_time():
    """One finishing frees a key's place at once: the next upload goes to the actor, not refused here."""
    actor = FakeActor()
    answers = iter([OpenAIError("2 in progress", status=429, code="too_many_uploads", retry_after=5), "u3"])

    def begin(owner, key_id, declared):
        answer = next(answers)
        if isinstance(answer, OpenAIError):
            raise answer
        return answer

    actor.begin_upload = Remote(begin)
    api = batch_api(actor)
    with pytest.raises(OpenAIError):
        await api.upload(FakeRequest(blocks=1), PRINCIPAL)
    assert (await api.upload(FakeRequest(blocks=1), PRINCIPAL))["id"] == "file-1"
