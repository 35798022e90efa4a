"""KV cache geometry, so the engine can size its block pool before allocating it. The layout of the
tensors is the attention backend's (kvserve/attention/)."""
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

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def kv_cache_spec(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)

