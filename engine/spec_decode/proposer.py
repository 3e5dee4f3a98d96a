"""What every proposer shares: which requests may speculate, and how many tokens at most."""

from abc import ABC, abstractmethod

from raylane.engine.request import Request, RequestStatus


def can_speculate(request: Request) -> bool:
    """A running request with one token left to compute (decoding) and no per-token state that
    drafts would have to advance (grammar, penalties, logprobs): see the package docstring."""
    params = request.sampling_params
    return (
        request.status == RequestStatus.RUNNING
        and request.num_tokens - request.num_computed_tokens == 1
        and request.grammar is None
        and not params.needs_penalties
        and params.logprobs is None
    )


def max_drafts(request: Request, k: int) -> int:
    """Drafts worth proposing: at most k, none past max_tokens or the context (every accepted draft
    plus the target's own token must still fit)."""
    room = request.max_total_tokens - request.num_tokens
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - request.num_output_tokens - 1)
    return max(0, min(k, room))


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[Request]) -> None:
        """Set `spec_token_ids` (and `spec_draft_probs`) of every request; [] where it may not speculate."""

    def free(self, request: Request) -> None:  # noqa: B027 (optional hook: most proposers hold nothing)
        """The request finished: release whatever the proposer holds for it."""
