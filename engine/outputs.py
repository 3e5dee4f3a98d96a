"""What the engine returns, shaped like vLLM's `RequestOutput`."""

from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class Logprob:
    logprob: float
    # Prompt logprobs: how many tokens are at least as likely (vLLM's count: 1 for the likeliest), the
    # top-k 1 to k. None where not computed (generated tokens).
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k); None for a
# token a resumed request had produced before (on the replica that reported its logprobs).
SampleLogprobs = list[dict[int, Logprob] | None]
# One dict per prompt token, as vLLM: token id -> Logprob (the prompt token and the top-k), None for
# the first token, which has no context.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it, if any

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: on every cumulative output, on the first delta output, in
    # the final-only one.
    prompt_logprobs: PromptLogprobs | None = None

    def merged(self, newer: "RequestOutput", delta: bool) -> "RequestOutput":
        """This output followed by `newer`, as one (for a consumer that fell behind). Cumulative and
        final outputs already hold everything: the newer one stands. Delta outputs are joined per
        completion: text, tokens and logprobs appended, the newer finish reason; the prompt logprobs
        that only the first delta carries are kept."""
        if not delta:
            return newer
        mine = {c.index: c for c in self.outputs}
        outputs = []
        for comp in newer.outputs:
            old = mine.get(comp.index)
            if old is not None:
                logprobs = None if comp.logprobs is None else (old.logprobs or []) + comp.logprobs
                text, token_ids = old.text + comp.text, old.token_ids + comp.token_ids
                comp = replace(comp, text=text, token_ids=token_ids, logprobs=logprobs)
            outputs.append(comp)
        prompt_logprobs = self.prompt_logprobs if newer.prompt_logprobs is None else newer.prompt_logprobs
        return replace(newer, outputs=outputs, prompt_logprobs=prompt_logprobs)
