"""Turns one step's logits into tokens, each row with its own request's settings.

Rows are handled in batches where settings allow (greedy rows with one argmax, unseeded
random rows with one draw) and one by one only where a request owns a seeded generator,
so a request's output depends on its seed alone, not on what it was batched with.

Everything runs on the logits' device: on a GPU the logits never come to the host; the sampled ids
do, in one copy at the end of the step (with the logprobs a request asked for). Generators stay on
the CPU (a seed means the same numbers on every device): their noise goes to the device, a copy
that does not wait for the GPU.

`min_tokens`, as in vLLM: until a request has `min_tokens` output tokens, its stop token ids and
(unless `ignore_eos`) every EOS id of the model are masked to -inf, so they cannot be sampled at all
(greedy picks the best other token, as Hugging Face's `min_new_tokens` does). Reported logprobs stay
those of the raw model distribution, before this mask, penalties and filters (vLLM's default).
"""

from dataclasses import dataclass

import torch

from raylane.engine.request import Request
from raylane.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: (sampled token's logprob, [(token id, logprob)] top-k) or None when not asked for.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """OpenAI's presence/frequency penalties over generated tokens; HF's repetition penalty
    over prompt and generated tokens. In place, only on rows that ask for them."""
    for row, request in enumerate(requests):
        params = request.sampling_params
        if not params.needs_penalties:
            continue
        vocab, device = logits.shape[1], logits.device
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=device)
            seen = seen.clamp(max=vocab - 1)
            scores = logits[row, seen]
            logits[row, seen] = torch.where(
                scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty
            )
        if params.presence_penalty or params.frequency_penalty:
            # Ids past the logits (tokens a tokenizer added) land in one spare bucket, then dropped.
            output = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
            counts = torch.zeros(vocab + 1, dtype=logits.dtype, device=device)
            ones = torch.ones_like(output, dtype=logits.dtype)
            counts = counts.scatter_add_(0, output.clamp(max=vocab), ones)[:vocab]
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def min_tokens_blocked(request: Request, num_output_tokens: int | None = None) -> list[int]:
    """Token ids the request may not sample while it has `num_output_tokens` output tokens (default:
    its current count): its stop token ids and EOS ids until `min_tokens` are out, else none."""
    params = request.sampling_params
    count = request.num_output_tokens if num_output_tokens is None else num_output_tokens
    if count >= params.min_tokens:
        return []
    blocked = set(params.stop_token_ids)
    if not params.ignore_eos:
        blocked |= request.eos_token_ids
    return sorted(blocked)


def mask_min_tokens(logits: torch.Tensor, request: Request, row: int, num_output_tokens: int) -> None:
    """In place: -inf on the ids `min_tokens_blocked` names, on one row of logits. A row that the mask
    would leave with no finite logit (a grammar that allows only EOS) is left as it is: the grammar wins."""
    vocab = logits.shape[-1]
    blocked = [t for t in min_tokens_blocked(request, num_output_tokens) if t < vocab]
    if not blocked:
        return
    ids = torch.tensor(blocked, dtype=torch.long, device=logits.device)
    saved = logits[row, ids].clone()
    logits[row, ids] = float("-inf")
    # Put them back where nothing finite is left, without reading the answer back to the host.
    logits[row, ids] = torch.where(torch.isfinite(logits[row]).any(), logits[row, ids], saved)


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, on one row; returns probabilities."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(_draw_on_device(probs, generator))


def _draw_on_device(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The sampled id as a 0-d tensor on `probs`' device. Exponential race (Gumbel-max in disguise):
    argmax(p / E) with E ~ Exp(1) samples from p."""
    if generator is not None and generator.device != probs.device:
        noise = torch.empty(probs.shape).exponential_(generator=generator).to(probs.device, non_blocking=True)
    else:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()


def _logprobs(logits: torch.Tensor, token_ids: list[int], requests: list[Request]) -> list:
    wanted = [r.sampling_params.logprobs for r in requests]
    if all(k is None for k in wanted):
        return [None] * len(requests)
    logprobs = torch.log_softmax(logits, dim=-1)
    top = max(k or 0 for k in wanted)
    top_vals, top_ids = logprobs.topk(top, dim=-1) if top else (None, None)
    out = []
    for row, k in enumerate(wanted):
        if k is None:
            out.append(None)
            continue
        pairs = list(zip(top_ids[row, :k].tolist(), top_vals[row, :k].tolist(), strict=True)) if k else []
        out.append((float(logprobs[row, token_ids[row]]), pairs))
    return out


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator  # the engine's, for requests without a seed

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [len(requests), vocab] float32 raw model logits (grammar masks already applied)."""
        raw = logits
        blocked = [row for row, r in enumerate(requests) if min_tokens_blocked(r)]
        if blocked or any(r.sampling_params.needs_penalties for r in requests):
            logits = logits.clone()
            apply_penalties(logits, requests)
        for row in blocked:
            mask_min_tokens(logits, requests[row], row, requests[row].num_output_tokens)
        tokens = logits.argmax(dim=-1)
        for row, request in enumerate(requests):
            params = request.sampling_params
            if not params.greedy:
                probs = _filter(logits[row], params)
                tokens[row] = _draw_on_device(probs, request.generator or self.generator)
        token_ids = tokens.tolist()  # the step's one read back from the device
        # Logprobs are of the model's distribution (before min_tokens, penalties and filters), as vLLM
        # reports by default (its "raw_logprobs" mode).
        return SamplerOutput(token_ids, _logprobs(raw, token_ids, requests))
