"""Owns the model and its KV cache on one device; runs one step's forward.

The runner sees only `ModelInput` (plain lists, cheap to pickle), so the same runner runs
in-process or inside a Ray worker that receives the batch from the driver. In a worker group
each rank builds its runner after joining the process groups (the layers read their shard
from them), reports how many KV blocks it could hold, and allocates the number every rank
agreed on (`available_kv_blocks`, then `allocate_kv_cache`).
"""

import logging
import time
from dataclasses import dataclass, field

import torch

from raylane.config import EngineConfig
from raylane.config.engine import KV_CACHE_DTYPE_ON_FLASH
from raylane.engine.compiled_decode import CompiledDecode, is_pure_decode
from raylane.engine.cuda_graph import DecodeGraphs, capture_sizes
from raylane.engine.memory_profile import DraftReservation, KVCacheSplit, MemoryReport, kv_cache_split
from raylane.models import load_model
from raylane.models.attention import build_attention_metadata
from raylane.models.gguf import checkpoint_dir
from raylane.models.paged_kernel import resolve_attention
from raylane.parallel.lora import AdapterWeights, LoRABatch, attach_lora, load_adapter
from raylane.parallel.onednn import packed_bytes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class ModelInput:
    token_ids: list[int]  # new tokens of all requests, flattened
    positions: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]  # per request: tokens in its KV after this step
    query_lens: list[int]  # per request: new tokens this step
    sample_indices: list[int]  # flattened token rows whose logits are wanted
    lora_slots: list[int] | None = None  # per request: its adapter's slot, -1 the base model; None: all base
    lora_loads: list[tuple[int, AdapterWeights]] = field(
        default_factory=list
    )  # (slot, adapter) to load first


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, hf_config, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device | None = None):
        """`device`: a particular one (a draft model on rank 0's GPU), else the config's."""
        from transformers import AutoConfig

        self.config = config
        self.device = device or resolve_device(config)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # graph capture and the allocator's stats use the current one
        hf_config = AutoConfig.from_pretrained(checkpoint_dir(config.model))
        self.dtype = resolve_dtype(config, hf_config, self.device)
        self.model, self.hf_config = load_model(
            config.model,
            dtype=self.dtype,
            device=self.device,
            quantization=config.quantization,
            cpu_weight_prepack=config.cpu_weight_prepack,
            cpu_batch_weight_copy=config.cpu_batch_weight_copy,
        )
        self.lora: LoRABatch | None = None
        if config.enable_lora:
            slots, rank = config.max_loras, config.max_lora_rank
            self.lora = attach_lora(self.model, slots, rank, self.dtype, self.device)
        self.num_blocks = 0  # until allocate_kv_cache
        head_dim = self.model.kv_cache_shape_per_block(1)[-1]
        self.attention_backend, self.block_size = resolve_attention(
            config.attention_backend, self.device, self.dtype, head_dim, config.block_size
        )
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else DTYPES[config.kv_cache_dtype]
        if self.attention_backend == "flash_varlen" and self.kv_dtype != self.dtype:
            raise ValueError(KV_CACHE_DTYPE_ON_FLASH)
        logger.info("attention backend: %s, KV blocks of %d tokens", self.attention_backend, self.block_size)
        self.graphs: DecodeGraphs | None = None  # captured after the KV cache is allocated
        self.graph_bytes = 0  # what the captured graphs hold on the GPU
        self.compiled: CompiledDecode | None = None  # compiled after the KV cache is allocated
        self.kv_split: KVCacheSplit | None = None  # how the GPU's budget was shared out (CUDA only)

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights: parameters (a tied embedding counted once) and packed weights."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + packed_bytes(self.model)

    def available_kv_blocks(self, draft: DraftReservation | None = None) -> int:
        """KV blocks this rank can hold: `num_kv_blocks` if set; on CPU what `kv_cache_memory_gb`
        holds; on a GPU what is left under `gpu_memory_utilization` after a profiling step (and a
        `draft` model on the same device), as `raylane.engine.memory_profile` computes it."""
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            return max(1, int(self.config.kv_cache_memory_gb * 2**30 // self._block_bytes()))
        self.kv_split = kv_cache_split(
            self.profile_memory(), self.config.gpu_memory_utilization, self._block_bytes(), draft
        )
        logger.info("%s", self.kv_split.describe())
        return max(1, self.kv_split.num_blocks - 1)  # the scratch block comes out of the same budget

    def _block_bytes(self) -> int:
        shape = self.model.kv_cache_shape_per_block(self.block_size)
        per_layer = 2 * torch.Size(shape).numel() * torch.tensor([], dtype=self.kv_dtype).element_size()
        return per_layer * self.model.num_layers

    def profile_memory(self) -> MemoryReport:
        """The GPU's memory around one profiling step (`profile_run`)."""
        device = self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        allocated = torch.cuda.memory_allocated(device)
        profile_kv_bytes = self.profile_run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        graph_bytes = self.profile_graph_memory() if self.uses_cuda_graphs else 0
        return MemoryReport(total, free, allocated, peak, profile_kv_bytes, graph_bytes)

    def profile_graph_memory(self) -> int:
        """Bytes the decode CUDA graphs will hold, so the KV cache leaves them room: the largest
        batch's graph captured on a throwaway cache of one block (the smaller graphs share its memory
        pool), measured and let go."""
        self.allocate_kv_cache(1, log=False, capture=False)
        try:
            graphs, graph_bytes = self._reserved_growth(
                lambda: self.capture_decode_graphs(sizes=[self.config.max_num_seqs])
            )
            del graphs
        except RuntimeError:  # capture fails here as it will after the cache: decoding is eager then
            graph_bytes = 0
        finally:
            self._release_kv_cache()
        torch.cuda.empty_cache()
        return graph_bytes

    def _reserved_growth(self, make):
        """(make(), how much more memory the allocator holds afterwards): a graph's private pool and
        static buffers, not the warm-up's activations, which empty_cache gives back."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        made = make()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return made, torch.cuda.memory_reserved(self.device) - before

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Forward the largest step the scheduler can make: `max_num_batched_tokens` prompt tokens
        (as prompts of at most the context length) with logits for up to `max_num_seqs` rows, on a
        throwaway KV cache just big enough. Returns that cache's bytes (part of the step's peak, not
        of its activations). `allocate_kv_cache` binds the real cache afterwards."""
        tokens, block = self.config.max_num_batched_tokens, self.block_size
        longest = min(self.config.max_model_len or self.hf_config.max_position_embeddings, tokens)
        lengths = [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])
        tables, next_block = [], 0
        for n in lengths:
            blocks = -(-n // block)
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
        self.allocate_kv_cache(next_block, log=False, capture=False)
        batch = ModelInput(
            token_ids=[0] * tokens,
            positions=[p for n in lengths for p in range(n)],
            block_tables=tables,
            context_lens=lengths,
            query_lens=lengths,
            sample_indices=list(range(min(tokens, self.config.max_num_seqs))),
        )
        self.execute_model(batch)
        self._release_kv_cache()
        return (next_block + 1) * self._block_bytes()  # and the scratch block

    def _release_kv_cache(self) -> None:
        """Let go of a profiling step's throwaway cache."""
        self.num_blocks = 0
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(None, None)

    def allocate_kv_cache(self, num_blocks: int, log: bool = True, capture: bool = True) -> None:
        """`num_blocks` for the block manager, and one more: the scratch block (index num_blocks)
        that padded rows of a captured decode batch write to, which no request owns. On CUDA with
        the flash_varlen backend and `enforce_eager` off, then captures the decode graphs; on CPU
        with `torch_compile`, compiles the decode step (its warm-up rows live in the scratch block)."""
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.graphs = self.compiled = None
        shape = (self.num_blocks + 1, *self.model.kv_cache_shape_per_block(self.block_size))
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            )
        if log:
            logger.info(
                "KV cache: %d blocks x %d tokens (%.1f MiB, %s)",
                self.num_blocks,
                self.block_size,
                self.num_blocks * self._block_bytes() / 2**20,
                str(self.kv_dtype).removeprefix("torch."),
            )
        if capture and self.uses_cuda_graphs:
            try:
                self.graphs, self.graph_bytes = self._reserved_growth(self.capture_decode_graphs)
                logger.info("CUDA graphs hold %.1f MiB", self.graph_bytes / 2**20)
            except RuntimeError as error:  # a layer that reads back to the host cannot be captured
                logger.warning(
                    "CUDA graphs: capture failed, decoding eagerly (enforce_eager: true): %s", error
                )
        if capture and self.compiles_decode:
            self.compile_decode()

    @property
    def uses_cuda_graphs(self) -> bool:
        """Graphs replay pure-decode steps on CUDA with the flash_varlen backend; never on CPU."""
        cuda_flash = self.device.type == "cuda" and self.attention_backend == "flash_varlen"
        # A step's adapter runs are Python the graphs cannot replay: with adapters, decode eagerly.
        return cuda_flash and not self.config.enforce_eager and not self.config.enable_lora

    @property
    def compiles_decode(self) -> bool:
        """`torch_compile` applies: CPU, torch or cpu_paged attention, one rank, no adapters, not
        enforce_eager."""
        cpu_torch = self.device.type == "cpu" and self.attention_backend in ("torch", "cpu_paged")
        config = self.config
        plain = config.world_size == 1 and not config.enable_lora and not config.enforce_eager
        return config.torch_compile and cpu_torch and plain

    @torch.inference_mode()
    def compile_decode(self) -> None:
        """Compile the pure-decode forward now (engine start-up), so no request waits for it; on a
        failure (an op inductor cannot take), log it and decode eagerly."""
        logger.info("torch.compile: compiling the decode step (once per process; inductor caches on disk)")
        caches = [c for layer in self.model.attention_layers() for c in (layer.k_cache, layer.v_cache)]
        compiled = CompiledDecode(
            self.model,
            caches,
            self.block_size,
            self.scratch_block,
            self.model.sliding_window,
            self.config.max_num_seqs,
            self.attention_backend,
        )
        try:
            seconds = compiled.warm_up()
        except Exception as error:  # noqa: BLE001 - any compile failure leaves eager decoding
            logger.warning("torch.compile: the decode step did not compile, decoding eagerly: %s", error)
            return
        self.compiled = compiled
        logger.info("torch.compile: decode step compiled in %.1f s", seconds)

    @torch.inference_mode()
    def capture_decode_graphs(self, capture: bool = True, sizes: list[int] | None = None) -> DecodeGraphs:
        """Graphs for decode batches of `sizes` requests (default 1, 2, 4, ... up to max_num_seqs),
        each as long as max_model_len (the block table's width). `capture` False: the CPU tests'
        eager stand-in."""
        max_len = self.config.max_model_len or self.hf_config.max_position_embeddings
        start = time.perf_counter()
        graphs = DecodeGraphs(
            self.model,
            sizes or capture_sizes(self.config.max_num_seqs),
            max_pages=-(-max_len // self.block_size),
            block_size=self.block_size,
            scratch_block=self.scratch_block,
            sliding_window=self.model.sliding_window,
            device=self.device,
            capture=capture,
        )
        logger.info(
            "CUDA graphs: decode batches of %s captured in %.1f s", graphs.sizes, time.perf_counter() - start
        )
        return graphs

    @torch.inference_mode()
    def execute_model(self, batch: ModelInput, compute_logits: bool = True) -> torch.Tensor | None:
        """Forward the batch; returns float32 logits [len(sample_indices), vocab] on the runner's
        device (a GPU's stay there: the sampler runs on them and only token ids come back).

        With `compute_logits` False (ranks whose TP group's logits nobody reads) it stops after
        the last layer and returns None.
        """
        if self.lora is not None:
            for slot, adapter in batch.lora_loads:
                load_adapter(self.model, slot, adapter)
            self.lora.set(batch.lora_slots or [-1] * len(batch.query_lens), batch.query_lens)
        size = self.graphs.size_for(batch) if self.graphs is not None else None
        if size is not None:
            hidden = self.graphs.run(batch, size)
            return self._logits(hidden, batch) if compute_logits else None
        if self.compiled is not None and is_pure_decode(batch.query_lens):
            hidden = self.compiled.run(batch)
            return self._logits(hidden, batch) if compute_logits else None
        meta = build_attention_metadata(
            batch.block_tables,
            batch.context_lens,
            batch.query_lens,
            self.block_size,
            self.device,
            sliding_window=self.model.sliding_window,
            backend=self.attention_backend,
        )
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, meta)
        return self._logits(hidden, batch) if compute_logits else None

    def _logits(self, hidden: torch.Tensor, batch: ModelInput) -> torch.Tensor:
        if not batch.sample_indices:
            return torch.empty(0, 0, device=self.device)
        rows = torch.tensor(batch.sample_indices, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()
