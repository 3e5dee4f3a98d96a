"""A request as the scheduler sees it: tokens, progress, and its KV blocks."""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raylane.engine.lora import LoRARequest
from raylane.engine.request_trace import RequestTrace
from raylane.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Resumption:
    """Output a user request already produced on another replica (one that died mid-request), per
    sample of its `n`: the continuation prefills the prompt plus these tokens and goes on from there.
    They count as output (max_tokens, min_tokens, penalties, the grammar's state) and their text as
    already shown. A sample with a finish reason had ended: it is not run again."""

    token_ids: tuple[tuple[int, ...], ...]
    finish_reasons: tuple[str | None, ...] = ()

    def finish_reason(self, index: int) -> str | None:
        return self.finish_reasons[index] if index < len(self.finish_reasons) else None


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))

    @classmethod
    def finished_with(cls, reason: str) -> "RequestStatus":
        return {"stop": cls.FINISHED_STOPPED, "length": cls.FINISHED_LENGTH}.get(reason, cls.FINISHED_ABORTED)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower is served first, as in vLLM
    # Whose request it is (the gateway's key id; "" for none): within a priority, the scheduler
    # serves first the tenant that has the fewest requests running.
    tenant: str = ""
    cache_salt: str = ""  # prefix-cache scope: blocks are shared only among requests of one salt
    lora: LoRARequest | None = None  # the adapter it runs with (engine/lora.py); None: the base model
    arrival_time: float = field(default_factory=time.monotonic)
    max_total_tokens: int = 0  # prompt + output may not exceed this (the model's context)
    eos_token_ids: frozenset[int] = frozenset()
    # The user request this one samples for and its place among that request's `n` samples (vLLM's
    # parent request). Outputs are gathered by these, never by parsing request ids. "": its own parent.
    parent_id: str = ""
    index: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache; -1 until first scheduled
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks so far
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # The seeded request's own generator, made on first use (`generator`): a simulated engine, which
    # samples nothing, never imports torch for it.
    own_generator: "torch.Generator | None" = None
    grammar: Any = None  # a structured-output matcher state when the request is constrained
    first_token_time: float | None = None
    # Speculative decoding: this step's unverified draft tokens (never in all_token_ids) and, from a
    # draft model, the distributions they were drawn from ([k, vocab]; None: one-hot/greedy).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None
    # Prompt logprobs (engine/prompt_logprobs.py): the first prompt position whose logits are still to
    # be read (position i's logits give the logprob of prompt token i + 1).
    prompt_logprobs_position: int = 0
    # Its timeline for tracing (engine/request_trace.py); None: not traced, and nothing is recorded.
    trace: RequestTrace | None = None

    def __post_init__(self) -> None:
        self.parent_id = self.parent_id or self.request_id
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def generator(self) -> "torch.Generator | None":
        """The generator of a request with a seed (made from it on first use), else None."""
        if self.own_generator is None and self.sampling_params.seed is not None:
            import torch

            self.own_generator = torch.Generator().manual_seed(self.sampling_params.seed)
        return self.own_generator

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions' logits are still to be read. Only the first sample of a user request
        computes them (its samples share the prompt); until it has, its prompt takes no prefix-cache
        hits, since a cached position is never forwarded."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.index == 0
            and self.prompt_logprobs_position < self.num_prompt_tokens - 1
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop conditions after a token was appended (stop strings are the detokenizer's)."""
        params, last = self.sampling_params, self.all_token_ids[-1]
        # Before min_tokens the sampler masks stop tokens and EOS (engine/sampler.py), so one shows up
        # here only where a grammar allowed nothing else. A grammar that has ended ends the request
        # even then: it allows no further token.
        stop_token = (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids
        if stop_token and self.num_output_tokens >= params.min_tokens:
            self.stop_reason = last if last in params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
