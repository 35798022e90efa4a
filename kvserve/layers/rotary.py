"""Rotary position embedding in the Hugging Face "rotate half" layout (first half of each head's
dims pairs with the second half), with the default and Llama-3 (`rope_type: llama3`) frequencies."""
from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import cuda as cuda_kernels


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None, device: torch.device | None = None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not rope_scaling:
        return inv_freq.float()
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / rope_scaling["factor"]).float()
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling).float()
    if rope_type == "freq_factors":  # GGUF rope_freqs: the per-frequency divisors llama3 scaling amounts to
        factors = torch.tensor(rope_scaling["factors"], dtype=torch.float64, device=device)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, expected {inv_freq.numel()}")
        return (inv_freq / factors).float()
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3, "
                     "freq_factors)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated.
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] at the given positions [T]."""

    def __init__(self, head_dim: int, max_position: int, theta: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.rope_scaling = rope_scaling
        # On the meta device (fast model construction) this is a placeholder until reset_table().
        self.register_buffer("cos_sin", self._table(torch.get_default_device()), persistent=False)

    def _table(self, device: torch.device) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.rope_scaling, device)
        t = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)                      # [P, D/2]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D], float32

    def reset_table(self, device: torch.device) -> None:
        """Recompute the float32 table on `device` (after building on meta, or a dtype cast of the model)."""
        self.cos_sin = self._table(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k in place (both are fresh projections) and returns them."""
        self.rotate_(positions, q)
        self.rotate_(positions, k)
        return q, k

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """In place on x [T, heads, D] (heads contiguous; tokens may be strided, as in a view of a fused
        projection, so q and k side by side go in one call)."""
        if cpu_kernels.applies(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            cpu_kernels.ops().rotary_(x, positions, self.cos_sin)
            return
        if cuda_kernels.applies(x) and x.stride(2) == 1:
            cuda_kernels.ops().rotary_(x, positions, self.cos_sin)
            return
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        x.copy_(_apply(x, cos, sin))


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
