"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token after the first,
its logprob given the tokens before it, its rank and the top-k.

They are what lm-eval's loglikelihood tasks read through `/v1/completions` (`echo` with `logprobs`).
Position i's logits are the distribution of token i + 1, so a request that asks for them needs the
logits of every prompt position, not only of its last. Whatever chunks its prompt is split into
(chunked prefill), the rows of the positions a step forwards join that step's `sample_indices`: the
executor returns them beside the sampling rows, the same way from one rank or from a worker group,
and through every forward path (eager, CUDA graphs, compiled decode: they all gather the rows of
`sample_indices`). The log-softmax is taken per step, in float32, on at most `ROWS_PER_PASS` rows at
a time, so however long the prompt, no more than one step's chunk of logits
(`max_num_batched_tokens` rows) exists at once.

A position served from the prefix cache is never forwarded: such a request takes no cache hits until
its prompt's logits are read (`Request.needs_prompt_logprobs`, as vLLM), though it fills the cache for
others. A request preempted before then recomputes from its first token and reads only the positions
it had not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raylane.engine.request import Request

if TYPE_CHECKING:  # the serving process imports this module (through the output processor), not the model's
    import torch

    from raylane.engine.model_runner import ModelInput

# Rows whose log-softmax is taken at once: bounds the float32 temporaries to this many rows x vocab.
ROWS_PER_PASS = 512

# Per prompt position read: (the next prompt token's logprob, its rank, [(token id, logprob)] top-k).
PositionLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass(slots=True)
class PromptLogprobRows:
    """One request's rows among a step's logits: from `first_row`, one per prompt position of
    `positions` (each row the distribution of the token after its position)."""

    request: Request
    first_row: int
    positions: range

    def read(self, logits: torch.Tensor) -> list[PositionLogprobs]:
        """The positions' logprobs from the step's logits; the request then needs the next ones."""
        rows = logits[self.first_row : self.first_row + len(self.positions)]
        prompt = self.request.prompt_token_ids
        targets = prompt[self.positions.start + 1 : self.positions.stop + 1]
        read = position_logprobs(rows, targets, self.request.sampling_params.prompt_logprobs or 0)
        self.request.prompt_logprobs_position = self.positions.stop
        return read


def add_prompt_rows(
    batch: ModelInput, request: Request, first_token_row: int, start: int, end: int
) -> PromptLogprobRows | None:
    """Ask for the logits rows of the request's prompt positions among this step's [start, end) that
    it still needs (its tokens begin at `first_token_row` of the batch); None when it needs none."""
    if not request.needs_prompt_logprobs:
        return None
    positions = range(max(start, request.prompt_logprobs_position), min(end, request.num_prompt_tokens - 1))
    if not positions:
        return None
    rows = PromptLogprobRows(request, len(batch.sample_indices), positions)
    batch.sample_indices.extend(first_token_row + p - start for p in positions)
    return rows


def position_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[PositionLogprobs]:
    """Row i of `logits` (raw model logits) scored at `token_ids[i]`: its logprob (log-softmax in
    float32), its rank (the tokens at least as likely, itself included, as vLLM counts) and the row's
    top-k. A few small copies to the host per pass of ROWS_PER_PASS rows."""
    import torch  # here: the output processor imports this module where no model runs (a simulated engine)

    k = min(k, logits.shape[-1])
    read: list[PositionLogprobs] = []
    for begin in range(0, len(token_ids), ROWS_PER_PASS):
        logprobs = torch.log_softmax(logits[begin : begin + ROWS_PER_PASS].float(), dim=-1)
        targets = torch.tensor(token_ids[begin : begin + ROWS_PER_PASS], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs >= chosen).sum(dim=-1)
        top_values, top_ids = logprobs.topk(k, dim=-1)
        on_host = (chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist())
        for logprob, rank, ids, values in zip(*on_host, strict=True):
            read.append((logprob, rank, list(zip(ids, values, strict=True))))
    return read
