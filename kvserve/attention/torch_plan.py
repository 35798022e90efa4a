"""The torch backend's per-step plan: index tensors for the native kernel's rows, decode groups and
prefill masks, built once per step for each kind of layer (sliding window, kernel or not) by
TorchPagedBackend.build_metadata and shared by every layer of that kind.

The cache is head-major, [num_kv_heads, num_blocks, block_size, head_dim]: gathering one sequence's blocks
for one head yields rows that batched matmuls read in place (see torch_backend.py). A token's flat slot is
block_id * block_size + offset, the same in every head. The batch's conventions: kvserve/attention/backend.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.attention.backend import StepBatch
from kvserve.kernels import cpu as cpu_kernels


# Decode rows are gathered padded to the longest context of their group. One group per step pads short
# sequences up to the longest one; splitting the rows (sorted by length) into groups trades that padding
# against a fixed cost per group (a handful of ops per layer), expressed here in gathered blocks per row.
_GROUP_COST_BLOCKS = 64
_GROUP_STRIDE = 4  # candidate group boundaries every this many rows, which keeps the split's search tiny
# Prefills with more context than this go to SDPA even where the native kernel runs: the kernel re-reads a
# sequence's K/V for each of its rows. Measured per layer (benchmarks/results/prefill_attention_*.md):
# AVX-512 1.34x SDPA's speed at 4k tokens of context, 0.86x at 8k; AVX2 1.13x at 1k, 0.93x at 2k. That was
# against bfloat16 SDPA on the Zen 5; SDPA now computes in float32, 1.5x faster, and on an Intel Xeon a lower
# AVX-512 cut-over prefilled faster (benchmarks/prefill_cutover.py; benchmarks/README.md, session 37): to
# re-measure on both before moving it, since past it a long prompt's output depends on its batch.
_KERNEL_MAX_PREFILL_CONTEXT = {"avx512": 4096, "avx2": 1024}
# Prefill chunks this short stay on the kernel at any context. Verification rows (a decode token and its drafts)
# always do, however many drafts: each position must round as a plain decode's does, or speculation would change
# the output.
_KERNEL_ALWAYS_MAX_QUERY = 16
# Steps of at most this many tokens (speculative verification at a few streams) get their kernel rows from the
# host lists: the dozen small tensor ops of the general path took ~40 us of a ~3 ms step at one stream.
_HOST_ROWS_MAX_TOKENS = 64


def split_by_length(num_blocks: list[int]) -> list[int]:
    """Boundaries that split rows sorted by ascending block count into groups minimising
    sum(group rows * group max blocks) + _GROUP_COST_BLOCKS * groups. Returns the end index of each group."""
    n = len(num_blocks)
    cuts = list(range(_GROUP_STRIDE, n, _GROUP_STRIDE)) + [n]
    best = {0: (0, [])}  # end -> (cost, boundaries)
    for j in cuts:
        best[j] = min((cost + (j - i) * num_blocks[j - 1] + _GROUP_COST_BLOCKS, ends + [j])
                      for i, (cost, ends) in best.items() if i < j)
    return best[n][1]


@dataclass
class DecodeGroup:
    """Decode rows gathered together, padded to the longest of them."""
    token_idx: torch.Tensor           # [B]: their rows in the flat batch
    gather_idx: torch.Tensor          # [Hkv * B * nb]: (head, sequence, block) rows of the cache viewed [Hkv*NB, bs, D]
    bias: torch.Tensor                # [Hkv * B, 1, L] float32: 0 where a key is visible, -inf elsewhere
    max_len: int                      # L = nb * block_size


@dataclass
class KernelRows:
    """Query tokens for the native kernel, which reads K/V in place: each row sees keys [len - window, len)
    of one sequence. A decode token is one row; a prefill chunk is a row per token (len = position + 1)."""
    token: torch.Tensor               # [R]: row in the flat batch
    seq: torch.Tensor                 # [R]: row of block_tables
    len: torch.Tensor                 # [R]
    last: torch.Tensor | None = None  # [R]: where key len - 1 is stored, for tree drafts (None: in place)


@dataclass
class PrefillPlan:
    """One sequence with several new tokens: its cache rows and its causal mask (None: plain is_causal)."""
    row: int
    gather_idx: torch.Tensor          # [Hkv * nb]
    mask: torch.Tensor | None         # [q_len, S] bool


@dataclass
class AttentionPlan:
    # [Hkv * T]: where each head of each new token goes, cache viewed [Hkv*NB*bs, D]; None where the native
    # kernel writes the cache (cache_kv_ reads the slot mapping itself)
    write_idx: torch.Tensor | None
    kernel_rows: KernelRows | None   # query tokens for the native kernel (all but long prefills' ones)
    decode: list[DecodeGroup]        # torch path: sequences with one new token, grouped by context length
    prefills: list[PrefillPlan]      # torch path: sequences with several new tokens


def build_plan(batch: StepBatch, num_kv_heads: int, num_blocks: int, window: int | None, kernel: bool,
               kernel_only: bool = False) -> AttentionPlan:
    """kernel: query tokens go to the native kernel instead of gathered groups and SDPA, except those of
    prefill chunks longer than _KERNEL_ALWAYS_MAX_QUERY with more than _KERNEL_MAX_PREFILL_CONTEXT (for the
    kernels' ISA) tokens of context; kernel_only: those too (batch invariance)."""
    dev = batch.slot_mapping.device
    bs = batch.block_size
    heads = torch.arange(num_kv_heads, device=dev)
    write_idx = None if kernel else (heads[:, None] * (num_blocks * bs) + batch.slot_mapping[None, :]).flatten()

    def cache_rows(tables: torch.Tensor) -> torch.Tensor:
        """[S, nb] block ids -> their (head, sequence, block) rows in the cache viewed [Hkv*NB, bs, D]."""
        return (heads[:, None, None] * num_blocks + tables[None]).flatten()

    starts, lens = batch.query_start_loc_list, batch.seq_lens_list
    kernel_rows, torch_seqs = None, range(batch.num_seqs)
    if kernel:
        # Long prefills stay with SDPA (see _KERNEL_MAX_PREFILL_CONTEXT), but with kernel_only. A handful of rows
        # reads the context once, far cheaper than SDPA's gather of all of it.
        longest = math.inf if kernel_only else _KERNEL_MAX_PREFILL_CONTEXT[cpu_kernels.isa()]
        torch_seqs = [i for i in range(batch.num_seqs)
                      if batch.query_len(i) > _KERNEL_ALWAYS_MAX_QUERY and lens[i] > longest and not batch.verifies(i)]
        kernel_rows = _kernel_rows(batch, torch_seqs)

    decode_rows = sorted((i for i in torch_seqs if batch.query_len(i) == 1), key=lambda i: lens[i])
    decode = []
    if decode_rows:
        row_blocks = [-(-lens[i] // bs) for i in decode_rows]
        begin = 0
        for end in split_by_length(row_blocks):
            rows = decode_rows[begin:end]
            nb = row_blocks[end - 1]
            rows_t = torch.tensor(rows, device=dev)
            seq_lens = batch.seq_lens[rows_t]
            gather_idx = cache_rows(batch.block_tables[rows_t, :nb])
            key_pos = torch.arange(nb * bs, device=dev)[None, :]
            hidden = key_pos >= seq_lens[:, None]
            if window is not None:
                hidden |= key_pos < seq_lens[:, None] - window
            bias = torch.zeros(hidden.shape, device=dev).masked_fill_(hidden, float("-inf"))
            token_idx = torch.tensor([starts[i] for i in rows], device=dev)
            decode.append(DecodeGroup(token_idx, gather_idx, bias.repeat(num_kv_heads, 1)[:, None, :], nb * bs))
            begin = end

    prefills = []
    for i in torch_seqs:
        q_len = batch.query_len(i)
        if q_len == 1:
            continue
        seq_len = lens[i]
        nb = -(-seq_len // bs)
        gather_idx = cache_rows(batch.block_tables[i : i + 1, :nb])
        prefix = seq_len - q_len
        windowed = window is not None and seq_len > window
        tree = batch.positions_list is not None and batch.positions_list[starts[i]:starts[i + 1]] != list(
            range(prefix, seq_len))
        mask = None
        if prefix > 0 or windowed or tree:
            # Query j sits at position prefix + j and sees keys 0 .. prefix + j (is_causal would align
            # the diagonal to the top-left, ignoring the cached prefix).
            q_idx = torch.arange(prefix, seq_len, device=dev)[:, None]
            key_pos = torch.arange(seq_len, device=dev)[None, :]
            mask = key_pos <= q_idx
            if tree:  # keys below its position and its own (backend.py)
                q_pos = torch.tensor(batch.positions_list[starts[i]:starts[i + 1]], device=dev)[:, None]
                mask = (key_pos < q_pos) | (key_pos == q_idx)
            if windowed:
                mask &= key_pos > (q_pos if tree else q_idx) - window
        prefills.append(PrefillPlan(i, gather_idx, mask))
    return AttentionPlan(write_idx, kernel_rows, decode, prefills)


def _kernel_rows_from_host(batch: StepBatch, excluded: list[int]) -> KernelRows | None:
    """_kernel_rows for a step of a few tokens, from the host lists."""
    starts, lens, skip = batch.query_start_loc_list, batch.seq_lens_list, set(excluded)
    token: list[int] = []
    seq: list[int] = []
    row_len: list[int] = []
    for i in range(batch.num_seqs):
        if i in skip:
            continue
        begin, end = starts[i], starts[i + 1]
        token.extend(range(begin, end))
        seq.extend([i] * (end - begin))
        first = lens[i] - (end - begin) + 1  # the sequence's first new token sees its cached context and itself
        row_len.extend(range(first, first + end - begin))
    if not token:
        return None
    dev = batch.slot_mapping.device
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    if batch.positions_list is None:
        return KernelRows(i64(token), i64(seq), i64(row_len))
    positions = batch.positions_list  # tree drafts, as below
    return KernelRows(i64(token), i64(seq), i64([positions[t] + 1 for t in token]), i64([n - 1 for n in row_len]))


def _kernel_rows(batch: StepBatch, excluded: list[int]) -> KernelRows | None:
    """Every query token of the batch except those of the excluded sequences, as kernel rows."""
    dev, T = batch.slot_mapping.device, batch.query_start_loc_list[-1]
    token = torch.arange(T, device=dev)
    if T == batch.num_seqs and not excluded:  # a decode-only step: row i is sequence i's one token
        return KernelRows(token, token, batch.seq_lens)
    if T <= _HOST_ROWS_MAX_TOKENS:
        return _kernel_rows_from_host(batch, excluded)
    seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=dev), batch.query_start_loc.diff(),
                                  output_size=T)
    if excluded:
        keep = torch.ones(batch.num_seqs, dtype=torch.bool, device=dev)
        keep[excluded] = False
        kept = keep[seq]
        token, seq = token[kept], seq[kept]
        if len(token) == 0:
            return None
    # The token at flat row t of sequence i sits at index seq_len_i - (end_i - t) and sees one more key.
    row_len = batch.seq_lens[seq] - (batch.query_start_loc[1:][seq] - token) + 1
    if batch.positions_list is None:
        return KernelRows(token, seq, row_len)
    # Tree drafts: a token sees the keys below its position and its own, stored at its index.
    positions = torch.tensor(batch.positions_list, dtype=torch.int64, device=dev)[token]
    return KernelRows(token, seq, positions + 1, row_len - 1)
