"""Tensor-parallel linear and embedding layers (vLLM's names and shard layout).

Each rank holds a slice of every weight. Column-parallel layers split the output
features, so their outputs stay sharded and feed a row-parallel layer, which splits
the input features and all-reduces its partial sums: one all-reduce per attention
block and one per MLP. Embedding and LM head split the vocabulary.

Every parameter carries `param.weight_loader(param, loaded_weight, shard_id=None)`,
which takes the full Hugging Face tensor and copies this rank's slice into `param`,
so the model loader never needs to know how a layer is sharded. Once every weight is loaded, the
loader calls each layer's `process_weights_after_loading` (vLLM's hook), which turns the weight into
the form the layer computes with: quantized (parallel/quantization.py) or packed for oneDNN
(parallel/onednn.py). `loaded_weight` may be a
`LazyWeight` (what the model loader passes): narrowing it reads nothing, and `copy_weight`
reads only the slice it copies.

`tp_rank`/`tp_size` default to the process-group state; tests pass them explicitly to
build every rank's shard in one process.
"""

import torch
import torch.nn.functional as F
from torch import nn

from raylane.parallel import onednn
from raylane.parallel.lazy_weight import LazyWeight, materialize
from raylane.parallel.quantization import (
    add_batch_copy,
    int4_fits,
    quantize_linear_,
    quantized_embedding,
    quantized_linear,
)
from raylane.parallel.state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from raylane.parallel.weight_processing import WeightProcessing


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"cannot split {numerator} evenly into {denominator} tensor-parallel parts")
    return numerator // denominator


