"""The synchronous engine core: add requests, `step()` the batch, collect outputs.

`LLM` (offline) and `AsyncLLM` (serving) both drive this class. It takes requests in (one engine
`Request` per sample of `n`), and each step schedules a batch, runs it on the executor (the model
in-process, or one Ray actor per rank), samples, and verifies speculative drafts. Its
`OutputProcessor` turns the sampled tokens into `RequestOutput`s (text, stop strings, logprobs). A
step that fails leaves the engine dead: every later step and `check_health()` raise
`EngineDeadError`.
"""

import itertools
import logging
import threading
import time
import weakref

import torch

from raylane import tracing
from raylane.config import EngineConfig
from raylane.engine.block_manager import BlockManager
from raylane.engine.errors import EngineDeadError
from raylane.engine.executor import make_executor
from raylane.engine.lora import LoRARequest, LoRASlots
from raylane.engine.model_runner import ModelInput
from raylane.engine.output_processor import OutputProcessor
from raylane.engine.outputs import RequestOutput
from raylane.engine.prompt_logprobs import PromptLogprobRows, add_prompt_rows
from raylane.engine.request import Request, RequestStatus, Resumption
from raylane.engine.request_spans import emit_spans, is_prefill
from raylane.engine.request_trace import RequestTrace
from raylane.engine.sampler import Sampler
from raylane.engine.sampling_params import SamplingParams
from raylane.engine.scheduler import Scheduler, SchedulerOutput
from raylane.engine.spec_decode import RejectionSampler, SpecDecodeStats, make_proposer
from raylane.engine.tokenizer import eos_token_ids, load_tokenizer
from raylane.models.decoder import sliding_window_of
from raylane.parallel.lora import AdapterWeights, read_adapter

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, placement_group=None):
        """`placement_group`: a Ray placement group whose first world_size bundles the ranks use
        (default: the current one, e.g. a Serve replica's, else one the executor creates)."""
        self.config = config
        self.executor = make_executor(config, placement_group)
        # Dropping the engine releases its ranks (actors, placement group) without shutdown(): the
        # finalizer holds the executor, not self. A failed start below releases them at once.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        try:
            self._init_core(config)
        except BaseException:
            self._finalizer()
            raise

    def _init_core(self, config: EngineConfig) -> None:
        self.runner = getattr(self.executor, "runner", None)  # the in-process ModelRunner, if any
        self.hf_config = self.executor.hf_config
        self._dead: BaseException | None = None
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.vocab_size = self.hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(config.model, self.hf_config, self.tokenizer)
        self.max_model_len = min(
            config.max_model_len or self.hf_config.max_position_embeddings,
            self.executor.num_blocks * self.executor.block_size,
        )
        self.block_manager = BlockManager(
            self.executor.num_blocks,
            self.executor.block_size,
            config.enable_prefix_caching,
            sliding_window=sliding_window_of(self.hf_config),
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            LoRASlots(config.max_loras) if config.enable_lora else None,
        )
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed))
        self.proposer = make_proposer(config, self.block_manager, self.vocab_size, self.executor.draft_device)
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.spec_decode_stats = SpecDecodeStats()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._structured = None
        self._structured_lock = threading.Lock()
        if self.tokenizer is not None:
            # Now, beside the rest of the startup, rather than for the first request with a grammar:
            # importing xgrammar and reading the vocabulary held the step loop ~70 ms with the demo
            # model's 4,096 tokens, a stall of every stream on the replica (in a throwaway probe,
            # another key's requests beside a replica's first grammar took 168-187 ms, against 53).
            threading.Thread(
                target=self._prepare_structured_output, daemon=True, name="xgrammar-init"
            ).start()
        self._ids = itertools.count()
        self._num_traced = 0  # requests here with a RequestTrace: none, and a step records nothing
        self._lora_paths: dict[int, str] = {}  # adapter id -> its directory, once validated
        # adapter id -> its weights as read then: adapters are the operator's (config, admin loads)
        self._lora_weights: dict[int, AdapterWeights] = {}

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
        read_adapter(lora_path, self.hf_config, self.config.max_lora_rank)

    def _validate_lora(self, lora: LoRARequest) -> None:
        """Read and check the adapter before the request is accepted, once per adapter id, and keep
        its weights: the step that loads a slot copies them from memory and reads no file (a load
        that failed inside a step, on files changed since, would end the engine for everyone)."""
        if not self.config.enable_lora:
            raise ValueError("lora_request: this engine serves no adapters (start it with enable_lora)")
        known = self._lora_paths.get(lora.lora_int_id)
        if known is None:
            weights = read_adapter(lora.lora_path, self.hf_config, self.config.max_lora_rank)
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

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return []
        traced = self._traced_rows(scheduled) if self._num_traced else None
        started = time.monotonic() if traced else 0.0
        batch, sampling, prompt_rows = self._prepare_input(scheduled)
        logits = self._execute(batch)
        if traced:  # before sampling: a request that ends in this step emits its spans there
            ended = time.monotonic()
            for request, num_new, prefill in traced:
                request.trace.step(started, ended, num_new, prefill)
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            # Drafts count as computed only once verified (below).
            request.num_computed_tokens += num_new - len(request.spec_token_ids)
            self.block_manager.cache_full_blocks(request)
            self.block_manager.free_outside_window(request)
        for rows in prompt_rows:
            self.output_processor.add_prompt_logprobs(rows.request, rows.read(logits))
        plain = [(row, r) for row, r in sampling if not r.spec_token_ids]
        if plain:
            rows = [row for row, _ in plain]
            requests = [r for _, r in plain]
            plain_logits = logits[rows] if len(rows) < logits.shape[0] else logits
            self._apply_grammar(plain_logits, requests)
            sampled = self.sampler(plain_logits, requests)
            for i, request in enumerate(requests):
                self._append_token(request, sampled.token_ids[i], sampled.logprobs[i])
        for row, request in sampling:
            if request.spec_token_ids:
                self._verify_drafts(request, logits[row : row + len(request.spec_token_ids) + 1])
        return self.output_processor.make_outputs([request for _, request in sampling])

    @staticmethod
    def _traced_rows(scheduled: SchedulerOutput) -> list[tuple[Request, int, bool]]:
        """(request, tokens computed, whether a prefill chunk) of the step's traced requests."""
        return [
            (r, n, is_prefill(r))
            for r, n in zip(scheduled.requests, scheduled.num_new_tokens, strict=True)
            if r.trace is not None
        ]

    def _verify_drafts(self, request: Request, logits: torch.Tensor) -> None:
        """Keep the accepted drafts and the target's next token; roll the rejected drafts' KV back."""
        drafts, draft_probs = request.spec_token_ids, request.spec_draft_probs
        request.spec_token_ids, request.spec_draft_probs = [], None
        tokens = self.rejection_sampler(logits, drafts, draft_probs, request)
        num_accepted = len(tokens) - 1
        self.spec_decode_stats.observe(len(drafts), num_accepted)
        if request.trace is not None:
            request.trace.verified(len(drafts), num_accepted)
        for token in tokens:
            self._append_token(request, token, None)
            if request.status.finished:
                return
        # The accepted drafts' KV is the verified tokens' KV; the rejected ones' slots get overwritten.
        request.num_computed_tokens += num_accepted
        self.block_manager.cache_full_blocks(request)
        self.block_manager.free_outside_window(request)

    def _prepare_input(
        self, scheduled: SchedulerOutput
    ) -> tuple[ModelInput, list[tuple[int, Request]], list[PromptLogprobRows]]:
        """The step's batch; (first logits row, request) of every request that samples: one row, or
        1 + k consecutive rows for a request verifying k drafts; the rows of prompt positions whose
        logprobs are asked for (engine/prompt_logprobs.py)."""
        batch = ModelInput([], [], [], [], [], [])
        sampling: list[tuple[int, Request]] = []
        prompt_rows: list[PromptLogprobRows] = []
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            start = request.num_computed_tokens
            end = start + num_new
            drafts = request.spec_token_ids
            if (rows := add_prompt_rows(batch, request, len(batch.token_ids), start, end)) is not None:
                prompt_rows.append(rows)
            batch.token_ids.extend(request.all_token_ids[start : end - len(drafts)])
            batch.token_ids.extend(drafts)
            batch.positions.extend(range(start, end))
            # A copy: freeing the request clears block_ids, and a batch may outlive its step.
            batch.block_tables.append(list(request.block_ids))
            batch.context_lens.append(end)
            batch.query_lens.append(num_new)
            if end - len(drafts) == request.num_tokens:  # the prompt (or recompute) is done: sample
                sampling.append((len(batch.sample_indices), request))
                last = len(batch.token_ids) - 1
                batch.sample_indices.extend(range(last - len(drafts), last + 1))
        slots = self.scheduler.lora_slots
        if slots is not None:
            batch.lora_loads = [(slot, self._lora_weights[i]) for slot, i in slots.take_loads()]
            if any(r.lora is not None for r in scheduled.requests):
                batch.lora_slots = [slots.slot_of(r.lora) for r in scheduled.requests]
        return batch, sampling, prompt_rows

    def _execute(self, batch: ModelInput) -> torch.Tensor:
        if self._dead is not None:
            raise self._dead_error()
        try:
            return self.executor.execute_model(batch)
        except Exception as e:
            self._dead = e
            raise

    def check_health(self) -> None:
        """Raise `EngineDeadError` if a step failed or a rank of the worker group is gone."""
        if self._dead is not None:
            raise self._dead_error()
        self.executor.check_health()

    def _dead_error(self) -> EngineDeadError:
        dead = self._dead
        if isinstance(dead, EngineDeadError):
            error = EngineDeadError(str(dead))
        else:
            error = EngineDeadError(f"engine is dead: a step failed: {dead!r}")
        error.__cause__ = dead
        return error

    def shutdown(self) -> None:
        """Release the worker group (Ray actors, placement group; nothing to release in-process).
        Idempotent; later steps and `check_health()` raise `EngineDeadError`."""
        if self._dead is None:
            self._dead = EngineDeadError("engine is shut down")
        self._finalizer()

    def _apply_grammar(self, logits: torch.Tensor, requests: list[Request]) -> None:
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if rows:
            self.structured_output.apply_masks(logits, rows, [requests[i].grammar for i in rows])

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
