"""The Triton backend: a block-major KV cache ([num_blocks, block_size, Hkv, D]) and one attention kernel
for every row kind (paged_attention.py), fed by a tile schedule built once per step. Pure-decode steps
with long contexts and too few tiles to fill the GPU split each tile's keys across programs (split-KV), and so
do verification steps (rows of 1 + k tokens). Tree drafts' rows too (their positions copied once a step; such
steps run eager, never in a graph).

The metadata's device tensors are the StepBatch's own (no per-step copies), so a CUDA graph captured over
a StepBatch of persistent buffers reads each replay's values (kvserve/worker/cuda_graphs.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import FP8, AttentionBackend, AttentionMetadata, KVCache, StepBatch, as_bytes
from kvserve.attention.triton.cache_write import write_kv
from kvserve.attention.triton.paged_attention import num_kv_splits, paged_attention, schedule_tiles, tile_rows
from kvserve.layers.attention import PagedAttention
from kvserve.utils.device import to_device


@dataclass
class TritonMetadata(AttentionMetadata):
    # Per tile height (BLOCK_Q, which depends on the layer's GQA group): which sequence and first token.
    tiles: dict[int, tuple[torch.Tensor, torch.Tensor]]
    num_splits: dict[int, int]        # per tile height: split-KV parts (1: none)
    positions: torch.Tensor | None = None  # [T] int64 where tree drafts put tokens off their index (backend.py)


# Steps whose rows are all at most this many tokens (decodes, speculative verification rows) may split their
# keys; prefill chunks never do: their many tiles fill the GPU already, and splitting them was never measured.
SPLIT_MAX_QUERY_LEN = 16


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_tree_drafts = True
    block_n = 64  # keys per inner step of the attention kernel (tests shrink it to split short contexts)

    def __init__(self, *args, num_sms: int | None = None, **kwargs) -> None:
        """num_sms: the GPU's multiprocessors, which split-KV aims to fill (default: the device's; 0 on a
        CPU, where splitting only costs; tests set it to exercise the split path in the interpreter)."""
        super().__init__(*args, **kwargs)
        self._block_q = {layer.layer_idx: tile_rows(layer.num_heads, layer.num_kv_heads)[1] for layer in self.layers}
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                       if self.device.type == "cuda" else 0)
        self.num_sms = num_sms

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.kv_spec
        return (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def build_metadata(self, batch: StepBatch, max_seq_len: int | None = None) -> TritonMetadata:
        """max_seq_len: the longest context the split count must serve (a CUDA graph captured once for every
        later replay passes max_model_len); default: this step's longest."""
        dev = batch.slot_mapping.device
        tiles = {bq: schedule_tiles(batch.query_start_loc_list, bq, dev) for bq in set(self._block_q.values())}
        splits = {bq: 1 for bq in tiles}
        starts = batch.query_start_loc_list
        if max(b - a for a, b in zip(starts, starts[1:])) <= SPLIT_MAX_QUERY_LEN:
            # Decode and verification steps: a tile or two per sequence, the case split-KV is for (unsplit, one
            # sequence of the default model verifying 4 drafts is 2 tiles x 3 KV heads: 6 programs on 132 SMs).
            longest = max_seq_len if max_seq_len is not None else max(batch.seq_lens_list)
            splits = {bq: num_kv_splits(len(seq) * self.kv_spec.num_kv_heads, longest, self.num_sms,
                                        self.block_n)
                      for bq, (seq, _) in tiles.items()}
        positions = None if batch.positions_list is None else to_device(batch.positions_list, dev, torch.int64)
        return TritonMetadata(batch, self, tiles, splits, positions)

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, TritonMetadata)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = (layer.k_scale, layer.v_scale) if k_cache.dtype == FP8 else (1.0, 1.0)
        write_kv(k, v, k_cache, v_cache, meta.batch.slot_mapping, k_scale, v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        block_q = self._block_q[layer.layer_idx]
        tile_seq, tile_start = meta.tiles[block_q]
        paged_attention(q, out, k_cache, v_cache, meta.batch.block_tables, meta.batch.seq_lens,
                        meta.batch.query_start_loc, tile_seq, tile_start, layer.scale, layer.sliding_window,
                        k_scale, v_scale, self.block_n, meta.num_splits[block_q], positions=meta.positions)
        return out.flatten(1)

    def copy_slots(self, kv_caches: list[KVCache], src: list[int], dst: list[int]) -> None:
        src_t, dst_t = to_device(src, self.device, torch.int64), to_device(dst, self.device, torch.int64)
        for cache in (c for pair in kv_caches for c in pair):
            rows = as_bytes(cache).flatten(0, 1)  # slots are rows of [num_blocks * block_size, Hkv, D]
            rows[dst_t] = rows[src_t]
