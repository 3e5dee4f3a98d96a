"""Attention over a paged KV cache.

The engine describes one step's batch with an `AttentionMetadata` (built once per
step, shared by every layer); each layer's `Attention` writes the new tokens' keys
and values into its cache blocks and attends over the request's whole context.

Three backends (`engine.attention_backend`), chosen once per engine:
- torch: gather each group's context through the block table, padded to its longest, then
  `scaled_dot_product_attention` with a mask. Runs anywhere.
- cpu_paged (CPU): decoding requests attend in raylane's C++ kernel (parallel/csrc/paged_decode.cpp),
  which walks each request's own blocks, one table lookup per block, with no gather or padding;
  prefill chunks as in torch (a few per step, their causal masks what SDPA does well). The CPU's
  default.
- flash_varlen (CUDA): FlashAttention-2 reads the pages in place, every request of the step in one
  call with no padding (`models/paged_kernel.py`).
The metadata says which: `groups` for torch and cpu_paged (a cpu_paged decode group holds block
tables instead of gathered slots and a mask), `paged` for flash_varlen.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raylane.models.paged_kernel import PagedKernelArgs, build_paged_args, paged_varlen_attention
from raylane.parallel import cpu_kernels, onednn


@dataclass(slots=True)
class AttentionGroup:
    """Requests attended together, their queries padded to the group's longest.

    token_index:  [n] rows of the step's tokens in this group (None: all of them, in order).
    query_dest:   [n] row of each token in the padded query tensor of shape [B * max_query_len].
    kv_slots:     [B, max_kv_len] cache slots of each request's whole context (padded).
    attn_mask:    [B, 1, max_query_len, max_kv_len] True where a query may attend a key.
    A cpu_paged decode group has no kv_slots or mask; the kernel reads the pages through
    block_tables:  [B, max_blocks] each request's blocks (padded with block 0), int64;
    context_lens:  [B] its tokens including the new one; sliding_window: its last tokens only, if set.
    """

    token_index: torch.Tensor | None
    query_dest: torch.Tensor
    kv_slots: torch.Tensor | None
    attn_mask: torch.Tensor | None
    max_query_len: int
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    sliding_window: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.kv_slots.shape[0]


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout; tokens of all requests are flattened to N rows.

    slot_mapping: [N] cache slot (block_id * block_size + offset) each new token's K/V goes to.
    groups: (torch backend) decoding requests attend in one group; each prefill chunk in its own,
    so a long prompt never pads every decode query of the step to its length.
    paged: (flash_varlen backend) the kernel's arguments for the whole step; groups is empty then.
    """

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    paged: PagedKernelArgs | None = None


def build_attention_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    backend: str = "torch",
) -> AttentionMetadata:
    """Describe a batch where request i computes its last `query_lens[i]` tokens of
    `context_lens[i]` (cached prefix + new tokens), its KV in `block_tables[i]`, for the attention
    `backend` (torch, cpu_paged or flash_varlen)."""
    if backend == "flash_varlen":
        slots = new_token_slots(block_tables, context_lens, query_lens, block_size)
        paged = build_paged_args(block_tables, context_lens, query_lens, device, sliding_window)
        return AttentionMetadata(slot_mapping=slots.to(device), groups=[], paged=paged)
    if backend == "cpu_paged":
        cpu_kernels.load()
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    members = ([decodes] if decodes else []) + [[i] for i, n in enumerate(query_lens) if n > 1]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slot_mapping = torch.empty(starts[-1], dtype=torch.long)
    groups = []
    for reqs in members:
        build = _paged_decode_group if backend == "cpu_paged" and reqs is decodes else _build_group
        group, slots = build(
            [block_tables[i] for i in reqs],
            [context_lens[i] for i in reqs],
            [query_lens[i] for i in reqs],
            block_size,
            sliding_window,
        )
        index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in reqs])
        slot_mapping[index] = slots
        group.token_index = None if len(members) == 1 else index.to(device)
        for name in ("query_dest", "kv_slots", "attn_mask", "block_tables", "context_lens"):
            if (tensor := getattr(group, name)) is not None:
                setattr(group, name, tensor.to(device))
        groups.append(group)
    return AttentionMetadata(slot_mapping=slot_mapping.to(device), groups=groups)


