"""The synchronous engine core: add requests, `step()` the batch, collect outputs.

`LLM` (offline) and `AsyncLLM` (serving) both drive this class. It takes requests in (one engine
`Request` per sample of `n`), and each step schedules a batch, runs it on the executor (the model
in-process, or one Ray actor per rank), samples, and verifies speculative drafts. Its
`OutputProcessor` turns the sampled tokens into `RequestOutput`s (text, stop strings, logprobs); taking
requests in and that end of a step are `EngineBase`'s (engine/engine_base.py), which the simulated
engine shares. A
step that fails leaves the engine dead: every later step and `check_health()` raise
`EngineDeadError`.
"""

import threading
import time
import weakref

import torch

from raylane.config import EngineConfig
from raylane.engine.block_manager import BlockManager
from raylane.engine.engine_base import EngineBase
from raylane.engine.errors import EngineDeadError
from raylane.engine.executor import make_executor
from raylane.engine.lora import LoRASlots
from raylane.engine.model_runner import ModelInput
from raylane.engine.outputs import RequestOutput
from raylane.engine.prompt_logprobs import PromptLogprobRows, add_prompt_rows
from raylane.engine.request import Request
from raylane.engine.request_spans import is_prefill
from raylane.engine.sampler import Sampler
from raylane.engine.scheduler import Scheduler, SchedulerOutput
from raylane.engine.spec_decode import RejectionSampler, SpecDecodeStats, make_proposer
from raylane.engine.tokenizer import eos_token_ids, load_tokenizer
from raylane.models.decoder import sliding_window_of
from raylane.parallel.lora import AdapterWeights, read_adapter


class LLMEngine(EngineBase):
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
        self._init_requests()
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed))
        self.proposer = make_proposer(config, self.block_manager, self.vocab_size, self.executor.draft_device)
        self.rejection_sampler = RejectionSampler(self.sampler.generator)
        self.spec_decode_stats = SpecDecodeStats()
        if self.tokenizer is not None:
            # Now, beside the rest of the startup, rather than for the first request with a grammar:
            # importing xgrammar and reading the vocabulary held the step loop ~70 ms with the demo
            # model's 4,096 tokens, a stall of every stream on the replica (in a throwaway probe,
            # another key's requests beside a replica's first grammar took 168-187 ms, against 53).
            threading.Thread(
                target=self._prepare_structured_output, daemon=True, name="xgrammar-init"
            ).start()

    def _read_adapter(self, lora_path: str) -> AdapterWeights:
        """Read and check the adapter before its request is accepted: the step that loads a slot copies
        its weights from memory and reads no file."""
        return read_adapter(lora_path, self.hf_config, self.config.max_lora_rank)

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

    def warm_up(self) -> float:
        seconds = super().warm_up()
        self.spec_decode_stats = SpecDecodeStats()  # its drafts counted no client's tokens
        return seconds

    def check_health(self) -> None:
        """Raise `EngineDeadError` if a step failed or a rank of the worker group is gone."""
        if self._dead is not None:
            raise self._dead_error()
        self.executor.check_health()

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
