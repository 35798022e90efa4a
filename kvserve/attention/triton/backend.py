"""The Triton backend: a block-major KV cache ([num_blocks, block_size, Hkv, D]) and one attention kernel
for every row kind (paged_attention.py), fed by a tile schedule built once per step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import FP8, AttentionBackend, AttentionMetadata, KVCache, StepBatch
from kvserve.attention.triton.cache_write import write_kv
from kvserve.attention.triton.paged_attention import paged_attention, schedule_tiles, tile_rows
from kvserve.layers.attention import PagedAttention


@dataclass
class TritonMetadata(AttentionMetadata):
    # Per tile height (BLOCK_Q, which depends on the layer's GQA group): which sequence and first token.
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]]
    seq_lens: torch.Tensor            # [B] int32
    query_start_loc: torch.Tensor     # [B + 1] int32


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._block_q = {layer.layer_idx: tile_rows(layer.num_heads, layer.num_kv_heads)[1] for layer in self.layers}

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.kv_spec
        return (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def build_metadata(self, batch: StepBatch) -> TritonMetadata:
        dev = batch.slot_mapping.device
        tiles = {bq: schedule_tiles(batch.query_start_loc_list, bq, dev) for bq in set(self._block_q.values())}
        return TritonMetadata(batch, self, tiles, batch.seq_lens.to(torch.int32),
                              batch.query_start_loc.to(torch.int32))

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, TritonMetadata)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = (layer.k_scale, layer.v_scale) if k_cache.dtype == FP8 else (1.0, 1.0)
        write_kv(k, v, k_cache, v_cache, meta.batch.slot_mapping, k_scale, v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tile_seq, tile_start = meta.tiles[self._block_q[layer.layer_idx]]
        paged_attention(q, out, k_cache, v_cache, meta.batch.block_tables, meta.seq_lens, meta.query_start_loc,
                        tile_seq, tile_start, layer.scale, layer.sliding_window, k_scale, v_scale)
        return out.flatten(1)