def copy_weight(dst: torch.Tensor, src: torch.Tensor | LazyWeight) -> None:
    # copy_ would broadcast a wrongly shaped tensor silently; a bad checkpoint must fail loudly.
    if dst.shape != src.shape:
        raise ValueError(
            f"weight shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(src.shape)}"
        )
    dst.copy_(materialize(src))


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Loader for parameters every rank holds whole (norms, the MoE router)."""
    copy_weight(param.data, loaded_weight)


class LinearBase(nn.Module):
    """A linear layer whose weight is this rank's [output_size, input_size] shard."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        self.input_size, self.output_size = input_size, output_size
        self.lora = None  # its LoRA adapters' slots, when the engine serves adapters (parallel/lora.py)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    # "int8" or "int4" once `raylane.parallel.quantization.quantize_linear_` swapped `weight` for its
    # quantized form.
    quantization: str | None = None
    # The weight in oneDNN's layout once `process_weights_after_loading` packed it (CPU).
    packed_weight: torch.Tensor | None = None
    # Whether `quantization` applies (the MoE router gate stays in the model dtype).
    quantizable = True

    def process_weights_after_loading(self, processing: WeightProcessing) -> None:
        method = processing.quantization if self.quantizable else None
        quantize_or_pack(self, processing, method, pack=True)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias) with this rank's shard, in whatever form the weight is stored."""
        if self.packed_weight is not None:
            return onednn.linear(x, self.packed_weight, bias)
        if self.quantization is None:
            return onednn.dense_linear(x, self.weight, bias)
        y = quantized_linear(self, x)
        return y + bias if bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (e.g. the MoE router gate)."""

    quantizable = False

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_rank=0, tp_size=1)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by columns (output features); each rank returns its slice of Y."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        tp_size = get_tp_size() if tp_size is None else tp_size
        super().__init__(input_size, divide(output_size, tp_size), bias, tp_rank, tp_size)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        copy_weight(param.data, loaded_weight.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_to(y, x)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_proj and up_proj).

    Each rank's weight is [gate shard; up shard], so `chunk(2)` of the output splits it.
    shard_id is the index into `output_sizes`; None loads an already fused checkpoint tensor.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank=tp_rank, tp_size=tp_size)
        self.weight.shard_ids = tuple(range(len(output_sizes)))
        if self.bias is not None:
            self.bias.shard_ids = self.weight.shard_ids

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None):
        if shard_id is None:
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        copy_weight(param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank gets whole heads.

    Query heads are split evenly. KV heads are split too, but when ranks outnumber
    them each KV head is replicated on `tp_size // total_num_kv_heads` consecutive
    ranks, which then all hold the one KV head their query heads attend to.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        tp_size = get_tp_size() if tp_size is None else tp_size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias, tp_rank=tp_rank, tp_size=tp_size)
        kv_total = total_num_kv_heads * head_size
        self.total_sizes = [total_num_heads * head_size, kv_total, kv_total]
        self.weight.shard_ids = ("q", "k", "v")
        if self.bias is not None:
            self.bias.shard_ids = self.weight.shard_ids

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None):
        if shard_id is None:
            for sid, part in zip("qkv", loaded_weight.split(self.total_sizes, dim=0), strict=True):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, rank = self.kv_size, self.tp_rank // self.num_kv_head_replicas
        copy_weight(param.data.narrow(0, offset, size), loaded_weight.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Y = X A with A split by rows (input features); partial sums are all-reduced.

    The input is the column-parallel layer's sharded output. The bias is added once,
    after the all-reduce, so it is not counted tp_size times.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        tp_size = get_tp_size() if tp_size is None else tp_size
        super().__init__(divide(input_size, tp_size), output_size, bias, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: every rank keeps it whole
            copy_weight(param.data, loaded_weight)
            return
        size = param.shape[1]
        copy_weight(param.data, loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.lora is not None:  # this rank's part of the update: the all-reduce sums the parts
            self.lora.add_to(y, x)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rank r owns rows [start, end).

    The vocabulary is padded up to a multiple of tp_size so every shard has the same
    shape (all-gather needs it); padding rows stay zero. A rank embeds only its ids,
    writes zeros for the rest, and the all-reduce fills in every row.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        n = self.vocab_end - self.vocab_start
        copy_weight(param.data[:n], loaded_weight.narrow(0, self.vocab_start, n))

    quantization: str | None = None  # see LinearBase
    packed_weight: torch.Tensor | None = None  # see LinearBase; only the LM head's is packed

    def process_weights_after_loading(self, processing: WeightProcessing) -> None:
        # The embedding looks rows up: only the LM head multiplies, so only it is packed.
        quantize_or_pack(self, processing, processing.vocab_method(), pack=isinstance(self, ParallelLMHead))

    def embed(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.quantization is None:
            return F.embedding(local_ids, self.weight)
        return quantized_embedding(self, local_ids)

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return onednn.linear(hidden, self.packed_weight)
        if self.quantization is None:
            return onednn.dense_linear(hidden, self.weight)
        return quantized_linear(self, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.embed(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = self.embed((input_ids - self.vocab_start) * mine)
        y = y * mine.unsqueeze(-1).to(y.dtype)
        return tensor_model_parallel_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; logits are gathered to the full vocab.

    Sharing the embedding's layout lets tied checkpoints reuse the same parameter.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tensor_model_parallel_all_gather(self.matmul(hidden), dim=-1)
        return logits[..., : self.num_embeddings]


def quantize_or_pack(layer: nn.Module, processing: WeightProcessing, method: str | None, pack: bool) -> None:
    """Quantize `layer.weight` with `method`, or else (fp weight, `pack`) pack it for oneDNN."""
    if method == "int4" and not int4_fits(layer.weight):
        processing.int8_fallbacks.append(tuple(layer.weight.shape))
        method = "int8"
    if method is not None:
        quantize_linear_(layer, processing.shared, method)
        if pack and processing.batch_copy:
            add_batch_copy(layer, processing.shared)
    elif pack and processing.prepack:
        layer.packed_weight = onednn.pack(layer.weight)
        if not processing.keeps_dense(layer.weight):  # a tied LM head leaves the embedding its table
            del layer.weight
