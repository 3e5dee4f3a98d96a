"""Draft-model proposer: a smaller checkpoint with the same tokenizer drafts k tokens autoregressively.

The draft runs in the driver process on its own `ModelRunner` (one rank, the engine's dtype). Its
device is the target's, or under tensor parallelism rank 0's GPU, which the driver shares and whose
KV cache leaves room for it (`draft_reservation`). It has its own KV cache and `BlockManager` (no
prefix caching), as many blocks as the target has, of the same size, so it has room whenever the
target has. Each request has a shadow `Request` there: the tokens the draft has computed KV for.
Before drafting, that state is cut back to the longest prefix that still agrees with the request's
verified tokens (rejected drafts roll back here too), then one forward catches up on the new tokens
and samples the first draft, and k - 1 one-token steps follow. Drafts are sampled from the draft's
filtered distribution (greedy: argmax), which is recorded as q for the rejection sampler.
"""

import torch

from raylane.config import EngineConfig
from raylane.engine.block_manager import BlockManager
from raylane.engine.memory_profile import DraftReservation
from raylane.engine.model_runner import ModelInput, ModelRunner
from raylane.engine.request import Request
from raylane.engine.sampler import _draw, _filter
from raylane.engine.spec_decode.proposer import Proposer, can_speculate, max_drafts
from raylane.models.gguf import checkpoint_dir


def draft_reservation(
    config: EngineConfig, dtype: torch.dtype, block_size: int, kv_dtype: torch.dtype
) -> DraftReservation:
    """The draft model's weight bytes (in `dtype`) and KV bytes per block (in `kv_dtype`, the
    engine's KV cache dtype, which the draft's cache shares), from its config alone
    (the model is built on the meta device: no memory), so the target's KV cache leaves room for it
    before the draft loads. Unquantized bytes: a quantized draft takes less, never more."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(checkpoint_dir(config.speculative_config.model))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    size = torch.tensor([], dtype=dtype).element_size()
    kv_size = torch.tensor([], dtype=kv_dtype).element_size()
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return DraftReservation(
        weight_bytes=sum(p.numel() for p in model.parameters()) * size,
        block_bytes=2 * hf.num_hidden_layers * block_size * kv_heads * head_dim * kv_size,
    )


def draft_reservation_on(runner: ModelRunner) -> DraftReservation | None:
    """What the engine's draft model will take on `runner`'s GPU, when it goes there: the runner of
    a single-rank engine, or rank 0's. None without a draft model, and on CPU (no profiling there)."""
    if not runner.config.uses_draft_model or runner.device.type != "cuda":
        return None
    return draft_reservation(runner.config, runner.dtype, runner.block_size, runner.kv_dtype)


class DraftModelProposer(Proposer):
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        device: torch.device | None = None,
        seed: int = 0,
    ):
        spec = config.speculative_config
        draft_config = config.model_copy(
            update=dict(
                model=spec.model,
                tokenizer=None,
                speculative_config=None,
                num_kv_blocks=num_blocks,
                block_size=block_size,
                tensor_parallel_size=1,
                expert_parallel_size=1,
                distributed_executor_backend="uni",
            )
        )
        self.k, self.vocab_size = spec.num_speculative_tokens, vocab_size
        self.runner = ModelRunner(draft_config, device=device)
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Request] = {}
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, requests: list[Request]) -> None:
        drafting: dict[Request, int] = {}
        for request in requests:
            request.spec_token_ids, request.spec_draft_probs = [], None
            k = max_drafts(request, self.k) if can_speculate(request) else 0
            if k > 0:
                self._sync(request)
                drafting[request] = k
        probs: dict[Request, list[torch.Tensor]] = {r: [] for r in drafting}
        while drafting:
            batch, stepping = self._prepare(drafting)
            if not stepping:
                break
            logits = self.runner.execute_model(batch)
            for row, request in enumerate(stepping):
                token, q = self._sample(logits[row], request)
                shadow = self.shadows[request.request_id]
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.all_token_ids.append(token)
                request.spec_token_ids.append(token)
                probs[request].append(q)
                if len(request.spec_token_ids) == drafting[request]:
                    del drafting[request]
        for request, rows in probs.items():
            if rows and not request.sampling_params.greedy:
                request.spec_draft_probs = torch.stack(rows)

    def _sync(self, request: Request) -> None:
        """Cut the shadow back to the prefix that matches the request's verified tokens."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(request.request_id, request.prompt_token_ids, request.sampling_params)
            self.shadows[request.request_id] = shadow
        ours, theirs = shadow.all_token_ids, request.all_token_ids
        n = min(shadow.num_computed_tokens, len(theirs) - 1)
        agree = next((i for i in range(n) if ours[i] != theirs[i]), n)
        shadow.num_computed_tokens = agree
        shadow.all_token_ids = list(theirs)

    def _prepare(self, drafting: dict[Request, int]) -> tuple[ModelInput, list[Request]]:
        batch, stepping = ModelInput([], [], [], [], [], []), []
        for request in list(drafting):
            shadow = self.shadows[request.request_id]
            start, end = shadow.num_computed_tokens, shadow.num_tokens
            if not self.block_manager.allocate_slots(shadow, end - start):
                del drafting[request]  # the draft cache is full: keep the drafts made so far
                continue
            batch.token_ids.extend(shadow.all_token_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.block_tables.append(shadow.block_ids)
            batch.context_lens.append(end)
            batch.query_lens.append(end - start)
            batch.sample_indices.append(len(batch.token_ids) - 1)
            stepping.append(request)
        return batch, stepping

    def _sample(self, logits: torch.Tensor, request: Request) -> tuple[int, torch.Tensor | None]:
        logits = _fit(logits, self.vocab_size)
        params = request.sampling_params
        if params.greedy:
            return int(logits.argmax()), None
        q = _filter(logits, params)
        return _draw(q, request.generator or self.generator), q

    def free(self, request: Request) -> None:
        shadow = self.shadows.pop(request.request_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)


def _fit(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft's logits over the target's vocabulary (padding rows differ between checkpoints)."""
    if logits.shape[-1] >= vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