def new_token_slots(
    block_tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int
) -> torch.Tensor:
    """[N] cache slot of each new token: block_tables[i][pos // block_size] * block_size + pos % block_size
    for positions context_lens[i] - query_lens[i] .. context_lens[i] - 1 of request i."""
    slots = [
        table[pos // block_size] * block_size + pos % block_size
        for table, ctx, n in zip(block_tables, context_lens, query_lens, strict=True)
        for pos in range(ctx - n, ctx)
    ]
    return torch.tensor(slots, dtype=torch.long)


def _padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """[B, max_blocks] block tables padded with block 0; released blocks (-1, outside the sliding
    window) read block 0 too: the mask, or the kernel's window, never lets them through."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables]).clamp(min=0)


def _paged_decode_group(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    sliding_window: int | None,
) -> tuple[AttentionGroup, torch.Tensor]:
    """The cpu_paged backend's decode group: block tables in place of gathered slots and a mask."""
    group = AttentionGroup(
        token_index=None,
        query_dest=torch.arange(len(context_lens)),
        kv_slots=None,
        attn_mask=None,
        max_query_len=1,
        block_tables=_padded_tables(block_tables),
        context_lens=torch.tensor(context_lens),
        sliding_window=sliding_window,
    )
    return group, new_token_slots(block_tables, context_lens, query_lens, block_size)


def _build_group(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    sliding_window: int | None,
) -> tuple[AttentionGroup, torch.Tensor]:
    """One group's layout (on CPU), and the cache slots of its new tokens."""
    num_seqs = len(context_lens)
    max_q, max_kv = max(query_lens), max(context_lens)
    ctx = torch.tensor(context_lens)
    qlen = torch.tensor(query_lens)
    kv_pos = torch.arange(max_kv)
    # Cache slot of every context position: block_tables[i][pos // bs] * bs + pos % bs.
    tables = _padded_tables(block_tables)
    width = tables.shape[1]
    block_idx = (kv_pos // block_size).clamp(max=width - 1).expand(num_seqs, -1)
    kv_slots = tables.gather(1, block_idx) * block_size + kv_pos % block_size
    kv_slots = torch.where(kv_pos < ctx[:, None], kv_slots, 0)
    # Absolute position of each padded query row; row j of request i is at ctx - qlen + j.
    q_row = torch.arange(max_q)
    q_pos = (ctx - qlen)[:, None] + q_row
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    valid_q = q_row[None, :] < qlen[:, None]
    # Padding rows attend to slot 0 only, so softmax never sees an all-masked row.
    mask = torch.where(valid_q[:, :, None], mask, kv_pos[None, None, :] == 0)
    query_dest = torch.cat([i * max_q + torch.arange(n) for i, n in enumerate(query_lens)])
    new_pos = torch.cat([torch.arange(c - n, c) for c, n in zip(context_lens, query_lens, strict=True)])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlen)
    group = AttentionGroup(None, query_dest, kv_slots, mask[:, None], max_q)
    return group, kv_slots[seq_of_token, new_pos]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, KVH, D]; caches: [num_blocks, block_size, KVH, D], in q's dtype or
    bfloat16 (kv_cache_dtype). Returns [N, H, D] in q's dtype."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    # A cache in another dtype (kv_cache_dtype) rounds each key and value once, here.
    flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    if meta.paged is not None:
        return paged_varlen_attention(q, k_cache, v_cache, meta.paged, scale)
    if len(meta.groups) == 1:
        return _attend(q, k_cache, v_cache, meta.groups[0], scale)
    out = torch.empty_like(q)
    for group in meta.groups:
        out[group.token_index] = _attend(q[group.token_index], k_cache, v_cache, group, scale)
    return out


def _attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup, scale: float
):
    if group.block_tables is not None:  # cpu_paged: the kernel reads the pages in place
        window = group.sliding_window or 0
        tables, lens = group.block_tables, group.context_lens
        return torch.ops.raylane_cpu.paged_decode(
            q.contiguous(), k_cache, v_cache, tables, lens, scale, window
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    batch, max_q = group.num_seqs, group.max_query_len
    context = (batch, -1, num_kv_heads, head_dim)
    # index_select on the flat slots is several times faster than advanced indexing with a 2-D index.
    keys = flat_k.index_select(0, group.kv_slots.reshape(-1)).view(context).transpose(1, 2).to(q.dtype)
    values = flat_v.index_select(0, group.kv_slots.reshape(-1)).view(context).transpose(1, 2).to(q.dtype)
    upcast_from = None
    if max_q == 1 and q.device.type == "cpu" and q.dtype != torch.float32:
        if onednn.available(q.dtype):
            return _decode_on_cpu(q, keys, values, group.attn_mask, scale)
        # No native bf16 on this CPU (AVX2): its batched matmuls run several times slower than
        # float32's (and SDPA's bf16 kernel no better), so a bf16 decode attends in float32.
        upcast_from, q, keys, values = q.dtype, q.float(), keys.float(), values.float()
    if max_q == 1:  # pure decode: one query per request, already in order, nothing to pad
        padded = q.view(batch, 1, num_heads, head_dim).transpose(1, 2)
    else:
        padded = q.new_zeros(batch * max_q, num_heads, head_dim)
        padded[group.query_dest] = q
        padded = padded.view(batch, max_q, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        padded, keys, values, attn_mask=group.attn_mask, scale=scale, enable_gqa=num_kv_heads != num_heads
    )
    out = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
    out = out if max_q == 1 else out[group.query_dest]
    return out if upcast_from is None else out.to(upcast_from)


def _decode_on_cpu(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
):
    """One query per request in bfloat16/float16 on CPU, as two batched matmuls per KV head: SDPA's
    CPU flash kernel at one query takes most of a decode step there. In float32 SDPA stays (faster
    there). q: [B, H, D]; keys, values: [B, KVH, L, D]; mask: [B, 1, 1, L]. Softmax in float32."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    # Query head h reads KV head h // (H / KVH), as in SDPA's enable_gqa.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    scores.masked_fill_(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(values.dtype), values)
    return out.reshape(batch, num_heads, head_dim)


class Attention(nn.Module):
    """One layer's attention over its own KV cache blocks.

    The engine allocates the caches and binds them with `bind_kv_cache`; before that
    (e.g. a bare forward in a test) the layer cannot run.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_kv_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        """The layer's cache blocks; None lets go of a throwaway one (the profiling step's)."""
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
