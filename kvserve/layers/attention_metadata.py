"""What one forward pass tells attention about the batch. Built by the model runner each step.

The KV cache of each layer is a pair of tensors (k_cache, v_cache), each shaped
[num_blocks, block_size, num_kv_heads, head_dim]. A token's flat slot is block_id * block_size + offset.

The batch is a flat list of T new tokens from B sequences, sequence i owning rows
query_start_loc[i]:query_start_loc[i+1] (its "query", q_len_i tokens). Sequence i has
seq_lens[i] tokens of context in total, cached plus new, and its new tokens sit at positions
seq_lens[i] - q_len_i ... seq_lens[i] - 1. block_tables[i, j] is the block holding its tokens
[j * block_size, (j + 1) * block_size); unused entries are 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor     # [B + 1] int64 (CPU copy in query_start_loc_list)
    seq_lens: torch.Tensor            # [B] int64
    block_tables: torch.Tensor        # [B, max_blocks_per_seq] int64
    query_start_loc_list: list[int]   # host copies: attention branches on them without syncing
    seq_lens_list: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def query_len(self, i: int) -> int:
        return self.query_start_loc_list[i + 1] - self.query_start_loc_list[i]
