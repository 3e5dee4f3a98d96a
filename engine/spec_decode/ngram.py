"""Prompt lookup (n-gram) proposer: no extra model.

The last n tokens of a request's context (prompt + output) are looked up in the context itself,
from n = prompt_lookup_max down to prompt_lookup_min; the tokens that followed the most recent
earlier occurrence are the drafts. Outputs that copy their prompt (code edits, quoting, extraction)
get long accepted runs; others get few drafts, since nothing is proposed without a match. As a
draft distribution it is deterministic (one-hot), which is how `RejectionSampler` treats it.
"""

from array import array

from raylane.engine.request import Request
from raylane.engine.spec_decode.proposer import Proposer, can_speculate, max_drafts


def ngram_lookup(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    if k <= 0:
        return []
    # bytes.rfind is a C substring search; a hit not aligned to a 4-byte token is skipped.
    data = array("i", tokens).tobytes()
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix, end = data[-4 * n :], len(data) - 4  # the match must end before the last token
        pos = data.rfind(suffix, 0, end)
        while pos > 0 and pos % 4:
            pos = data.rfind(suffix, 0, pos + 4 * n - 1)
        if pos >= 0:
            start = pos // 4 + n
            return tokens[start : start + k]
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k, self.n_max, self.n_min = num_speculative_tokens, prompt_lookup_max, prompt_lookup_min

    def propose(self, requests: list[Request]) -> None:
        for request in requests:
            request.spec_draft_probs = None
            if not can_speculate(request):
                request.spec_token_ids = []
                continue
            k = max_drafts(request, self.k)
            request.spec_token_ids = ngram_lookup(request.all_token_ids, self.n_max, self.n_min, k)
