"""Offline inference: `LLM(model=DIR).generate(prompts, params)`, as in vLLM."""

from collections.abc import Sequence

from raylane.config import EngineConfig
from raylane.engine.backends import make_engine
from raylane.engine.lora import LoRARequest
from raylane.engine.outputs import RequestOutput
from raylane.engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    """`with LLM(...) as llm:` or `llm.shutdown()` releases the engine's ranks (Ray actors and the
    placement group they hold) at a known point; an LLM that is dropped releases them when the
    garbage collector frees its engine (the engine's finalizer)."""

    def __init__(self, model: str, **engine_args):
        self.engine = make_engine(EngineConfig(model=model, **engine_args))

    def shutdown(self) -> None:
        """Release the engine's resources now; idempotent. Later `generate` calls raise `EngineDeadError`."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order.
        `lora_request`: one adapter for all prompts, or one (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request: one per prompt, or a single one for all")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            priority_i = priority[i] if priority else 0
            ids.append(self.engine.add_request(prompt, p, priority=priority_i, lora_request=loras[i]))
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **chat_template_kwargs,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise ValueError("messages: this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            tokenizer.apply_chat_template(
                conv,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **chat_template_kwargs,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[i] for i in request_ids]
