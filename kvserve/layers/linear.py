"""Linear layers re-laid for the CPU's bf16 GEMM.

torch's dense bf16 `F.linear` on CPU re-packs the weight into oneDNN's blocked layout inside every call.
Packing once at load time and calling oneDNN's linear on the packed weight (the op torch's own compiler
uses for frozen CPU models) measured 1.1-2x faster per GEMM on this 2-core AVX-512 machine: most at one
row (decode at batch 1), ~10-15% at 64 rows (benchmarks/results/linear_packing.md). Same arithmetic:
float32 accumulation, one rounding to bf16.
"""
from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """Inference-only stand-in for an nn.Linear whose weight has been packed for oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The weight stays a parameter (the engine sizes memory from parameters), in oneDNN's layout.
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 CPU nn.Linear in `model` for a PackedLinear; returns how many were swapped.
    A weight tied to another module (an LM head sharing the embedding) gets its own packed copy."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
