"""From sampled tokens to what the user sees: text, stop strings, logprobs, `RequestOutput`s.

vLLM V1's `OutputProcessor`. `LLMEngine` appends each sampled token to its `Request` and checks the
token-level stops (EOS, stop token ids, lengths); this class does the rest: one incremental
detokenizer per sample (text and stop strings), the logprob entries, and the `RequestOutput` of a
user request with its `n` samples, cumulative, as deltas, or only when finished. Unlike vLLM V1 it
runs in the engine core, beside the scheduler: a stop string found while detokenizing ends the
request in the same step, so it is never scheduled again.
"""

import time
from dataclasses import dataclass, field

from raylane.engine.detokenizer import IncrementalDetokenizer
from raylane.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from raylane.engine.prompt_logprobs import PositionLogprobs
from raylane.engine.request import Request, RequestStatus
from raylane.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True, eq=False)
class RequestState:
    """The output side of one sample (one engine `Request`)."""

    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: the model has no tokenizer (token ids only)
    logprobs: SampleLogprobs = field(default_factory=list)
    sent_text: int = 0  # characters and tokens that DELTA outputs already carried
    sent_tokens: int = 0


@dataclass(slots=True, eq=False)
class ParentRequest:
    """A user request: the states of its `n` samples, drawn independently from one prompt."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    samples: list[RequestState]
    finish_time: float | None = None
    # SamplingParams.prompt_logprobs: [None] (the first token has none) and one entry per prompt token
    # read so far; None when not asked for or resumed (its first output went out from another replica).
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # a DELTA output carried them: later ones do not

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None for a checkpoint without one: outputs carry no text
        self.parents: dict[str, ParentRequest] = {}  # user requests not yet finished

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, samples: list[Request]
    ):
        """Start tracking a user request whose `n` samples are `samples` (in index order). A resumed
        sample's output so far is replayed through its detokenizer, so its held-back bytes and stop
        string window are as they were, and its text counts as sent: only new text comes out."""
        states = [self._new_state(r) for r in samples]
        text_prompt = prompt if isinstance(prompt, str) else None
        parent = ParentRequest(request_id, text_prompt, params, states)
        if params.prompt_logprobs is not None and samples[0].prompt_logprobs_position == 0:  # not resumed
            parent.prompt_logprobs = [None]
        self.parents[request_id] = parent

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def samples(self, request_id: str) -> list[Request] | None:
        """The engine requests of a user request, or None when it is not (or no longer) running."""
        parent = self.parents.get(request_id)
        return None if parent is None else [s.request for s in parent.samples]

    def _new_state(self, request: Request) -> RequestState:
        detok = None
        if self.tokenizer is not None:
            detok = new_detokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params)
        state = RequestState(request, detok)
        resumed = request.output_token_ids
        if resumed:
            if detok is not None:
                _replay(detok, request, resumed)
                state.sent_text = len(detok.text)
            state.sent_tokens = len(resumed)
            state.logprobs = [None] * len(resumed)  # reported by the replica that produced them
        return state

    def _state(self, request: Request) -> RequestState:
        return self.parents[request.parent_id].samples[request.index]

    # -- per token -----------------------------------------------------------------------------

    def process_token(
        self, request: Request, token_id: int, logprobs, status: RequestStatus | None
    ) -> RequestStatus | None:
        """A token was just appended to `request`, and its token-level stop check gave `status`.
        Record the token's logprobs (`(sampled, top-k pairs)` or None) and text; returns `status`,
        or FINISHED_STOPPED (with `request.stop_reason` set) when the text now holds a stop string."""
        state = self._state(request)
        if logprobs is not None:
            state.logprobs.append(self._logprob_entry(token_id, logprobs))
        detok = state.detokenizer
        # A token that stopped the request (EOS, a stop token id) is not part of the text, as in vLLM.
        if detok is not None and status != RequestStatus.FINISHED_STOPPED:
            detok.update([token_id])
            if detok.stopped_by is not None:
                request.stop_reason = detok.stopped_by
                return RequestStatus.FINISHED_STOPPED
        return status

    def add_prompt_logprobs(self, request: Request, read: list[PositionLogprobs]) -> None:
        """The logprobs of the next prompt tokens of `request` (its user request's first sample)."""
        entries = self.parents[request.parent_id].prompt_logprobs
        decoded: dict[int, str] = {}  # within one step's chunk the top-k repeat: decode each id once
        for position, (logprob, rank, top) in enumerate(read, start=len(entries)):
            entry = {tid: Logprob(lp, rank=i) for i, (tid, lp) in enumerate(top, start=1)}
            entry[request.prompt_token_ids[position]] = Logprob(logprob, rank=rank)
            if self.tokenizer is not None:
                for tid, lp in entry.items():
                    if tid not in decoded:
                        decoded[tid] = self.tokenizer.decode([tid])
                    lp.decoded_token = decoded[tid]
            entries.append(entry)

    def finish_request(self, request: Request) -> None:
        """`request` ended, whatever the reason: release text held back in case it began a stop string."""
        detok = self._state(request).detokenizer
        if detok is not None and detok.stopped_by is None:
            detok.flush()

    def _logprob_entry(self, token_id: int, logprobs) -> dict[int, Logprob]:
        sampled, top = logprobs
        entry = {tid: Logprob(lp) for tid, lp in top}
        entry[token_id] = Logprob(sampled)
        if self.tokenizer is not None:
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
        return entry

    # -- outputs -------------------------------------------------------------------------------

    def make_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One output per user request that `requests` (this step's samples) belong to, in their order."""
        parent_ids = dict.fromkeys(r.parent_id for r in requests)
        return [out for request_id in parent_ids if (out := self.make_output(request_id)) is not None]

    def make_output(self, request_id: str) -> RequestOutput | None:
        """The user request's output now (None for FINAL_ONLY before it finishes); a finished request
        is forgotten."""
        parent = self.parents[request_id]
        kind = parent.params.output_kind
        finished = parent.finished
        if finished:
            del self.parents[request_id]
            parent.finish_time = time.monotonic()
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if not finished and parent.prompt_logprobs is not None and not _all_read(parent):
            return None  # another sample ran ahead of the first: the first output carries them
        delta = kind == RequestOutputKind.DELTA
        first = parent.samples[0].request
        prompt_logprobs = _prompt_logprobs(parent)
        if delta and prompt_logprobs is not None:
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[_completion(state, delta) for state in parent.samples],
            finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=_metrics(first, parent.finish_time),
            prompt_logprobs=prompt_logprobs,
        )


def new_detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(
        tokenizer,
        prompt_token_ids,
        stop=params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        min_tokens=params.min_tokens,
    )


def resumed_text(tokenizer, prompt_token_ids: list[int], params: SamplingParams, token_ids: list[int]) -> str:
    """The text a sample's unfinished output `token_ids` had shown: what a resumed sample's detokenizer
    counts as sent (the serving layer rebuilds its own state, tool-call parsing, from it)."""
    detok = new_detokenizer(tokenizer, prompt_token_ids, params)
    for token in token_ids:
        detok.update([token])
    return detok.text


def _replay(detok: IncrementalDetokenizer, request: Request, token_ids: list[int]) -> None:
    """Feed a resumed sample's output through its new detokenizer token by token, as `process_token`
    did: the same text, held-back bytes and stop-string window. A token that ended the sample (EOS, a
    stop token id) was never text; an ended sample's held-back text was released."""
    params, status = request.sampling_params, request.status
    for i, token in enumerate(token_ids):
        stop_token = (
            not params.ignore_eos and token in request.eos_token_ids
        ) or token in params.stop_token_ids
        if i == len(token_ids) - 1 and status == RequestStatus.FINISHED_STOPPED and stop_token:
            break
        detok.update([token])
    if status.finished and detok.stopped_by is None:
        detok.flush()


def _completion(state: RequestState, delta: bool) -> CompletionOutput:
    request, detok = state.request, state.detokenizer
    text = detok.text if detok is not None else ""
    tokens = request.output_token_ids
    logprobs = state.logprobs if request.sampling_params.logprobs is not None else None
    if delta:
        text_from, tokens_from = state.sent_text, state.sent_tokens
        state.sent_text, state.sent_tokens = len(text), len(tokens)
        text, tokens = text[text_from:], tokens[tokens_from:]
        logprobs = logprobs[tokens_from:] if logprobs is not None else None
    return CompletionOutput(
        index=request.index,
        text=text,
        token_ids=list(tokens),
        logprobs=list(logprobs) if logprobs is not None else None,
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
    )


def _prompt_logprobs(parent: ParentRequest) -> PromptLogprobs | None:
    """The prompt logprobs an output carries: all of them once all are read (an aborted request's
    output before then carries none), in DELTA mode only the first time."""
    if parent.prompt_logprobs is None or not _all_read(parent) or parent.prompt_logprobs_sent:
        return None
    return list(parent.prompt_logprobs)


def _all_read(parent: ParentRequest) -> bool:
    return len(parent.prompt_logprobs) == parent.samples[0].request.num_prompt_tokens


def _metrics(first: Request, finish_time: float | None) -> dict:
    """Timings of the user request, taken from its first sample (all share arrival)."""
    metrics = {"arrival_time": first.arrival_time, "num_preemptions": first.num_preemptions}
    if first.first_token_time is not None:
        metrics["time_to_first_token"] = first.first_token_time - first.arrival_time
    if finish_time is not None:
        metrics["e2e_latency"] = finish_time - first.arrival_time
    return metrics
