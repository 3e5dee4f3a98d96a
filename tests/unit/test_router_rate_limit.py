"""Requests/min and tokens/min per key: over the limit -> 429 with a Retry-After that works."""

import pytest

from raylane.config import TierConfig
from raylane.router.errors import RateLimitError
from raylane.router.rate_limit import RateLimiter


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_limit_gives_retry_after():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    tier = TierConfig(name="free", priority=2, requests_per_minute=6)
    for _ in range(6):
        limiter.check("key-a", tier)
    with pytest.raises(RateLimitError) as excinfo:
        limiter.check("key-a", tier)
    error = excinfo.value
    assert error.status == 429 and error.retry_after == pytest.approx(10.0)  # one request per 10 s
    assert error.headers() == {"retry-after": "10", "retry-after-ms": "10000"}  # exact: one key's budget
    assert error.to_openai()["error"]["code"] == "rate_limit_exceeded"
    limiter.check("key-b", tier)  # another key has its own allowance
    clock.now += 10.0
    limiter.check("key-a", tier)  # came back when told to


def test_tokens_per_minute_counts_prompt_and_generated_tokens():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    tier = TierConfig(name="standard", priority=1, tokens_per_minute=600)
    limiter.check("k", tier, tokens=300).settle(550)  # estimated 300, used 550: 250 more charged
    with pytest.raises(RateLimitError) as excinfo:
        limiter.check("k", tier, tokens=100)  # 50 left
    assert excinfo.value.retry_after == pytest.approx(5.0)  # 50 missing at 10 tokens/s
    clock.now += 5.0
    limiter.check("k", tier, tokens=100)


def test_tokens_are_charged_up_front_and_settled_with_the_real_usage():
    """max_tokens x n is charged before the request runs: while two requests that may each generate
    250 tokens are in flight, a third is turned away though nothing has been generated yet. When they
    end having used 50 each, the rest comes back at once."""
    clock = FakeClock()
    limiter = RateLimiter(clock)
    tier = TierConfig(name="standard", priority=1, tokens_per_minute=600)
    charges = []
    for _ in range(2):
        charge = limiter.check("k", tier, tokens=25)  # the prompt's estimate from the body's bytes
        limiter.charge_more(charge, "k", tier, 250)  # max_tokens 125 x n 2
        charges.append(charge)
    charge = limiter.check("k", tier, tokens=25)
    with pytest.raises(RateLimitError) as excinfo:
        limiter.charge_more(charge, "k", tier, 250)  # 25 left of 600
    assert excinfo.value.retry_after == pytest.approx(22.5)  # 225 missing at 10 tokens/s
    charge.settle(0)  # turned away: its prompt estimate comes back
    for charge in charges:
        charge.settle(50)
        charge.settle(10_000)  # only the first settlement counts
    third = limiter.check("k", tier, tokens=25)
    limiter.charge_more(third, "k", tier, 250)  # 600 - 100 used: room again, at the same clock time
    third.settle(0)
    assert limiter.check("k", tier, tokens=500).tokens == 500


def test_a_client_error_keeps_its_prompts_charge_and_a_429_or_5xx_gives_all_back():
    """A prompt too long for every pool (a 400 after the pools tokenized it) costs its key the prompt
    it sent, so sending it again and again runs into the key's tokens/min instead of costing the pools
    a tokenization each time for free; what it might have generated comes back. A request turned
    away (429) or failed by the server (5xx) costs nothing."""
    clock = FakeClock()
    limiter = RateLimiter(clock)
    tier = TierConfig(name="standard", priority=1, tokens_per_minute=600)
    for _ in range(3):
        charge = limiter.check("k", tier, tokens=150)  # the body's bytes / 4
        limiter.charge_more(charge, "k", tier, 50)  # max_tokens
        charge.settle_error(400)  # 150 kept, 50 back
    with pytest.raises(RateLimitError):
        limiter.check("k", tier, tokens=200)
    for status in (429, 500, 503):
        clock.now += 60.0
        charge = limiter.check("k", tier, tokens=600)
        charge.settle_error(status)
        limiter.check("k", tier, tokens=600).settle(0)  # all of it came back


def test_a_key_over_its_limits_is_turned_away_before_its_body_counts():
    """`precheck` (before the gateway reads a body) refuses a key with no request left or with its
    tokens in debt, and takes nothing from a key that has room."""
    clock = FakeClock()
    limiter = RateLimiter(clock)
    tier = TierConfig(name="t", priority=1, requests_per_minute=2, tokens_per_minute=600)
    for _ in range(2):
        limiter.precheck("k", tier)
        limiter.check("k", tier, tokens=10)
    with pytest.raises(RateLimitError) as excinfo:
        limiter.precheck("k", tier)
    assert excinfo.value.retry_after == pytest.approx(30.0)
    clock.now += 30.0
    limiter.check("j", tier, tokens=10).settle(900)  # key j's tokens in debt: 310 over
    with pytest.raises(RateLimitError):
        limiter.precheck("j", tier)
    limiter.precheck("k", tier)
    limiter.check("k", tier, tokens=10)  # the precheck took nothing


def test_rejected_request_takes_nothing_and_huge_prompt_is_not_locked_out_forever():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    tier = TierConfig(name="t", priority=1, requests_per_minute=2, tokens_per_minute=60)
    limiter.check("k", tier, tokens=60)
    with pytest.raises(RateLimitError):
        limiter.check("k", tier, tokens=10)
    clock.now += 60.0
    limiter.check("k", tier, tokens=10_000)  # capped at one minute's allowance, once full
    limiter.check("k", tier, tokens=0)  # the earlier rejection did not use up the second request


def test_unlimited_tier_and_bounded_memory():
    limiter = RateLimiter(FakeClock(), max_principals=10)
    tier = TierConfig(name="premium", priority=0)
    for i in range(1000):
        limiter.check(f"anonymous:10.0.{i // 256}.{i % 256}", tier, tokens=10**6)
    assert len(limiter._buckets) == 10


def test_a_keys_batch_lines_have_a_token_budget_apart_from_its_requests():
    """Batch lines run as the `batch` tier with their key's tier's `batch_tokens_per_minute`: the
    budget binds them, and spending it leaves the key's interactive tokens/min untouched."""
    from raylane.config.batch import BatchConfig, batch_tier

    standard = TierConfig(name="standard", priority=1, tokens_per_minute=1000, batch_tokens_per_minute=300)
    lines = batch_tier([standard], BatchConfig(), standard)
    limiter = RateLimiter(clock=lambda: 0.0)
    limiter.check("key-a", lines, 200)
    with pytest.raises(RateLimitError):
        limiter.check("key-a", lines, 200)
    limiter.check("key-a", standard, 900)  # its own requests' budget is whole
    unlimited = batch_tier(
        [standard], BatchConfig(), standard.model_copy(update={"batch_tokens_per_minute": None})
    )
    limiter.check("key-a", unlimited, 10_000)  # the key's tier changed: its batch bucket follows
