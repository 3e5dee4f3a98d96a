"""A checkpoint tensor that is read only where a weight loader narrows it.

The model loader hands each parameter's `weight_loader` a `LazyWeight` over safetensors'
`get_slice` instead of a whole tensor. `narrow` and `split` only record a region, as they
would make a view of a tensor; `copy_weight` reads the region when it copies it into the
parameter. So the layers keep deciding what their rank needs, and a rank never reads, or
holds in memory, more of the checkpoint than its own shard.
"""

from collections.abc import Sequence

import torch


class LazyWeight:
    """A region of a sliceable source: anything with `get_shape()` and `source[slices]`."""

    __slots__ = ("_source", "_region")

    def __init__(self, source, region: tuple[slice, ...] | None = None):
        self._source = source
        self._region = region if region is not None else tuple(slice(0, n) for n in source.get_shape())

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._region)

    def dim(self) -> int:
        return len(self._region)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> "LazyWeight":
        dim %= self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        region = list(self._region)
        base = region[dim].start + start
        region[dim] = slice(base, base + length)
        return LazyWeight(self._source, tuple(region))

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple["LazyWeight", ...]:
        """Like `torch.Tensor.split`: equal chunks of `split_size`, or the given sizes."""
        total = self.shape[dim % self.dim()]
        if isinstance(split_size, int):
            sizes = [min(split_size, total - start) for start in range(0, total, split_size)]
        else:
            sizes = list(split_size)
            if sum(sizes) != total:
                raise ValueError(f"split sizes {sizes} do not add up to {total}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, s, n) for s, n in zip(starts, sizes, strict=True))

    def load(self) -> torch.Tensor:
        """Read the region (only its bytes) as a tensor."""
        return self._source[self._region]

    def __repr__(self) -> str:
        return f"LazyWeight(shape={tuple(self.shape)}, region={self._region})"


def materialize(weight: "torch.Tensor | LazyWeight") -> torch.Tensor:
    return weight.load() if isinstance(weight, LazyWeight) else weight
