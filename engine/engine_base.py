"""What an engine does with requests, whatever computes their tokens: `EngineBase`.

`LLMEngine` (the model) and `SimulatedEngine` (engine/sim/: a timing model, no weights) share it:
taking requests in (tokenizing, validating, one `Request` per sample of `n`, resumption, adapters,
grammars), aborting them, and the token-level end of a step (appending a token, stop checks, the
`OutputProcessor`). A subclass sets the engine's parts (`config`, `tokenizer`, `vocab_size`,
`eos_token_ids`, `max_model_len`, `block_manager`, `scheduler`), calls `_init_requests()`, and
implements `step()` and `_read_adapter()`. Nothing here imports torch: a simulated replica never does.
"""

import itertools
import logging
import threading
import time

from raylane import tracing
from raylane.config import EngineConfig
from raylane.engine.block_manager import BlockManager
from raylane.engine.errors import EngineDeadError
from raylane.engine.lora import LoRARequest
from raylane.engine.output_processor import OutputProcessor
from raylane.engine.outputs import RequestOutput
from raylane.engine.request import Request, RequestStatus, Resumption
from raylane.engine.request_spans import emit_spans
from raylane.engine.request_trace import RequestTrace
from raylane.engine.sampling_params import SamplingParams
from raylane.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineBase:
    config: EngineConfig
    tokenizer: object | None
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    block_manager: BlockManager
    scheduler: Scheduler
    proposer = None  # speculative decoding's drafter (LLMEngine), told when a request ends
    _dead: BaseException | None = None

    def _init_requests(self) -> None:
        self._dead = None
        self.output_processor = OutputProcessor(self.tokenizer)
        self._structured = None
        self._structured_lock = threading.Lock()
        self._ids = itertools.count()
        self._num_traced = 0  # requests here with a RequestTrace: none, and a step records nothing
        self._lora_paths: dict[int, str] = {}  # adapter id -> its directory, once validated
        # adapter id -> what `_read_adapter` made of it: adapters are the operator's (config, admin loads)
        self._lora_weights: dict[int, object] = {}

    def _read_adapter(self, lora_path: str):
        """Check the adapter at `lora_path` against this engine (ValueError naming `lora_request`) and
        return what a step needs of it."""
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    # -- requests in ---------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate "
                f"within the maximum context length of {self.max_model_len} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resume: Resumption | None = None,
        tenant: str = "",
        lora_request: LoRARequest | None = None,
        cache_salt: str = "",
        trace: dict[str, str] | None = None,
    ) -> str:
        """`resume`: the output each sample already produced on a replica that died; the request
        continues after it (engine/request.py `Resumption`). `tenant`: whose request it is (the
        scheduler shares each priority's slots between tenants). `lora_request`: the adapter to run
        it with (an engine with `enable_lora`). `cache_salt` (vLLM's): the prefix-cache scope; its
        blocks are shared only with requests of the same salt. `trace`: the caller's W3C carrier; with
        tracing on in this process the request's timeline becomes spans under it when it ends."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id: {request_id!r} is already running")
        token_ids = self.tokenize(prompt)
        self._validate_prompt(token_ids, params)
        if lora_request is not None:
            self._validate_lora(lora_request)
        if resume is not None:
            self._validate_resume(token_ids, params, resume)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        samples = self._fan_out(request_id, token_ids, params, priority, arrival_time, resume)
        for sample in samples:
            sample.tenant, sample.lora, sample.cache_salt = tenant, lora_request, cache_salt
            if trace is not None and tracing.enabled() and not sample.status.finished:
                sample.trace = RequestTrace(trace)
                self._num_traced += 1
        self.output_processor.add_request(request_id, prompt, params, samples)
        for sample in samples:
            if not sample.status.finished:  # a resumed sample that had ended is not run again
                self.scheduler.add_request(sample)
        return request_id

    def check_lora(self, lora_path: str) -> None:
        """Raise ValueError when this engine could not run the adapter at `lora_path` (not serving
        adapters, a missing or unreadable file, a rank or tensor that does not fit the model)."""
        if not self.config.enable_lora:
            raise ValueError("lora_request: this engine serves no adapters (start it with enable_lora)")
        self._read_adapter(lora_path)

    def _validate_lora(self, lora: LoRARequest) -> None:
        """Read and check the adapter before the request is accepted, once per adapter id, and keep
        its weights: the step that loads a slot copies them from memory and reads no file (a load
        that failed inside a step, on files changed since, would end the engine for everyone)."""
        if not self.config.enable_lora:
            raise ValueError("lora_request: this engine serves no adapters (start it with enable_lora)")
        known = self._lora_paths.get(lora.lora_int_id)
        if known is None:
            weights = self._read_adapter(lora.lora_path)
            self._lora_paths[lora.lora_int_id] = lora.lora_path
            self._lora_weights[lora.lora_int_id] = weights
        elif known != lora.lora_path:
            raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} is already {known!r}")

    def _validate_resume(self, token_ids: list[int], params: SamplingParams, resume: Resumption) -> None:
        if len(resume.token_ids) != params.n:
            raise ValueError(f"resume: {len(resume.token_ids)} samples given for n={params.n}")
        for index, output in enumerate(resume.token_ids):
            if any(not 0 <= t < self.vocab_size for t in output):
                raise ValueError(f"resume: token ids must be in [0, {self.vocab_size})")
            if resume.finish_reason(index) is None and len(token_ids) + len(output) >= self.max_model_len:
                raise ValueError(
                    f"prompt: {len(token_ids)} tokens and {len(output)} already generated leave no room "
                    f"to generate within the maximum context length of {self.max_model_len} tokens"
                )

    def _fan_out(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival: float,
        resume: Resumption | None = None,
    ) -> list[Request]:
        """One engine request per sample of `n`, each scheduled on its own. With a seed, sample i gets
        seed + i, so the samples differ yet repeat. A resumed sample starts with its output so far
        (prefilled with the prompt, so the prefix cache serves what it holds of both), its grammar
        advanced over it; its generator starts afresh from the seed, so a seeded sampled sample goes
        on validly but not as it would have without the resumption."""
        samples = []
        for index in range(params.n):
            own = (
                params.clone(seed=params.seed + index) if params.n > 1 and params.seed is not None else params
            )
            sample = Request(
                request_id=request_id if params.n == 1 else f"{index}_{request_id}",
                prompt_token_ids=token_ids,
                sampling_params=own,
                priority=priority,
                arrival_time=arrival,
                max_total_tokens=self.max_model_len,
                eos_token_ids=self.eos_token_ids,
                parent_id=request_id,
                index=index,
            )
            if resume is not None:
                sample.all_token_ids.extend(resume.token_ids[index])
                # Its prompt logprobs went out, with its first output, from the replica that failed.
                sample.prompt_logprobs_position = sample.num_prompt_tokens
                if (reason := resume.finish_reason(index)) is not None:
                    sample.status = RequestStatus.finished_with(reason)
            if params.structured is not None:
                sample.grammar = self.structured_output.new_matcher(params.structured)
                for token in sample.output_token_ids if not sample.status.finished else ():
                    if not sample.grammar.accept_token(token):
                        raise ValueError(f"resume: token {token} is not allowed by the request's grammar")
            samples.append(sample)
        return samples

    @property
    def structured_output(self):
        return self._structured or self._build_structured_output()

    def _build_structured_output(self):
        with self._structured_lock:  # a request that comes before the startup thread is done waits
            if self._structured is None:
                from raylane.engine.structured_output import StructuredOutputManager

                if self.tokenizer is None:
                    raise ValueError("structured: grammar-constrained decoding needs a tokenizer")
                self._structured = StructuredOutputManager(
                    self.tokenizer, self.vocab_size, stop_token_ids=sorted(self.eos_token_ids)
                )
            return self._structured

    def _prepare_structured_output(self) -> None:
        try:
            self._build_structured_output()
        except Exception as e:  # the first request with a grammar meets it again, as its error
            logger.warning("structured output is not available: %r", e)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output."""
        samples = self.output_processor.samples(request_id)
        if samples is None:
            return None
        for sample in samples:
            if not sample.status.finished:
                self._finish(sample, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.make_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def warm_up(self) -> float:
        """Run one short request to its end before the engine serves any; its seconds. A model's first
        prefill and decode steps pay one-time costs (kernel selection, first allocations: on the
        embedded default on two cores, a replica's first request took 546 ms to its first token and
        those after it 100-130 ms), which then fall on the replica's start and not on its first
        client. What the request leaves behind, cached blocks and the prefix cache's counters, goes
        with it. The serving cores call it; the offline `LLM` does not."""
        started = time.monotonic()
        prompt = list(range(1, min(16, self.max_model_len - 4) + 1))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        self.add_request(prompt, params, request_id="raylane-warm-up")
        while self.has_unfinished_requests():
            self.step()
        self.block_manager.reset_prefix_cache()
        self.block_manager.prefix_cache_queries = self.block_manager.prefix_cache_hits = 0
        return time.monotonic() - started

    def _dead_error(self) -> EngineDeadError:
        dead = self._dead
        if isinstance(dead, EngineDeadError):
            error = EngineDeadError(str(dead))
        else:
            error = EngineDeadError(f"engine is dead: a step failed: {dead!r}")
        error.__cause__ = dead
        return error

    def _append_token(self, request: Request, token_id: int, logprobs) -> None:
        request.append_token(token_id)
        if request.grammar is not None:
            request.grammar.accept_token(token_id)
        status = self.output_processor.process_token(request, token_id, logprobs, request.check_stop())
        if status is not None:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        if request.trace is not None:
            self._num_traced -= 1
            emit_spans(request, status.finish_reason)
            request.trace = None
        if self.proposer is not None:
            self.proposer.free(request)
        self.output_processor.finish_request(request)
