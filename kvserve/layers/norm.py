"""RMSNorm, optionally fused with the residual add before it (the decoder layer's pattern): on CPU
through kvserve's fused kernel, on CUDA through kvserve's Triton kernels (one kernel instead of torch's
casts, add, norm and multiply), elsewhere through torch's fused rms_norm (faster on CPU than the
composite square-mean-rsqrt)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import cuda as cuda_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual). The fused path
        works in place: x and residual are the layer's own intermediates."""
        if residual is None:
            if cuda_kernels.applies(x) and x.dtype == self.weight.dtype and x.dim() in (2, 3) and x.stride(-1) == 1:
                return cuda_kernels.ops().rms_norm(x, self.weight, self.eps)
            return self._norm(x)
        if cpu_kernels.applies(x) and x.dtype == residual.dtype == self.weight.dtype and x.is_contiguous():
            cpu_kernels.ops().fused_add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        if (cuda_kernels.applies(x) and x.dtype == residual.dtype == self.weight.dtype and x.is_contiguous()
                and residual.is_contiguous()):
            cuda_kernels.ops().fused_add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # float32 normalisation, rounded to x's dtype before the weight, as transformers does.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32 and rounded to x's dtype once at the end
    (transformers' Gemma3RMSNorm; Llama's RMSNorm above rounds before the weight). The checkpoint's weight
    is the offset from 1, so a zero weight is the identity scale."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual). On CPU through the
        kernels' one pass (a Gemma 3 layer has six of these norms; through torch each cost ~50 us at batch 1),
        the residual then updated in place as the Llama norm's fused path does."""
        if (cpu_kernels.applies(x) and x.dtype == self.weight.dtype and x.dim() in (2, 3) and x.stride(-1) == 1
                and (residual is None or (residual.dtype == x.dtype and x.is_contiguous()
                                          and residual.is_contiguous()))):
            out = cpu_kernels.ops().gemma_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        return self.forward_torch(x, residual)

    def forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """forward through torch ops alone (the reference, and where the kernel does not apply)."""
        if residual is not None:
            residual = x + residual
            x = residual
        out = F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (1.0 + self.weight.float())
        out = out.to(x.dtype)
        return out if residual is None else (out, residual)
