"""Paged attention on CUDA through torch's FlashAttention-2 varlen kernel (`varlen_attn`).

The kernel reads keys and values in place through the block table: the cache layout
[num_blocks, block_size, KVH, D] is its page pool as is, so nothing is gathered or padded. All the
step's requests (decodes and prefill chunks, each with its cached prefix) go in one flattened call:
`cu_seq_q` marks where each request's new tokens start in the N rows, `seqused_k` how many cached
tokens it attends (its whole context, new tokens included).

The kernel's contract, as torch 2.13's `torch/nn/attention/varlen.py` and the FlashAttention-2 code
vendored in ATen (`flash_api.cpp`, `mha_varlen_fwd`) define it:
- causal masks are bottom-right aligned: query row i of a request with q new tokens and k context
  tokens attends keys j <= i + k - q, i.e. its own position and before;
- `window_size=(left, right)` keeps keys with i + k - q - left <= j <= i + k - q + right; (-1, 0) is
  plain causal, (W - 1, 0) the sliding window of W tokens that HF's models use (key positions
  p - W < j <= p);
- the page size (block_size) must be a multiple of 256 (`Paged KV cache block size must be divisible
  by 256`: the split-KV kernel's key tile must not straddle two pages), block_table / seqused_k /
  cu_seq_* are int32, q/k/v float16 or bfloat16, head_dim a multiple of 8 up to 256, sm80 or newer.
`tests/unit/test_paged_attention.py` holds a pure-torch reference of this contract and checks the
arguments built here against the torch backend on CPU.
"""

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from raylane.parallel import cpu_kernels

logger = logging.getLogger(__name__)

PAGE_MULTIPLE = 256  # FlashAttention-2's paged KV: page_block_size % 256 == 0
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def varlen_kernel() -> Callable | None:
    """torch's `varlen_attn` when it takes a paged cache (`block_table`, `seqused_k`: torch 2.13), else
    None (an older torch: the GPU image may have one). Detected by signature, not version."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"block_table", "seqused_k", "window_size"} <= params.keys() else None


@dataclass(slots=True)
class PagedKernelArgs:
    """`varlen_attn`'s batch arguments for one step, built once and shared by every layer.

    cu_seq_q:    int32 [B + 1] start of each request's new tokens in the step's N rows.
    cu_seq_k:    int32 [B + 1] cumulative context lengths (the kernel reads keys through the block
                 table; it needs the tensor, seqused_k says how many keys each request has).
    seqused_k:   int32 [B] context tokens of each request after this step's writes.
    block_table: int32 [B, max_pages] each request's blocks in order; unused entries read block 0.
    """

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_k: int
    window_size: tuple[int, int]


def build_paged_args(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    max_pages: int | None = None,
) -> PagedKernelArgs:
    """The kernel's arguments for requests that compute their last `query_lens[i]` of
    `context_lens[i]` tokens. `max_pages` fixes the block table's width (a captured CUDA graph's)."""
    width = max_pages or max(len(t) for t in block_tables)
    # A block released outside the sliding window (-1) is before every query's window: the kernel
    # never reads it, but the index must still be a valid page. One tensor from one padded list:
    # a tensor per request costs milliseconds per step at a few hundred requests.
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    table = torch.tensor(padded, dtype=torch.int32).clamp_(min=0)
    cu_q = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0, *context_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PagedKernelArgs(
        cu_seq_q=cu_q.to(device),
        cu_seq_k=cu_k.to(device),
        seqused_k=torch.tensor(context_lens, dtype=torch.int32).to(device),
        block_table=table.to(device),
        max_q=max(query_lens),
        max_k=max(context_lens),
        window_size=(-1, 0) if sliding_window is None else (sliding_window - 1, 0),
    )


def paged_varlen_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, args: PagedKernelArgs, scale: float
) -> torch.Tensor:
    """q: [N, H, D]; caches: [num_blocks, block_size, KVH, D] (already holding this step's keys and
    values). Returns [N, H, D]."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = varlen_kernel() or _missing_kernel
    return _KERNEL(
        q,
        k_cache,
        v_cache,
        args.cu_seq_q,
        args.cu_seq_k,
        args.max_q,
        args.max_k,
        scale=scale,
        window_size=args.window_size,
        enable_gqa=q.shape[1] != k_cache.shape[2],
        seqused_k=args.seqused_k,
        block_table=args.block_table,
    )


def _missing_kernel(*args, **kwargs):
    raise RuntimeError(
        "flash_varlen attention needs torch.nn.attention.varlen with block_table (torch 2.13+)"
    )


