"""SiLU(gate) * up (Llama, Qwen) and GELU-tanh(gate) * up (Gemma) over a fused [.., 2 * intermediate]
gate/up projection output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import cuda as cuda_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.applies(x) and x.is_contiguous():
            return cpu_kernels.ops().silu_and_mul(x)
        if cuda_kernels.applies(x) and x.is_contiguous():
            return cuda_kernels.ops().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation of GELU (transformers' gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
