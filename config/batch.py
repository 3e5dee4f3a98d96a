"""`batch:` — OpenAI's Batch API (`/v1/files`, `/v1/batches`) run on the capacity interactive
traffic leaves idle (deployments/batch/)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from pydantic import Field, field_validator

from raylane.config.base import StrictModel
from raylane.config.router import TierConfig

BATCH_TIER = "batch"  # the tier batch lines are served as (no configured tier may take the name)
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


class BatchConfig(StrictModel):
    """OpenAI's Batch API on the capacity interactive traffic leaves idle: where records live, and
    what one key and one line may use."""

    enabled: bool = Field(True, description="Serve /v1/files and /v1/batches.")
    store: str | None = Field(
        None,
        description="where files' and batches' records and each line's result are kept: a SQLite file "
        "path, or a PostgreSQL URL (postgresql://user:password@host/db; a multi-node cluster); "
        "null = $RAYLANE_CACHE_DIR/batch/<app>.sqlite3 on the node the batch actor runs on",
    )
    files_dir: str | None = Field(
        None,
        description="where uploaded and output files' bytes are kept (a shared filesystem path for a "
        "multi-node cluster); null = $RAYLANE_CACHE_DIR/batch/<app>-files",
    )
    max_file_bytes: int = Field(
        64 * 2**20, ge=1, description="largest upload to /v1/files (413 past it); OpenAI's is 200 MB"
    )
    max_lines: int = Field(50_000, ge=1, description="most requests in one batch's input file, as OpenAI's")
    max_files_per_key: int = Field(100, ge=1, description="files one API key may keep at once")
    max_active_batches_per_key: int = Field(
        8, ge=1, description="batches of one API key validating, running or finalizing at once"
    )
    max_active_batches: int = Field(
        64,
        ge=1,
        description="batches of all keys validating, running or finalizing at once (each holds its "
        "input's line index in the batch actor's memory); creating one past it is a 429",
    )
    max_bytes_per_key: int = Field(
        2 * 2**30,
        ge=1,
        description="bytes one API key may keep in the batch store: its files (uploads, outputs and "
        "error files) and the line results of its running batches. An upload past it is a 429; a batch "
        "whose results would pass it fails (`storage_quota_exceeded`), its results dropped",
    )
    max_line_result_bytes: int = Field(
        4 * 2**20,
        ge=1024,
        description="largest response body of one batch line (a 2,048-input embeddings line makes ~16 "
        "MiB): a larger one is that line's error (`line_result_too_large`), the batch goes on",
    )
    max_line_n: int = Field(
        8, ge=1, description="most choices (`n`, times its prompts for completions) a batch line may ask for"
    )
    max_line_tokens: int = Field(
        4096,
        ge=1,
        description="most tokens a batch line may ask to generate (`max_tokens`, "
        "`max_completion_tokens`, `max_output_tokens`); a line asking more is an error line, and a line "
        "that sets no limit is sent with this one",
    )
    max_concurrent_uploads_per_key: int = Field(
        2, ge=1, description="uploads to /v1/files one API key may have in progress at once (429 past it)"
    )
    max_concurrent_uploads: int = Field(
        8,
        ge=1,
        description="uploads to /v1/files of all keys in progress at once (429 past it): Serve's replica "
        "buffers a body as fast as its proxy sends it, so a gateway replica may hold up to this many "
        "files' worth (max_file_bytes each) of memory while they arrive",
    )
    max_upload_bytes_per_minute_per_key: int = Field(
        256 * 2**20,
        ge=1,
        description="bytes one API key may upload to /v1/files a minute (a bucket: an upload takes its "
        "declared size before its body is read, a 429 with Retry-After past it, and gets back what it "
        "did not send). Each MiB uploaded costs Serve's proxy and the gateway ~11 ms of CPU, so this "
        "bounds what one key's uploads take from every other key's requests",
    )
    max_concurrency: int = Field(
        8, ge=1, description="lines of all batches in flight at once, reached only while pools are idle"
    )
    max_pool_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="share of each pool's slots batch lines may hold (the rest stays free for "
        "interactive tiers, whose waiting requests also shed batch lines waiting beside them)",
    )
    line_retries: int = Field(
        20, ge=0, description="times a line turned away for load (429/503) is tried again before it fails"
    )
    line_timeout_s: float = Field(
        900,
        gt=0,
        description="a line's call to the gateway that has not answered in this long is cancelled and "
        "tried again (counted as a retry): a call lost with a gateway replica never holds its place in "
        "the window for good",
    )
    file_ttl_s: float = Field(
        30 * 86400, gt=0, description="uploaded and output files are deleted this long after they are made"
    )

    @field_validator("store")
    @classmethod
    def _known_store(cls, value: str | None) -> str | None:
        scheme = value.split("://")[0] if value is not None and "://" in value else None
        if scheme is not None and scheme not in ("postgresql", "postgres"):
            raise ValueError(
                f"{scheme!r} stores are not supported: give a SQLite path or a postgresql:// URL"
            )
        if scheme is not None and _has_password(value):
            # A config travels into serveConfigV2 (a RayService manifest) and Ray's GCS.
            raise ValueError(
                "the URL holds a password: give it as PGPASSWORD (or PGPASSFILE) in the environment of "
                "the batch actor's node, e.g. from a Kubernetes Secret, not in the config"
            )
        return value


def _has_password(url: str) -> bool:
    """Whether a postgresql:// URL carries a password, in its user part or as a parameter."""
    parts = urlsplit(url)
    return parts.password is not None or "password" in {k.lower() for k in parse_qs(parts.query)}


def batch_tier(
    tiers: list[TierConfig], config: BatchConfig, key_tier: TierConfig | None = None
) -> TierConfig:
    """The tier batch lines run as: served after every configured tier (in the admission queue and
    in the engine, which preempts them for any of those), the first shed when a pool's queue is
    full, never holding more than `max_pool_share` of a pool's sequences. Its tokens/min are those
    of `key_tier` (the tier of the key that made the batch: `batch_tokens_per_minute`), charged to a
    bucket of their own, apart from the key's interactive requests."""
    return TierConfig(
        name=BATCH_TIER,
        priority=max(t.priority for t in tiers) + 1,
        max_queue_depth=config.max_concurrency,
        max_queue_wait_s=30.0,
        sheddable=True,
        max_pool_share=config.max_pool_share,
        tokens_per_minute=key_tier.batch_tokens_per_minute if key_tier is not None else None,
    )
