"""The attention-backend interface: a KV cache layout, a metadata builder the runner calls once per step,
and the attention itself, called by every attention layer with its new tokens' q, k, v.

The runner describes each step as a StepBatch (plain tensors and their host copies); the backend turns it
into its own AttentionMetadata once, before the forward pass, doing all per-step index work there so the
layers only launch kernels. Model code never sees which backend runs: it calls PagedAttention(q, k, v)
(kvserve/layers/attention.py), which finds the step's metadata and its layer's cache in the forward context.

The batch is a flat list of T new tokens from B sequences, sequence i owning rows
query_start_loc[i]:query_start_loc[i+1] (its "query", q_len_i tokens). Sequence i has seq_lens[i] tokens
of context in total, cached plus new, and its new tokens sit at positions seq_lens[i] - q_len_i ...
seq_lens[i] - 1. block_tables[i, j] is the block holding its tokens [j * block_size, (j + 1) * block_size);
unused entries are 0. A token's flat slot is block_id * block_size + offset; slot -1 means "write nothing"
(padding rows of a captured CUDA graph).

Tree drafts (speculative decoding with alternatives to the first draft token, kvserve/spec_decode) break
"a token sits at its index": the alternatives all sit at the first draft's position, each stored at an
index past the others. A batch with such rows carries `positions`: a token at index i with position p
sees the keys at indices [0, p) and its own at i (p == i for every other token: plain causal attention).
Only backends with supports_tree_drafts take such batches.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.utils.device import to_device

if TYPE_CHECKING:
    from kvserve.attention.torch_plan import AttentionPlan
    from kvserve.layers.attention import PagedAttention
    from kvserve.models.kv_cache import KVCacheSpec

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache) of one layer, in its backend's layout
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """float8 as its bytes (torch's index_copy_ / index_select / indexed assignment have no float8 kernels on the
    CPU); any other dtype as it is."""
    return x.view(torch.uint8) if x.dtype == FP8 else x


@dataclass
class StepBatch:
    """What the runner knows about a step's attention, built from the scheduler's plan."""
    slot_mapping: torch.Tensor        # [T] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor     # [B + 1] int64
    seq_lens: torch.Tensor            # [B] int64
    block_tables: torch.Tensor        # [B, max_blocks_per_seq] int64
    query_start_loc_list: list[int]   # host copies: backends plan on them without syncing
    seq_lens_list: list[int]
    block_size: int
    # [T] host list: each token's position, where a tree draft's makes one differ from its index; else None
    positions_list: list[int] | None = None
    # [B] host list: the draft tokens ending each sequence's query (speculative verification); None: no drafts
    num_drafts_list: list[int] | None = None

    @classmethod
    def from_host(cls, block_tables: list[list[int]], slot_mapping: list[int], query_start_loc: list[int],
                  seq_lens: list[int], block_size: int, device: torch.device,
                  positions: list[int] | None = None, num_drafts: list[int] | None = None) -> StepBatch:
        """The step's tensors on `device` from host lists; block tables zero-padded to the longest.
        positions: only where tree drafts put some token elsewhere than its index; num_drafts: only where some
        sequence verifies drafts."""
        width = max(map(len, block_tables))
        padded = [table + [0] * (width - len(table)) if len(table) < width else table for table in block_tables]
        i64 = lambda x: to_device(x, device, torch.int64)  # noqa: E731
        return cls(i64(slot_mapping), i64(query_start_loc), i64(seq_lens), i64(padded), query_start_loc,
                   seq_lens, block_size, positions, num_drafts)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]

    def query_len(self, i: int) -> int:
        return self.query_start_loc_list[i + 1] - self.query_start_loc_list[i]

    def verifies(self, i: int) -> bool:
        """Whether sequence i's query is a decode token and its drafts."""
        return self.num_drafts_list is not None and self.num_drafts_list[i] > 0

    @property
    def max_query_len(self) -> int:
        return max(self.query_len(i) for i in range(self.num_seqs))


@dataclass
class AttentionMetadata:
    """A backend's per-step state. Subclasses add what their forward needs; `backend` runs it."""
    batch: StepBatch
    backend: AttentionBackend

    @property
    def query_start_loc_list(self) -> list[int]:
        return self.batch.query_start_loc_list


class AttentionBackend(ABC):
    """Built once per model and KV pool, for the attention layers it will serve."""
    name: str
    supports_tree_drafts = False  # takes StepBatch.positions_list and copy_slots (tree drafts)

    def __init__(self, layers: list[PagedAttention], kv_spec: KVCacheSpec, num_blocks: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.layers = layers
        self.kv_spec = kv_spec
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype  # the compute dtype of q, k, v and of attention's output

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's k_cache (and of its v_cache)."""

    def allocate_kv_caches(self) -> list[KVCache]:
        shape = self.kv_cache_shape(self.num_blocks)
        dtype, dev = self.kv_spec.dtype, self.device
        return [(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
                for _ in range(self.kv_spec.num_layers)]

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> AttentionMetadata:
        """Once per step, before the forward pass: everything the layers' forward calls share."""

    @abstractmethod
    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) at the batch's slots, then attend q ([T, H, D], any token stride)
        over each sequence's cached context: [T, H * D] in q's dtype."""

    def copy_slots(self, kv_caches: list[KVCache], src: list[int], dst: list[int]) -> None:
        """Every layer's K/V at slots src to slots dst (an accepted tree draft's alternative, stored past its
        siblings, moves to its position)."""
        raise NotImplementedError(f"the {self.name} attention backend takes no tree drafts")

    def rows_alike(self) -> bool:
        """Whether every layer computes a decode or verification row's attention the same whatever else its step
        carries (so that speculation and batching leave its bits alone); False unless a backend knows."""
        return False

    def kernel_only_plan(self, meta: AttentionMetadata) -> AttentionPlan | None:
        """The step's native-kernel plan when a native decoder stack (kvserve/models/native_stack.py) may
        run every layer's attention itself; None (the default): the layers call forward."""
        return None
