"""API keys -> tiers: right key, wrong key, keys from env and from a mounted Secret file, open mode."""

import logging

import pytest

from raylane.config import ApiKeysConfig, default_tiers
from raylane.router.errors import AuthenticationError
from raylane.router.tiers import ApiKeyAuthenticator


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def authenticator(config: ApiKeysConfig, **kwargs) -> ApiKeyAuthenticator:
    return ApiKeyAuthenticator(config, default_tiers(), **kwargs)


def test_right_key_gets_its_tier_and_wrong_key_is_rejected():
    auth = authenticator(ApiKeysConfig(keys={"sk-premium": "premium", "sk-free": "free"}))
    assert auth.authenticate(bearer("sk-premium")).tier.name == "premium"
    assert auth.authenticate({"x-api-key": "sk-free"}).tier.name == "free"
    for headers in (bearer("sk-premiun"), bearer("sk-premium "[:-2]), {}, {"Authorization": "Basic abc"}):
        with pytest.raises(AuthenticationError) as excinfo:
            auth.authenticate(headers)
        assert excinfo.value.status == 401


def test_keys_are_compared_in_constant_time(monkeypatch):
    import raylane.router.tiers as tiers

    calls = []
    real = tiers.hmac.compare_digest
    monkeypatch.setattr(tiers.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    auth = authenticator(ApiKeysConfig(keys={"k1": "premium", "k2": "standard", "k3": "free"}))
    assert auth.authenticate(bearer("k1")).tier.name == "premium"
    assert len(calls) == 3  # every known key is compared, even after the match


def test_client_cannot_raise_its_own_tier():
    auth = authenticator(ApiKeysConfig(keys={"sk-free": "free"}))
    headers = {**bearer("sk-free"), "x-raylane-tier": "premium", "x-raylane-priority": "0"}
    assert auth.authenticate(headers).tier.name == "free"


def test_keys_from_env_and_from_a_secret_file(tmp_path):
    secret = tmp_path / "api-keys"
    secret.write_text("# mounted from the raylane-api-keys Secret\nsk-file-a premium\nsk-file-b:free\n\n")
    environ = {"RAYLANE_API_KEYS": "sk-env:standard"}
    auth = authenticator(ApiKeysConfig(env="RAYLANE_API_KEYS", file=str(secret)), environ=environ)
    assert not auth.open_mode
    assert auth.authenticate(bearer("sk-env")).tier.name == "standard"
    assert auth.authenticate(bearer("sk-file-a")).tier.name == "premium"
    assert auth.authenticate(bearer("sk-file-b")).tier.name == "free"


def test_rotated_secret_file_is_picked_up(tmp_path):
    secret = tmp_path / "api-keys"
    secret.write_text("sk-old premium\n")
    now = [0.0]
    auth = authenticator(ApiKeysConfig(file=str(secret)), clock=lambda: now[0], reload_interval_s=5)
    assert auth.authenticate(bearer("sk-old")).tier.name == "premium"
    secret.write_text("sk-new premium\n")
    now[0] = 6.0
    assert auth.authenticate(bearer("sk-new")).tier.name == "premium"
    with pytest.raises(AuthenticationError):
        auth.authenticate(bearer("sk-old"))


def test_misconfigured_key_sources_fail_at_start_naming_the_field_not_the_key(tmp_path):
    with pytest.raises(ValueError, match="api_keys.env"):
        authenticator(ApiKeysConfig(env="RAYLANE_API_KEYS"), environ={})
    with pytest.raises(ValueError, match="api_keys.file"):
        authenticator(ApiKeysConfig(file=str(tmp_path / "missing")))
    bad = tmp_path / "bad"
    bad.write_text("sk-secret-value gold\n")
    with pytest.raises(ValueError, match="api_keys.file") as excinfo:
        authenticator(ApiKeysConfig(file=str(bad)))
    assert "sk-secret-value" not in str(excinfo.value)


def test_open_mode_serves_everyone_at_the_default_tier_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="raylane.router.tiers"):
        auth = authenticator(ApiKeysConfig(default_tier="free"))
    assert auth.open_mode
    assert "OPEN DEVELOPMENT MODE" in caplog.text
    assert auth.authenticate({}).tier.name == "free"
    assert auth.authenticate(bearer("anything"), client="10.0.0.7").key_id == "anonymous:10.0.0.7"


def test_open_mode_without_a_default_tier_never_rate_limits_the_local_user():
    """A benchmark or eval tool against a local server (guidellm sent 10,023 requests that met 429s
    at the `standard` tier's 120/min): open mode's own tier has no limits unless one is named."""
    from raylane.router.errors import RateLimitError
    from raylane.router.rate_limit import RateLimiter

    limiter = RateLimiter(clock=lambda: 0.0)  # no time passes: nothing refills
    open_tier = authenticator(ApiKeysConfig()).authenticate({}, client="127.0.0.1").tier
    assert open_tier.name == "open" and open_tier.max_queue_wait_s >= 600
    for _ in range(1000):
        limiter.check("anonymous:127.0.0.1", open_tier, tokens=10_000).settle(10_000)
    standard = authenticator(ApiKeysConfig(default_tier="standard")).authenticate({}).tier
    with pytest.raises(RateLimitError):
        for _ in range(standard.requests_per_minute + 1):
            limiter.check("anonymous", standard)


def test_keys_never_reach_the_log(caplog, tmp_path):
    secret = tmp_path / "api-keys"
    secret.write_text("sk-secret-1 premium\n")
    with caplog.at_level(logging.DEBUG):
        auth = authenticator(ApiKeysConfig(keys={"sk-secret-2": "free"}, file=str(secret)))
        principal = auth.authenticate(bearer("sk-secret-1"))
        with pytest.raises(AuthenticationError) as excinfo:
            auth.authenticate(bearer("sk-secret-3"))
    assert "sk-secret" not in caplog.text + principal.key_id + str(excinfo.value)


def test_a_key_taken_out_of_its_secret_has_no_tier_any_more(tmp_path):
    """What a key started without a request of its own (a batch's lines) asks by the key's id
    whether the key still exists: once the Secret drops it, it does not."""
    secret = tmp_path / "keys"
    secret.write_text("sk-a standard\nsk-b free\n")
    clock = [0.0]
    auth = authenticator(ApiKeysConfig(file=str(secret)), clock=lambda: clock[0], reload_interval_s=1)
    key_a = auth.authenticate(bearer("sk-a")).key_id
    assert auth.tier_of(key_a).name == "standard" and auth.tier_of("key-000000000000") is None
    secret.write_text("sk-b free\n")
    clock[0] = 5.0
    assert auth.tier_of(key_a) is None
    assert authenticator(ApiKeysConfig()).tier_of(key_a) is None  # open mode: no key is known
