"""KV cache geometry, so the engine can size its block pool before allocating it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer's k_cache (and of its v_cache): head-major, see layers/attention_metadata.py."""
        return (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def kv_cache_spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = spec.block_shape(num_blocks)
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]
