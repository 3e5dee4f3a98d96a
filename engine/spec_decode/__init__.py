"""Speculative decoding: a proposer drafts tokens for running requests before each step, the target
model verifies all of them in one forward pass, and `RejectionSampler` keeps the longest prefix the
target agrees with plus one token of its own.

Before `Scheduler.schedule`, the proposer sets `request.spec_token_ids` (and, for a draft model, the
draft distribution `request.spec_draft_probs`) on every running request; the scheduler budgets
1 + k tokens for a decoding request with k drafts and may trim them; the runner returns logits for
all k + 1 positions; rejected drafts' KV is rolled back by setting `num_computed_tokens` to the
verified length, so their slots are overwritten later (prefix-cache hashes only ever cover
`all_token_ids`, which holds verified tokens only).

Requests skip speculation (no drafts, a plain decode step) when they are grammar-constrained or ask
for penalties or logprobs: each of those would need the per-position state (grammar matcher, token
counts, logprob entries) advanced across draft positions, and the plain path is always correct.
"""

from raylane.engine.spec_decode.metrics import SpecDecodeStats
from raylane.engine.spec_decode.proposer import Proposer, can_speculate, max_drafts
from raylane.engine.spec_decode.rejection_sampler import RejectionSampler

__all__ = ["Proposer", "RejectionSampler", "SpecDecodeStats", "can_speculate", "make_proposer", "max_drafts"]


def make_proposer(config, target_blocks, vocab_size: int, draft_device=None) -> Proposer | None:
    """The proposer `config.speculative_config` asks for, or None when speculation is off.
    `target_blocks`: the target's `BlockManager`, whose block count and size a draft model copies;
    `draft_device`: where the draft model runs (None: where the config's device resolves here)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        from raylane.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
    from raylane.engine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(
        config, target_blocks.num_blocks, target_blocks.block_size, vocab_size, device=draft_device
    )
