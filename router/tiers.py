"""API keys -> tiers. A request's tier comes only from its key, never from anything else it sends.

Keys come from the config inline, an environment variable and a file (the shape of a mounted
Kubernetes Secret, re-read when it changes). Only SHA-256 digests are kept, compared with
`hmac.compare_digest` against every known key so the time taken says nothing about which key
nearly matched. Keys never reach a log or an error message; `Principal.key_id` is a short
digest that is safe to log and to label metrics with.
"""

import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from raylane.config import ApiKeysConfig, TierConfig, open_tier
from raylane.config.router import key_digest
from raylane.router.errors import AuthenticationError

logger = logging.getLogger(__name__)

OPEN_MODE_BANNER = (
    "\n" + "!" * 78 + "\n"
    "!!  raylane is in OPEN DEVELOPMENT MODE: no API keys are configured, so every request\n"
    "!!  is served as tier {tier!r} without authentication. Set api_keys.keys, api_keys.env or\n"
    "!!  api_keys.file before exposing this endpoint.\n" + "!" * 78
)


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str  # "key-<digest prefix>" or "anonymous[:client]": safe to log, never the key itself
    tier: TierConfig


def parse_key_lines(text: str, source: str, tier_names: list[str]) -> dict[bytes, str]:
    """{sha256(key): tier} from `key tier` / `key:tier` lines; errors name the line, never the key."""
    keys: dict[bytes, str] = {}
    for number, raw in enumerate(re.split(r"[\n,]", text), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, tier = _split_entry(line)
        if not key or not tier:
            raise ValueError(f"{source}: entry {number}: expected `key tier` or `key:tier`")
        if tier not in tier_names:
            raise ValueError(f"{source}: entry {number}: no tier is named {tier!r} ({tier_names})")
        keys[_digest(key)] = tier
    return keys


class ApiKeyAuthenticator:
    def __init__(
        self,
        config: ApiKeysConfig,
        tiers: list[TierConfig],
        *,
        environ: Mapping[str, str] = os.environ,
        reload_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._tiers = {t.name: t for t in tiers}
        config.check_tiers(list(self._tiers))
        self._config, self._environ, self._clock = config, environ, clock
        self._reload_interval_s = reload_interval_s
        self._file_stamp: tuple | None = None
        self._checked_at = clock()
        self._keys = self._load_all()
        self.open_mode = not self._keys
        default = config.default_tier
        self.open_tier = open_tier() if default is None else self._tiers[default]
        if self.open_mode:
            logger.warning(OPEN_MODE_BANNER.format(tier=self.open_tier.name))

    def authenticate(self, headers: Mapping[str, str], client: str | None = None) -> Principal:
        """The caller's principal from `Authorization: Bearer KEY` or `x-api-key: KEY`.

        Open mode: every caller gets the default tier, keyed by `client` (e.g. its address) for
        rate limits. Otherwise a missing or unknown key raises AuthenticationError (401).
        """
        if self.open_mode:
            return Principal(f"anonymous:{client}" if client else "anonymous", self.open_tier)
        self._maybe_reload()
        key = presented_key(headers)
        if key is None:
            raise AuthenticationError("missing API key: send `Authorization: Bearer <key>`")
        digest = _digest(key)
        tier = None
        for known, known_tier in self._keys.items():  # no early exit: every request does the same work
            if hmac.compare_digest(known, digest):
                tier = known_tier
        if tier is None:
            raise AuthenticationError("invalid API key")
        return Principal(f"key-{digest.hex()[:12]}", self._tiers[tier])

    def tier_of(self, key_id: str) -> TierConfig | None:
        """The tier of the key `authenticate` names `key_id`; None when no key has it now (it was
        taken out of the config or its Secret: what a key started, such as a batch, stops)."""
        if self.open_mode:
            return self.open_tier if key_id.startswith("anonymous") else None
        self._maybe_reload()
        for digest, tier in self._keys.items():
            if f"key-{digest.hex()[:12]}" == key_id:
                return self._tiers[tier]
        return None

    def _load_all(self) -> dict[bytes, str]:
        names = list(self._tiers)
        keys = {_config_digest(k.get_secret_value()): tier for k, tier in self._config.keys.items()}
        if self._config.env:
            if self._config.env not in self._environ:
                raise ValueError(f"api_keys.env: environment variable {self._config.env} is not set")
            from_env = parse_key_lines(
                self._environ[self._config.env], f"api_keys.env ({self._config.env})", names
            )
            if not from_env:
                raise ValueError(f"api_keys.env: environment variable {self._config.env} holds no keys")
            keys |= from_env
        if self._config.file:
            keys |= self._read_file()
        return keys

    def _read_file(self) -> dict[bytes, str]:
        path = Path(self._config.file)
        try:
            stat = path.stat()
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"api_keys.file: cannot read {path}: {e.strerror}") from None
        keys = parse_key_lines(text, f"api_keys.file ({path})", list(self._tiers))
        if not keys:
            raise ValueError(f"api_keys.file: {path} holds no keys")
        self._file_stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        return keys

    def _maybe_reload(self) -> None:
        """Pick up a rotated Secret: Kubernetes swaps the mounted file in place."""
        if not self._config.file or self._clock() - self._checked_at < self._reload_interval_s:
            return
        self._checked_at = self._clock()
        try:
            stat = Path(self._config.file).stat()
            if (stat.st_ino, stat.st_mtime_ns, stat.st_size) != self._file_stamp:
                self._keys = self._load_all()
                logger.info("api keys reloaded from %s (%d keys)", self._config.file, len(self._keys))
        except (OSError, ValueError) as e:
            logger.warning("api keys not reloaded, keeping the previous ones: %s", e)


def presented_key(headers: Mapping[str, str]) -> str | None:
    lower = {k.lower(): v for k, v in headers.items()}
    auth = lower.get("authorization", "").strip()
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return lower.get("x-api-key", "").strip() or None


def _split_entry(line: str) -> tuple[str, str]:
    parts = line.rsplit(None, 1) if any(c.isspace() for c in line) else line.rsplit(":", 1)
    return (parts[0].strip(), parts[1].strip()) if len(parts) == 2 else ("", "")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _config_digest(key: str) -> bytes:
    """A key the config names, written as itself or as its `sha256:` digest (a presented key is
    always hashed: sending a digest is not sending the key)."""
    return bytes.fromhex(key_digest(key).removeprefix("sha256:"))
