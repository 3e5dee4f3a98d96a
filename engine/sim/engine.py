"""`SimulatedEngine`: raylane's engine with the model's forward replaced by a timing model.

Everything but the forward is the real engine's (`EngineBase`, `Scheduler`, `BlockManager`, `LoRASlots`,
`OutputProcessor`): admission and validation, chunked prefill, the KV blocks a request holds, prefix
cache hits, preemption by priority and tenant, adapter slots, stop conditions, detokenized text. A step
schedules as the real one does, then lasts what the profile's formula gives for what was scheduled
(engine/sim/profile.py) on the engine's clock, then appends each sampling request's next token
(engine/sim/tokens.py). It holds no weights, imports no torch, and runs on a thread of the serving
process (`engine_core` never starts a process for it).

Not simulated (a 400 naming the field): grammars (`response_format` JSON/JSON schema, forced tool
calls), prompt logprobs, speculative decoding (a config error). Logprobs of generated tokens are made up
(engine/sim/tokens.py); an adapter is checked for its `adapter_config.json` and rank only.
"""

import json
from pathlib import Path

from raylane.config import EngineConfig
from raylane.engine.block_manager import BlockManager
from raylane.engine.engine_base import EngineBase
from raylane.engine.errors import EngineDeadError
from raylane.engine.lora import LoRASlots
from raylane.engine.outputs import RequestOutput
from raylane.engine.request import Request, RequestStatus
from raylane.engine.sampling_params import SamplingParams
from raylane.engine.scheduler import Scheduler, SchedulerOutput
from raylane.engine.sim.clock import RealClock, VirtualClock
from raylane.engine.sim.profile import load_profile
from raylane.engine.sim.tokenizer import eos_ids_of, load_sim_tokenizer
from raylane.engine.sim.tokens import SimulatedTokens


class SimulatedEngine(EngineBase):
    def __init__(self, config: EngineConfig, clock: RealClock | VirtualClock | None = None):
        """`clock`: where step time passes (default: real time, each step sleeping its simulated
        duration). The profile gives what the config leaves unset: block size, KV blocks, batch limits
        and context length."""
        if not config.simulated:
            raise ValueError("backend: SimulatedEngine runs the 'simulated' backend only")
        self.config = config
        self.profile = profile = load_profile(config.sim_profile)
        self.clock = clock if clock is not None else RealClock()
        tokenizer_spec = config.tokenizer or profile.tokenizer
        self.tokenizer = load_sim_tokenizer(tokenizer_spec)
        self.vocab_size = len(self.tokenizer)
        self.eos_token_ids = eos_ids_of(tokenizer_spec, self.tokenizer)
        block_size = config.block_size or profile.block_size
        num_blocks = config.num_kv_blocks or profile.num_kv_blocks
        self.max_model_len = min(config.max_model_len or profile.max_model_len, num_blocks * block_size)
        given = config.model_fields_set
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs if "max_num_seqs" in given else profile.max_num_seqs,
            config.max_num_batched_tokens
            if "max_num_batched_tokens" in given
            else profile.max_num_batched_tokens,
            LoRASlots(config.max_loras) if config.enable_lora else None,
        )
        self._init_requests()
        self.tokens = SimulatedTokens(self.tokenizer, self.eos_token_ids, profile.natural_output_tokens)
        self.num_steps = 0
        self.busy_s = 0.0  # simulated time spent in steps

    # -- what it does not simulate -------------------------------------------------------------

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        super()._validate_prompt(token_ids, params)
        if params.structured is not None:
            raise ValueError(
                "structured: the simulated engine runs no grammars (JSON mode, JSON schema, forced tool call)"
            )
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: the simulated engine computes no prompt logprobs")

    def _read_adapter(self, lora_path: str) -> None:
        try:
            config = json.loads((Path(lora_path) / "adapter_config.json").read_text())
            rank = int(config.get("r", 0))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"lora_request: no readable PEFT adapter at {lora_path}: {e}") from None
        if rank > self.config.max_lora_rank:
            raise ValueError(
                f"lora_request: adapter rank {rank} exceeds max_lora_rank {self.config.max_lora_rank}"
            )

    def warm_up(self) -> float:
        return 0.0  # no kernels, no first allocations: nothing to pay once

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._dead is not None:
            raise self._dead_error()
        start = self.clock.now()
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return []
        duration = self.step_time(scheduled)
        if self.scheduler.lora_slots is not None:
            self.scheduler.lora_slots.take_loads()  # a slot's load is part of the step; no weights to copy
        sampling: list[Request] = []
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            request.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(request)
            if request.num_computed_tokens == request.num_tokens:  # the prompt (or recompute) is done
                sampling.append(request)
        self.clock.sleep_until(start + duration)
        self.num_steps += 1
        self.busy_s += duration
        for request in sampling:
            token, logprobs = self.tokens.next_token(request)
            self._append_token(request, token, logprobs)
        return self.output_processor.make_outputs(sampling)

    def step_time(self, scheduled: SchedulerOutput) -> float:
        """The profile's time for this step: a request decodes when it computes the one token after
        its output so far; every other scheduled token is prefill (a prompt chunk, a recompute)."""
        prefill = context = 0
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            if (
                num_new == 1
                and request.num_output_tokens > 0
                and request.num_computed_tokens + 1 == request.num_tokens
            ):
                context += request.num_tokens
            else:
                prefill += num_new
        return self.profile.timing.step_time(len(scheduled.requests), prefill, context)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        super()._finish(request, status)
        self.tokens.forget(request)

    # -- health --------------------------------------------------------------------------------

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead_error()

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = EngineDeadError("engine is shut down")
