"""Linear layers that own their weight's format and loading.

A layer's weight is the row-wise concatenation of shards [N_i, K] (q/k/v, or gate/up), each loaded from
its own checkpoint tensor by `weight_loader(shard, tensor)`, which checks the shape. The layer's
`method` (kvserve/layers/quantization) decides how the shards are stored (float, GGUF blocks, int8,
int4) and how x @ W^T is computed. Loading a checkpoint is therefore: map each tensor name to
(layer, shard), call the loader, then `finalize` every layer.

Tensor parallelism later: a rank's slice of each shard is taken in `weight_loader` (columns for
QKVLinear / MergedColumnLinear, rows of K for RowLinear), and RowLinear all-reduces its output.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.quantization.methods import FloatMethod, Loaded, LinearMethod


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, method: LinearMethod,
                 shard_names: list[str]) -> None:
        super().__init__()
        assert len(shard_names) == len(output_sizes)
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.method = method
        self.shard_names = shard_names          # checkpoint names, for error messages
        self.bias = nn.Parameter(torch.zeros(sum(output_sizes)), requires_grad=False) if bias else None
        self._shards: list[object | None] | None = [None] * len(output_sizes)
        self._bias_loaded = [False] * len(output_sizes)

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    def weight_loader(self, shard: int, tensor: Loaded) -> None:
        expected = (self.output_sizes[shard], self.input_size)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {self.shard_names[shard]!r} has shape {tuple(tensor.shape)}, expected {expected}")
        assert self._shards is not None, "weights loaded after finalize()"
        try:
            self._shards[shard] = self.method.convert(tensor)
        except ValueError as e:  # a weight format's limit (block widths): say which weight
            raise ValueError(f"weight {self.shard_names[shard]!r}: {e}") from None

    def bias_loader(self, shard: int, tensor: torch.Tensor) -> None:
        if self.bias is None:
            raise ValueError(f"unexpected bias for {self.shard_names[shard]!r}: the layer has none")
        if tuple(tensor.shape) != (self.output_sizes[shard],):
            raise ValueError(f"bias of {self.shard_names[shard]!r} has shape {tuple(tensor.shape)}, "
                             f"expected {(self.output_sizes[shard],)}")
        start = sum(self.output_sizes[:shard])
        self.bias.data[start:start + self.output_sizes[shard]].copy_(tensor)
        self._bias_loaded[shard] = True

    def missing(self) -> list[str]:
        """Checkpoint tensors this layer still needs."""
        names = [n for n, s in zip(self.shard_names, self._shards or []) if s is None]
        if self.bias is not None:
            names += [n.removesuffix(".weight") + ".bias" for n, ok in zip(self.shard_names, self._bias_loaded)
                      if not ok]
        return names

    def finalize(self) -> None:
        """Join the loaded shards into the stored weight (once every shard is in)."""
        assert self._shards is not None and not self.missing()
        self.method.finalize(self, self._shards)
        self._shards = None

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T (+ bias) in x's dtype, or out_dtype (an LM head's float32 logits: a method that sums in
        float32 then rounds once, not to x's bfloat16 first)."""
        y = self.method.apply(self, x, out_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={type(self.method).__name__}"


class QKVLinear(LinearBase):
    """q, k and v projections in one matmul: output [q_size | kv_size | kv_size]."""

    def __init__(self, hidden: int, q_size: int, kv_size: int, bias: bool, method: LinearMethod, prefix: str) -> None:
        super().__init__(hidden, [q_size, kv_size, kv_size], bias, method,
                         [f"{prefix}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")])


class MergedColumnLinear(LinearBase):
    """Several projections of one input side by side (an MLP's gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], method: LinearMethod, names: list[str]) -> None:
        super().__init__(input_size, output_sizes, False, method, names)


class RowLinear(LinearBase):
    """A projection back to the residual stream (o_proj, down_proj): under tensor parallelism each rank
    holds a slice of K and the outputs are summed."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method: LinearMethod, name: str) -> None:
        super().__init__(input_size, [output_size], bias, method, [name])


class ColumnLinear(LinearBase):
    """One projection whose output is split across ranks under tensor parallelism (the LM head)."""

    def __init__(self, input_size: int, output_size: int, method: LinearMethod, name: str) -> None:
        super().__init__(input_size, [output_size], False, method, [name])


class VocabEmbedding(ColumnLinear):
    """Token embedding [vocab, hidden] in any weight format; as a linear layer it is a tied LM head."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.embedding(self, ids)


def pack_float_weights(model: nn.Module) -> int:
    """Re-lay float bf16 weights for AMX or oneDNN (see FloatMethod); after tying. Returns how many were packed."""
    packed = 0
    for m in model.modules():
        if isinstance(m, LinearBase) and isinstance(m.method, FloatMethod):
            m.method.pack(m)
            packed += m.packed_weight is not None or m.amx_weight is not None
    return packed
