"""Pure-decode steps replayed from CUDA graphs (vLLM's `enforce_eager: false`).

A decode step of a small model on a GPU is mostly kernel launches: hundreds of small kernels whose
launch cost the GPU waits on. A CUDA graph records one step's kernels once and replays them with one
launch. A graph replays fixed shapes and fixed addresses, so:
- graphs are captured for a few batch sizes (1, 2, 4, 8, 16, 32, ... up to max_num_seqs), and a
  decode batch is padded up to the next captured size;
- every input lives in a static buffer the graph reads: token ids, positions, and the flash_varlen
  kernel's arguments (slot mapping, block table at the widest a request can need, context lengths);
  a step copies its batch into them and replays;
- padded rows decode token 0 at position 0 with a context of one token in the scratch block, a KV
  block the runner holds beyond the block manager's (no request owns it), so their K/V writes and
  their attention touch nothing of a real request, and each real row's output is its own.
Only pure-decode steps (one new token per request) are captured: prefill chunks vary in shape every
step. Only the flash_varlen backend is captured (the torch backend's masks are shaped by the batch).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from raylane.models.attention import AttentionMetadata, new_token_slots
from raylane.models.paged_kernel import build_paged_args


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The powers of two below max_num_seqs (1, 2, 4, ..., as vLLM's small sizes), and max_num_seqs."""
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    return [*sizes, max_num_seqs]


def graph_size(query_lens: list[int], sizes: list[int]) -> int | None:
    """The captured size a step pads to, or None: not a pure decode step, or too many requests."""
    if not query_lens or any(n != 1 for n in query_lens):
        return None
    return next((s for s in sizes if s >= len(query_lens)), None)


def pad_decode_batch(batch, size: int, scratch_block: int):
    """`batch` (a pure-decode ModelInput) with rows added up to `size`: token 0 at position 0, one
    token of context in `scratch_block`. Its `sample_indices` stay the real rows'."""
    pad = size - len(batch.query_lens)
    return type(batch)(
        token_ids=batch.token_ids + [0] * pad,
        positions=batch.positions + [0] * pad,
        block_tables=batch.block_tables + [[scratch_block]] * pad,
        context_lens=batch.context_lens + [1] * pad,
        query_lens=batch.query_lens + [1] * pad,
        sample_indices=batch.sample_indices,
    )


@dataclass(slots=True)
class _StaticStep:
    """One captured size's input buffers, metadata over them, and the forward's output."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    replay: Callable[[], None] = lambda: None
    hidden: torch.Tensor | None = field(default=None)


class DecodeGraphs:
    """CUDA graphs of the model's forward for pure-decode batches of `sizes` requests.

    `forward(input_ids, positions, meta)` is the model's forward (hidden states out). With
    `capture` False the "replay" runs that forward eagerly on the same static buffers: how the CPU
    tests check the buffers' bookkeeping, which is everything here but the graph itself."""

    def __init__(
        self,
        forward: Callable,
        sizes: list[int],
        max_pages: int,
        block_size: int,
        scratch_block: int,
        sliding_window: int | None,
        device: torch.device,
        capture: bool = True,
    ):
        self.sizes, self.max_pages, self.block_size = sorted(sizes), max_pages, block_size
        self.scratch_block, self.device = scratch_block, device
        self.steps: dict[int, _StaticStep] = {}
        pool = None
        # Largest first: the smaller graphs reuse the largest one's memory pool.
        for size in reversed(self.sizes):
            step = self._static_step(size, sliding_window)
            if capture:
                _warm_up_on_a_side_stream(
                    lambda step=step: forward(step.input_ids, step.positions, step.meta)
                )
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    step.hidden = forward(step.input_ids, step.positions, step.meta)
                pool = graph.pool()
                step.replay = graph.replay
            else:
                forward(step.input_ids, step.positions, step.meta)

                def replay(step=step):
                    step.hidden = forward(step.input_ids, step.positions, step.meta)

                step.replay = replay
            self.steps[size] = step

    def _static_step(self, size: int, sliding_window: int | None) -> _StaticStep:
        """Buffers for `size` rows, filled with padding rows (every row in the scratch block)."""
        tables, ctx, q = [[self.scratch_block]] * size, [1] * size, [1] * size
        args = build_paged_args(tables, ctx, q, self.device, sliding_window, max_pages=self.max_pages)
        # The kernel's split heuristics read max_k on the host at capture: the longest context any
        # replay may have, so a longer one is never cut short.
        args.max_k = self.max_pages * self.block_size
        slots = new_token_slots(tables, ctx, q, self.block_size).to(self.device)
        meta = AttentionMetadata(slot_mapping=slots, groups=[], paged=args)
        zeros = torch.zeros(size, dtype=torch.long, device=self.device)
        return _StaticStep(input_ids=zeros, positions=zeros.clone(), meta=meta)

    def size_for(self, batch) -> int | None:
        if any(len(t) > self.max_pages for t in batch.block_tables):
            return None
        return graph_size(batch.query_lens, self.sizes)

    def run(self, batch, size: int) -> torch.Tensor:
        """Hidden states [size, hidden] of `batch` padded to `size` (a static buffer: read it before
        the next run)."""
        padded = pad_decode_batch(batch, size, self.scratch_block)
        step = self.steps[size]
        args = build_paged_args(
            padded.block_tables, padded.context_lens, padded.query_lens, max_pages=self.max_pages
        )
        slots = new_token_slots(padded.block_tables, padded.context_lens, padded.query_lens, self.block_size)
        step.input_ids.copy_(torch.tensor(padded.token_ids), non_blocking=True)
        step.positions.copy_(torch.tensor(padded.positions), non_blocking=True)
        step.meta.slot_mapping.copy_(slots, non_blocking=True)
        step.meta.paged.cu_seq_k.copy_(args.cu_seq_k, non_blocking=True)
        step.meta.paged.seqused_k.copy_(args.seqused_k, non_blocking=True)
        step.meta.paged.block_table.copy_(args.block_table, non_blocking=True)
        step.replay()
        return step.hidden


def _warm_up_on_a_side_stream(run: Callable[[], object]) -> None:
    """Run once before capture, as torch's CUDA graph docs ask: lazy initialisation (cuBLAS
    workspaces, autotuning) happens outside the graph, on a stream that is not the capture's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