# Module-level so the CPU tests can put the contract's reference in the CUDA kernel's place. Found on
# first use: importing torch.nn.attention.varlen pulls in torch._dynamo, 1.7 s of every CPU process's
# start that imports the models (a replica and its engine core alike).
_KERNEL: Callable | None = None


def select_attention_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    kernel_available: bool | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> str:
    """`torch`, `cpu_paged` or `flash_varlen` for `engine.attention_backend` (auto or one of them).

    auto takes flash_varlen wherever it can run (CUDA, an sm80+ GPU, fp16/bf16, a head_dim it
    supports, block_size a multiple of 256, a torch that has the paged kernel), cpu_paged on a CPU
    (float32 or bfloat16, its C++ kernel built), and says why not otherwise; a backend requested
    where it cannot run is an error naming the setting to change. `kernel_available` and
    `compute_capability` default to this machine's (tests pass their own)."""
    if requested == "torch":
        return "torch"
    if requested == "cpu_paged" or (requested == "auto" and device.type == "cpu"):
        why_not = _why_not_cpu_paged(device, dtype)
        if why_not is None:
            return "cpu_paged"
        if requested == "cpu_paged":
            raise ValueError(f"{why_not[0]}: attention_backend cpu_paged cannot run here: {why_not[1]}")
        logger.warning("attention: the torch backend (padded gathers), not cpu_paged: %s", why_not[1])
        return "torch"
    why_not = _why_not_flash(device, dtype, head_dim, block_size, kernel_available, compute_capability)
    if why_not is None:
        return "flash_varlen"
    if requested == "flash_varlen":
        raise ValueError(f"{why_not[0]}: attention_backend flash_varlen cannot run here: {why_not[1]}")
    if device.type == "cuda":
        logger.warning("attention: the torch backend (padded gathers), not flash_varlen: %s", why_not[1])
    return "torch"


def _why_not_cpu_paged(device: torch.device, dtype: torch.dtype) -> tuple[str, str] | None:
    """(the setting to change, why) when the CPU decode kernel cannot run, else None."""
    if device.type != "cpu":
        return "device", f"it is a CPU kernel and the engine runs on {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return "dtype", f"it runs in float32 or bfloat16, not {dtype}"
    why_not = cpu_kernels.why_not_available()
    return None if why_not is None else ("attention_backend", why_not)


DEFAULT_BLOCK_SIZE = 16  # the block size where flash_varlen does not run


def resolve_attention(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int | None,
    kernel_available: bool | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> tuple[str, int]:
    """(attention backend, KV block size) of a rank. A `block_size` left unset is decided here, where
    the device is known (the config is validated before anyone knows the machine): 256 where
    flash_varlen can run, as its pages must be, else 16, whose finer blocks share more cached prefix."""
    machine = dict(kernel_available=kernel_available, compute_capability=compute_capability)
    if block_size is None:
        flash = requested == "flash_varlen" or (
            requested == "auto" and _why_not_flash(device, dtype, head_dim, PAGE_MULTIPLE, **machine) is None
        )
        block_size = PAGE_MULTIPLE if flash else DEFAULT_BLOCK_SIZE
    return select_attention_backend(requested, device, dtype, head_dim, block_size, **machine), block_size


def _why_not_flash(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    kernel_available: bool | None,
    compute_capability: tuple[int, int] | None,
) -> tuple[str, str] | None:
    """(the setting to change, why) when the flash kernel cannot run, else None."""
    if device.type != "cuda":
        return "device", f"it is a CUDA kernel and the engine runs on {device.type}"
    if not (varlen_kernel() is not None if kernel_available is None else kernel_available):
        return "attention_backend", f"torch {torch.__version__} has no paged varlen_attn (torch 2.13+)"
    capability = compute_capability or torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        return (
            "attention_backend",
            f"FlashAttention-2 needs sm80 or newer, this GPU is sm{capability[0]}{capability[1]}",
        )
    if dtype not in FLASH_DTYPES:
        return "dtype", f"FlashAttention runs in float16 or bfloat16, not {dtype}"
    if head_dim % 8 or head_dim > 256:
        return "attention_backend", f"head_dim {head_dim} is not a multiple of 8 up to 256"
    if block_size % PAGE_MULTIPLE:
        return "block_size", (
            f"block_size {block_size} is not a multiple of {PAGE_MULTIPLE} (its paged KV); set "
            f"engine.block_size: {PAGE_MULTIPLE}, or leave it unset"
        )
    return None
