"""Speculative decoding counters, plain ints on the engine (`engine.spec_decode_stats`).

Exported as vLLM's spec-decode metrics with the raylane_ prefix: `raylane_spec_decode_num_drafts`,
`raylane_spec_decode_num_draft_tokens`, `raylane_spec_decode_num_accepted_tokens` (counters) and
their ratio as the acceptance rate.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0  # verification passes of a request with at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at draft position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_metrics(self) -> dict[str, float]:
        return {
            "raylane_spec_decode_num_drafts": self.num_drafts,
            "raylane_spec_decode_num_draft_tokens": self.num_draft_tokens,
            "raylane_spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "raylane_spec_decode_draft_acceptance_rate": self.acceptance_rate,
        }
