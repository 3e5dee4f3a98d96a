"""Serving metrics: per-request records in, one summary per sweep point out. Pure functions, no I/O.

Definitions (vLLM's `benchmark_serving`, so numbers compare with published ones):
- TTFT: request sent -> first chunk carrying generated text.
- E2E: request sent -> end of the stream.
- TPOT: (E2E - TTFT) / (output_tokens - 1): the mean time per token after the first. Undefined for
  outputs of one token (nothing after the first), so those requests are left out of TPOT's statistics.
- ITL: the gaps between consecutive content chunks after the first. A chunk may carry more than one
  token, so ITL is per chunk while TPOT is per token; all gaps of all requests are pooled.
- Throughput: successful requests (or their output tokens) / the point's wall time.
- Goodput: successful requests meeting every SLO given / wall time. A request whose TPOT is undefined
  meets the TPOT SLO (it has no per-token time to miss); an error never counts.
"""

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Times in seconds; `start` is relative to the sweep point's start."""

    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    # True when the counts came from the server's `usage` chunk; otherwise output_tokens counts chunks.
    usage_reported: bool = False
    # None on success; the HTTP status ("429", "500") or a kind ("connection", "timeout", "stream_error").
    error_code: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"tpot": self.tpot}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RequestRecord":
        return cls(**{k: v for k, v in data.items() if k != "tpot"})


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in milliseconds; None = no objective on that latency."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        return all(
            limit is None or value is None or value * 1000.0 <= limit
            for value, limit in (
                (record.ttft, self.ttft_ms),
                (record.tpot, self.tpot_ms),
                (record.e2e, self.e2e_ms),
            )
        )

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def parse_slo(text: str | None) -> Slo:
    """`ttft=500,tpot=50,e2e=4000` (milliseconds) -> Slo."""
    if not text:
        return Slo()
    limits: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--slo: expected ttft=MS,tpot=MS,e2e=MS, got {part!r}")
        limits[f"{name}_ms"] = float(value)
    return Slo(**limits)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_stats_ms(values_s: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99 in milliseconds (NaN when there are no values)."""
    ms = [v * 1000.0 for v in values_s]
    stats = {"mean": sum(ms) / len(ms) if ms else math.nan}
    stats.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return stats


def latency_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Each latency's values (seconds) over the successful requests where it is defined."""
    ok = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
    }


def errors_by_status(records: list[RequestRecord]) -> dict[str, int]:
    counts = Counter(r.error_code for r in records if not r.ok)
    return dict(sorted(counts.items()))


def summarize(records: list[RequestRecord], wall_s: float, slo: Slo | None = None) -> dict[str, Any]:
    """One sweep point's summary: counts, throughput, latency statistics (ms) and goodput."""
    slo = slo or Slo()
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: math.nan)
    good = sum(1 for r in ok if slo.met_by(r)) if slo else None
    values = latency_values(records)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_status": errors_by_status(records),
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
        **{name: latency_stats_ms(values[name]) for name in LATENCIES},
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms} if slo else None,
        "good_requests": good,
        "goodput": per_s(good) if good is not None else None,
    }
