"""Pure-decode steps through torch.compile on CPU (`torch_compile: true`), the CPU's counterpart of
engine/cuda_graph.py.

An eager decode step of a small model on CPU is ~70 small torch ops a layer with the interpreter
between them: at one stream more of the step goes to that than to the matmuls (bench/README.md,
"Where a decode step's time goes"). Inductor compiles the model's forward into fused C++ loops
around the matmul and attention kernels, so norms, rotary, residuals, activations and dtype
conversions cost a kernel each instead of several ops each.

Every graph a decode step can need is compiled at start-up (`warm_up`), so no request waits for a
compile:
- the batch's rows and its longest context are symbolic sizes (`torch._dynamo.mark_dynamic`), so a
  new batch size or a context one token longer reuses the graph;
- dynamo keeps a size of 1 concrete, and the layers choose their kernel by the number of rows (the
  int4 kernel, the batch copy, the dense path), so there is one graph per row range: the warm-up
  runs batches on both sides of each threshold (`warm_up_rows`);
- a served step runs with guard evaluation skipped (`skip_guard_eval_unsafe`; checking every
  parameter's guards took 1 ms of a 15 ms step): a decode batch has the warm-up's structure by
  construction (one attention group, one query per request, the same dtypes and devices), and the
  graphs are correct at any size, the guards on sizes only choose the faster kernel. Should a step
  still need a new graph, it runs eagerly (`eager_on_recompile`) instead of compiling.
Prefill and mixed steps stay eager, as do LoRA batches and tensor/expert-parallel ranks (their
collectives would split the graph).
"""

import logging
import time
from collections.abc import Callable

import torch

from raylane.models.attention import AttentionMetadata, build_attention_metadata
from raylane.parallel.int4 import DENSE_MIN_TOKENS
from raylane.parallel.quantization import BATCH_COPY_MIN_ROWS

logger = logging.getLogger(__name__)


def warm_up_rows(max_rows: int) -> list[int]:
    """Batch sizes that compile every decode graph: 1 (a size of 1 is never symbolic), 2 and 3, and
    both sides of each row threshold in the layers' code, up to `max_rows`."""
    rows = {1, 2, 3}
    for threshold in (BATCH_COPY_MIN_ROWS, DENSE_MIN_TOKENS):
        rows |= {threshold, threshold + 1}
    return sorted(n for n in rows if n <= max_rows)


def is_pure_decode(query_lens: list[int]) -> bool:
    return bool(query_lens) and all(n == 1 for n in query_lens)


def mark_dynamic(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
    """Make the batch's rows and the longest context (slots or blocks) symbolic in the traced graph."""
    group = meta.groups[0]
    per_row = (group.kv_slots, group.attn_mask, group.block_tables, group.context_lens)
    rows = (input_ids, positions, meta.slot_mapping, group.query_dest, *(t for t in per_row if t is not None))
    if input_ids.shape[0] > 1:  # one row stays a size of 1: the graph of its own
        for tensor in rows:
            torch._dynamo.mark_dynamic(tensor, 0)
    for tensor, dim in ((group.kv_slots, 1), (group.attn_mask, 3), (group.block_tables, 1)):
        if tensor is not None:
            torch._dynamo.mark_dynamic(tensor, dim)


class CompiledDecode:
    """The model's forward compiled for pure-decode batches on CPU with the torch or cpu_paged
    attention backend.

    `forward(input_ids, positions, meta)` is the model's forward (hidden states out), `kv_caches` the
    cache tensors its attention layers hold."""

    SERVING_STANCE = "eager_on_recompile"  # what a served step does if it needs a new graph

    def __init__(
        self,
        forward: Callable,
        kv_caches: list[torch.Tensor],
        block_size: int,
        scratch_block: int,
        sliding_window: int | None,
        max_rows: int,
        backend: str,
    ):
        self.compiled = torch.compile(forward, fullgraph=True)
        for cache in kv_caches:  # the number of KV blocks is the pool's setting: one compiled graph for any
            torch._dynamo.mark_dynamic(cache, 0)
        self.block_size, self.scratch_block, self.sliding_window = block_size, scratch_block, sliding_window
        self.max_rows, self.backend = max_rows, backend

    def _forward(self, token_ids, positions, block_tables, context_lens) -> torch.Tensor:
        queries = [1] * len(token_ids)
        # A context within one block has a one-column table, a size dynamo keeps concrete: a graph no
        # warm-up made. A second column (the scratch block, past every context) reuses the others.
        block_tables = [t if len(t) > 1 else [*t, self.scratch_block] for t in block_tables]
        meta = build_attention_metadata(
            block_tables,
            context_lens,
            queries,
            self.block_size,
            sliding_window=self.sliding_window,
            backend=self.backend,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long)
        position_ids = torch.tensor(positions, dtype=torch.long)
        mark_dynamic(input_ids, position_ids, meta)
        return self.compiled(input_ids, position_ids, meta)

    def warm_up(self) -> float:
        """Compile every graph a decode step can need and run each once; seconds taken.

        Dynamo splits the graph where the model's code branches on the number of rows (1, the int4
        kernel's and the batch copy's thresholds), so the warm-up batches straddle each threshold, and
        each graph meets two contexts (its context length is symbolic from the first)."""
        started = time.perf_counter()
        for rows in warm_up_rows(self.max_rows):
            # Two and three blocks of context (a size of 1 would stay concrete), every block the scratch
            # block, which no request owns.
            for context in (self.block_size + 2, 2 * self.block_size + 3):
                table = [self.scratch_block] * -(-context // self.block_size)
                self._forward([0] * rows, [context - 1] * rows, [table] * rows, [context] * rows)
        return time.perf_counter() - started

    def run(self, batch) -> torch.Tensor:
        """Hidden states [rows, hidden] of a pure-decode `batch` (a `ModelInput`)."""
        args = (batch.token_ids, batch.positions, batch.block_tables, batch.context_lens)
        try:
            with torch.compiler.set_stance(self.SERVING_STANCE, skip_guard_eval_unsafe=True):
                return self._forward(*args)
        except RuntimeError as e:
            # With guards skipped, a batch no graph fits raises before anything runs, whatever the
            # stance says; checking the guards lets the stance run it (eagerly when serving).
            if "skip_guard_eval_unsafe" not in str(e):
                raise
        logger.warning(
            "no graph compiled at start-up fits this decode batch (%d rows): running it eagerly", len(args[0])
        )
        with torch.compiler.set_stance(self.SERVING_STANCE):
            return self._forward(*args)
