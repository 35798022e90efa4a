"""Paged attention over block tables for every kind of row at once: decodes, prefill and extend chunks
(a chunk attends to its cached prefix and causally within itself), speculative rows of 1 + k tokens.

One program takes a tile of up to BLOCK_Q consecutive query tokens of one sequence times the G query heads
that share one KV head (GQA: K/V are loaded once for all G), and walks that sequence's keys in tiles of
BLOCK_N with an online softmax in float32. The key range is cut to what the tile can see: up to its last
token's position, and from its first token's window start on sliding-window layers.

The cache is block-major, [num_blocks, block_size, Hkv, D]: a key tile of one head is BLOCK_N rows of D
contiguous elements, each row a coalesced load. The schedule (which sequence and first token each tile
has) comes from the metadata builder, so the kernel does no searching; a tile with sequence -1 is padding.

Tree drafts (speculative decoding's alternatives to the first draft token, kvserve/attention/backend.py): with
TREE, each query token's position comes from `positions` instead of its index, and it sees the keys below its
position and its own key (at its index); the window then starts from the tile's lowest position.

Split-KV (flash-decoding): a decode batch has few tiles, too few programs to fill a GPU's SMs while each
walks a long context alone. With num_splits > 1 a third grid axis cuts every tile's key range into that
many BLOCK_N-aligned parts; each program writes its part's normalised output and log-sum-exp in float32,
and a second kernel merges the parts per row. The split count is a launch constant, not derived from the
data, so a captured CUDA graph keeps its grid; parts past a short sequence's end are empty (lse -inf).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.utils.device import to_device


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_seq_ptr, tile_start_ptr, positions_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,  # the caches' strides: block, token in block, head (dim: 1)
    stride_bt,
    scale, k_scale, v_scale, window,   # window 0: none
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, TREE: tl.constexpr,
    DOT_F32: tl.constexpr, NUM_SPLITS: tl.constexpr,
    part_out_ptr, part_lse_ptr,       # NUM_SPLITS > 1: [T, H, NUM_SPLITS, D] and [T, H, NUM_SPLITS] float32
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    real = seq >= 0
    seq = tl.maximum(seq, 0)
    first = tl.load(tile_start_ptr + tile)                                   # flat row of the tile's first token
    q_end = tl.where(real, tl.load(query_start_loc_ptr + seq + 1), first)    # padding: no rows
    seq_len = tl.load(seq_lens_ptr + seq)

    m = tl.arange(0, BLOCK_M)
    token = first + m // G_PAD
    g = m % G_PAD
    head = kv_head * G + g
    row_ok = (token < q_end) & (g < G)
    idx = seq_len - (q_end - token)                                          # where each query token's key is
    if TREE:
        pos = tl.load(positions_ptr + token, mask=row_ok, other=0)              # int64, as idx
        lowest = tl.min(tl.where(row_ok, pos, seq_len), 0)                   # a tile may begin at an alternative
    else:
        pos = idx                                                            # each query token's position
        lowest = seq_len - (q_end - first)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    last = tl.minimum(first + BLOCK_Q, q_end) - 1
    hi = seq_len - (q_end - last) + 1                                        # keys [0, hi) at most
    # One expression, not `lo = 0` then an `if`: the compiler wants one type on both branches (int64 here, from
    # seq_len), which Triton's interpreter does not check.
    lo = tl.where(window > 0, tl.maximum(lowest - window + 1, 0), 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:  # this program's part of [lo, hi): equal BLOCK_N-aligned parts, the last ones may be empty
        split = tl.program_id(2)
        part = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * part
        hi = tl.minimum(hi, lo + part)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # the cache holds x / scale
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale          # [BLOCK_M, BLOCK_N]
        if TREE:
            visible = ((n[None, :] < pos[:, None]) | (n[None, :] == idx[:, None])) & n_ok[None, :]
        else:
            visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        if window > 0:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)               # a row that has seen no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS > 1:
        row = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, tile_seq_ptr, tile_start_ptr, query_start_loc_ptr,
    stride_ot, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Per row of a tile: the parts' outputs weighted by exp(lse_part - lse_max), over their sum."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    real = seq >= 0
    first = tl.load(tile_start_ptr + tile)
    q_end = tl.where(real, tl.load(query_start_loc_ptr + tl.maximum(seq, 0) + 1), first)
    m = tl.arange(0, BLOCK_M)
    token = first + m // G_PAD
    g = m % G_PAD
    head = kv_head * G + g
    row_ok = (token < q_end) & (g < G)
    d = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    base = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS

    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf")))
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)   # a row no part saw (not a real row)
    total = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp(tl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf")) - lse_max)
        o = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        acc += w[:, None] * o
        total += w
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def tile_rows(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(G_PAD, BLOCK_Q): a tile holds BLOCK_Q tokens times G_PAD heads, at least 16 rows (tl.dot's minimum)."""
    g_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return g_pad, max(1, 16 // g_pad)


def paged_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    tile_seq: torch.Tensor, tile_start: torch.Tensor, scale: float, window: int | None,
                    k_scale: float = 1.0, v_scale: float = 1.0, block_n: int = 64, num_splits: int = 1,
                    positions: torch.Tensor | None = None) -> None:
    """q, out: [T, H, D] (any token and head stride, dim contiguous); caches [NB, bs, Hkv, D];
    tile_seq / tile_start: the schedule from schedule_tiles for this layer's (G_PAD, BLOCK_Q);
    num_splits > 1: split-KV, each tile's keys in that many parts merged by a second kernel;
    positions: [T] int64, each token's position where tree drafts make some differ from its index (None: none)."""
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    g_pad, block_q = tile_rows(H, Hkv)
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return
    d_pad = triton.next_power_of_2(D)
    if num_splits > 1:
        part_out = torch.empty((T, H, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
    else:  # never read: the kernel's NUM_SPLITS == 1 branch stores straight into out
        part_out = part_lse = out
    _paged_attention_kernel[(num_tiles, Hkv, num_splits)](
        q, out, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_start,
        positions if positions is not None else seq_lens,  # never read without TREE
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale, k_scale, v_scale, window or 0,
        G=H // Hkv, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_q * g_pad, BLOCK_N=block_n, NUM_HEADS=H,
        HEAD_DIM=D, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1], KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        TREE=positions is not None,
        # Triton's interpreter (on the CPU) multiplies bfloat16 as raw integers: there the dots run in float32
        # on the same bfloat16-rounded inputs, which only spares the rounding of p.
        DOT_F32=q.device.type == "cpu", NUM_SPLITS=num_splits, part_out_ptr=part_out, part_lse_ptr=part_lse,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tiles, Hkv)](
            out, part_out, part_lse, tile_seq, tile_start, query_start_loc, out.stride(0), out.stride(1),
            G=H // Hkv, G_PAD=g_pad, BLOCK_M=block_q * g_pad, NUM_HEADS=H, HEAD_DIM=D, D_PAD=d_pad,
            NUM_SPLITS=num_splits,
        )


def num_kv_splits(num_programs: int, max_seq_len: int, num_sms: int, block_n: int = 64,
                  max_splits: int = 16, min_keys_per_split: int = 128) -> int:
    """How many parts to cut each tile's keys into (a power of two): enough that the programs
    (tiles x KV heads x parts) fill about two waves of the GPU's SMs, while every part keeps at least
    min_keys_per_split keys, two key tiles (below that the merge costs more than the parallelism gives).
    1: no split. (On an H200, one sequence at 1024 tokens and 8 KV heads ran 16 programs at 12 us a layer.)"""
    splits = 1
    while (splits < max_splits and num_programs * splits < 2 * num_sms
           and max_seq_len >= 2 * splits * max(min_keys_per_split, block_n)):
        splits *= 2
    return splits


def schedule_tiles(query_start_loc: list[int], block_q: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's query tokens cut into tiles of block_q: (tile_seq, tile_start) as int32 tensors."""
    seqs, starts = [], []
    for i in range(len(query_start_loc) - 1):
        for s in range(query_start_loc[i], query_start_loc[i + 1], block_q):
            seqs.append(i)
            starts.append(s)
    return to_device(seqs, device, torch.int32), to_device(starts, device, torch.int32)
