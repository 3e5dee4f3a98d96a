"""Verification of draft tokens against the target model's logits at all k + 1 positions.

Greedy requests accept drafts while each equals the target's argmax, then take the target's token
at the first mismatch (or after the last draft): exactly the tokens greedy decoding would produce.

Random requests use standard speculative sampling (Leviathan et al., Chen et al.): draft d at
position i, drawn from the draft distribution q, is accepted with probability min(1, p(d) / q(d))
where p is the target's filtered distribution (temperature, top-k/p, min-p, as `Sampler` computes
it); on rejection a token is drawn from the residual (p - q)+ normalised and verification stops;
if every draft is accepted, a bonus token is drawn from p at the last position. Each emitted token
then follows p exactly. The ngram proposer is a deterministic q (one-hot at d): accept with
probability p(d), and the residual is p with d removed.

`min_tokens` masks verification too: position i would be output token number n + i (n: the
request's output tokens so far), so its row gets the same stop/EOS mask the plain sampler applies at
that count. A draft that is EOS too early is then never accepted (p(EOS) = 0, not the argmax), and
speculation stays exactly equivalent to decoding one token at a time.
"""

import torch

from raylane.engine.request import Request
from raylane.engine.sampler import _draw, _filter, mask_min_tokens, min_tokens_blocked


class RejectionSampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator  # the engine's, for requests without a seed

    def __call__(
        self,
        logits: torch.Tensor,
        draft_token_ids: list[int],
        draft_probs: torch.Tensor | None,
        request: Request,
    ) -> list[int]:
        """logits [k + 1, vocab] of the request's last verified token and its k drafts; draft_probs
        [k, vocab] the draft distribution each draft was drawn from (None: one-hot, e.g. ngram).
        Returns the accepted drafts followed by one token from the target (1 to k + 1 tokens)."""
        params = request.sampling_params
        if draft_probs is not None:  # a draft on rank 0's GPU, a tensor-parallel target's logits on the host
            draft_probs = draft_probs.to(logits.device)
        if min_tokens_blocked(request):
            logits = logits.clone()  # a view of the step's logits: leave those as the model made them
            for i in range(logits.shape[0]):
                mask_min_tokens(logits, request, i, request.num_output_tokens + i)
        if params.greedy:
            return self._greedy(logits, draft_token_ids)
        generator = request.generator or self.generator
        out: list[int] = []
        for i, draft in enumerate(draft_token_ids):
            p = _filter(logits[i], params)
            q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
            if float(torch.rand((), generator=generator)) * q_draft < float(p[draft]):
                out.append(draft)
                continue
            if draft_probs is None:
                residual = p.clone()
                residual[draft] = 0.0
            else:
                residual = (p - draft_probs[i]).clamp(min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q: rejection has probability 0 but rounding can hit it
                residual = p
            out.append(_draw(residual, generator))
            return out
        out.append(_draw(_filter(logits[len(draft_token_ids)], params), generator))
        return out

    @staticmethod
    def _greedy(logits: torch.Tensor, draft_token_ids: list[int]) -> list[int]:
        target = logits.argmax(dim=-1).tolist()
        for i, draft in enumerate(draft_token_ids):
            if draft != target[i]:
                return target[: i + 1]
        return target
