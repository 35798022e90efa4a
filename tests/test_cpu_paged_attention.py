"""The native paged-attention kernel (kvserve/kernels/cpu) against attention computed in float64 from each
sequence's K/V gathered by hand: scattered block tables, partial blocks at both ends, GQA, sliding
windows, several rows of one sequence (a prefill chunk's causal rows, a verification step's), and rows of
the flat batch that it must leave alone. Every test runs once per ISA variant this CPU can run (the others skip)."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import ISAS
from paged_helpers import native_ops


def reference(q, k_cache, v_cache, tables, row_seq, row_len, scale, window, row_last=None):
    """Each row's attention in float64; row_last[r]: where row r's last key (n - 1) is stored (tree drafts)."""
    Hkv, _, bs, D = k_cache.shape
    G = q.shape[1] // Hkv
    out = []
    for r, (s, n) in enumerate(zip(row_seq, row_len)):
        keys = list(range(n - 1)) + [n - 1 if row_last is None else row_last[r]]
        slots = [tables[s][t // bs] * bs + t % bs for t in keys]
        first = max(0, n - window) if window > 0 else 0
        k = k_cache.double().view(Hkv, -1, D)[:, slots[first:]]           # [Hkv, n', D]
        v = v_cache.double().view(Hkv, -1, D)[:, slots[first:]]
        qr = q[r].double().view(Hkv, G, D)
        p = torch.softmax(qr @ k.transpose(1, 2) * scale, dim=-1)
        out.append((p @ v).reshape(-1, D))
    return torch.stack(out)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn)],
                         ids=["f32", "bf16", "bf16_fp8cache"])
@pytest.mark.parametrize("D,H,Hkv,window", [(64, 9, 3, 0), (64, 9, 3, 2070), (256, 4, 1, 0)])
def test_long_chunk_rows_computed_together_give_each_rows_own_bits(isa, dtype, cache_dtype, D, H, Hkv, window):
    """A long prompt chunk's rows (a run of 32 or more) are taken in groups that share each block of keys where
    2048 keys or more are in view (two rows at a time where both see a whole block), in pairs below that: every
    row must still compute what it computes alone, bit for bit (the engine's outputs must not depend on which rows
    share a step), and match float64 attention. Another sequence's rows sit between two runs of the first; a third
    run starts a prompt, a fourth crosses 2048 keys (and, with the window, rows' first keys differ), and in a fifth
    short rows follow a full group of long ones."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(5)
    bs, NB, prefix, new = 16, 280, 2060, 40
    k_cache = torch.randn(Hkv, NB, bs, D, generator=g).to(cache_dtype or dtype)
    v_cache = torch.randn(Hkv, NB, bs, D, generator=g).to(cache_dtype or dtype)
    perm = torch.randperm(NB, generator=g).tolist()
    tables = [perm[:140], perm[140:]]  # two sequences of up to 2240 tokens, blocks scattered
    row_seq = [0] * new + [1] * 3 + [0] * new + [1] * 37 + [0] * 40 + [1] * 36
    row_len = (list(range(prefix + 1, prefix + new + 1)) + [100, 101, 102] + [prefix + new] * new
               + list(range(1, 38)) + list(range(2031, 2071))
               # lengths that do not rise (a tree's): a full group of 16 long rows, then short rows
               + [100] + list(range(2100, 2116)) + list(range(101, 120)))
    T = len(row_seq)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    tokens = torch.arange(T)
    args = (torch.tensor(row_seq), torch.tensor(row_len), torch.tensor(tables), 0.125, window)
    together = torch.empty_like(q)
    ops.paged_attention_(q, together, k_cache, v_cache, tokens, *args)
    alone = torch.empty_like(q)
    for r in range(T):
        ops.paged_attention_(q, alone, k_cache, v_cache, tokens[r:r + 1], torch.tensor(row_seq[r:r + 1]),
                             torch.tensor(row_len[r:r + 1]), *args[2:])
    assert torch.equal(together, alone)
    expected = reference(q, k_cache, v_cache, tables, row_seq, row_len, 0.125, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn)],
                         ids=["f32", "bf16", "bf16_fp8cache"])
# With one KV head a row alone has fewer items than threads, and is split (attend_split).
@pytest.mark.parametrize("D,H,Hkv,window", [(64, 9, 3, 0), (16, 8, 2, 0), (32, 6, 3, 0), (128, 8, 2, 0),
                                            (64, 9, 3, 50), (256, 4, 1, 0), (128, 8, 1, 0), (16, 4, 1, 0),
                                            (64, 4, 1, 50)])
def test_verification_rows_computed_in_pairs_give_each_rows_own_bits(isa, dtype, cache_dtype, D, H, Hkv, window):
    """A verification step's rows (a run of 3 to 31 rows of one sequence) go two at a time, sharing the keys both
    see: every row must compute what it computes alone, bit for bit, whatever the run's length, with tree
    alternatives stored past their position (row_last), contexts shorter than one chunk of keys, and a window;
    and match float64 attention."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(D + H + window)
    bs, NB = 16, 64
    k_cache = torch.randn(Hkv, NB, bs, D, generator=g).to(cache_dtype or dtype)
    v_cache = torch.randn(Hkv, NB, bs, D, generator=g).to(cache_dtype or dtype)
    perm = torch.randperm(NB, generator=g).tolist()
    tables = [perm[:20], perm[20:40], perm[40:60]]  # three sequences of up to 320 tokens, blocks scattered
    # Runs of 3, 4, 2 (not paired), 5 and 9 rows at contexts from 10 to 300, one with alternatives: a chain of
    # three at 201..203, then two alternatives to its first token at position 201, stored at 204 and 205.
    runs = [(0, 298, 3), (1, 40, 4), (2, 100, 2), (0, 12, 5), (1, 150, 9)]
    row_seq, row_len, row_last = [], [], []
    for s, start, n in runs:
        row_seq += [s] * n
        row_len += list(range(start, start + n))
        row_last += list(range(start - 1, start + n - 1))
    row_seq += [2] * 5
    row_len += [201, 202, 203, 202, 202]
    row_last += [200, 201, 202, 204, 205]
    T = len(row_seq)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    tokens = torch.arange(T)
    args = (torch.tensor(row_seq), torch.tensor(row_len), torch.tensor(tables), 0.125, window, 1.0, 1.0,
            torch.tensor(row_last))
    together = torch.empty_like(q)
    ops.paged_attention_(q, together, k_cache, v_cache, tokens, *args)
    alone = torch.empty_like(q)
    for r in range(T):
        ops.paged_attention_(q, alone, k_cache, v_cache, tokens[r:r + 1], torch.tensor(row_seq[r:r + 1]),
                             torch.tensor(row_len[r:r + 1]), *args[2:7], torch.tensor(row_last[r:r + 1]))
    assert torch.equal(together, alone)
    expected = reference(q, k_cache, v_cache, tables, row_seq, row_len, 0.125, window, row_last)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float32, torch.float8_e4m3fn),
                                               (torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["f32", "bf16", "f32_fp8cache", "bf16_fp8cache", "f32_bf16cache", "bf16_f32cache"])
@pytest.mark.parametrize("D,H,Hkv,bs,window", [(64, 9, 3, 16, 0), (128, 8, 1, 16, 0), (16, 4, 2, 4, 0),
                                                (32, 6, 6, 8, 20), (64, 16, 1, 16, 37),
                                                (256, 4, 1, 16, 24),  # Gemma 3 270M's heads, a window
                                                (128, 6, 2, 16, 0), (256, 6, 2, 16, 0)])  # 3 heads a KV head: 2 + 1
@pytest.mark.parametrize("qkv_view", [False, True], ids=["q_contiguous", "q_in_qkv"])
@pytest.mark.parametrize("spread", [2, 1], ids=["rows_apart", "rows_adjacent"])
def test_kernel_matches_float64_reference(isa, dtype, cache_dtype, D, H, Hkv, bs, window, qkv_view, spread) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(D * H + bs)
    lens = [1, bs, bs + 1, 3 * bs - 1, 5 * bs, 300, 77, 2]
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered through the pool
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb])
        used += nb
    width = max(map(len, tables))
    k_cache = torch.randn(Hkv, num_blocks, bs, D, generator=g).to(cache_dtype or dtype)
    v_cache = torch.randn(Hkv, num_blocks, bs, D, generator=g).to(cache_dtype or dtype)
    # A float8 cache holds K / k_scale and V / v_scale; the reference reads it at those scales.
    k_scale, v_scale = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    # One decode-like row per sequence, plus the last 40 positions of sequence 5 as causal prefill rows.
    row_seq = list(range(len(lens))) + [5] * 40
    row_len = lens + list(range(lens[5] - 39, lens[5] + 1))
    # rows_apart: the rows sit at odd rows of a batch twice as long. rows_adjacent: at rows 1..R, the
    # prefill rows adjacent tokens as in a real step. The other rows of the batch hold a marker the kernel
    # must keep.
    R = len(row_seq)
    T = spread * R + 1
    q = torch.randn(T, H, D, generator=g).to(dtype)
    if qkv_view:  # as the model passes it: the q columns of a fused [T, (H + 2 Hkv) D] projection
        qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
        qkv[:, :H * D] = q.flatten(1)
        q = qkv[:, :H * D].view(T, H, D)
    out = torch.full((T, H, D), 7.0, dtype=dtype)
    row_token = torch.arange(1, spread * R + 1, spread)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    scale = D ** -0.5
    ops.paged_attention_(q, out, k_cache, v_cache, row_token, torch.tensor(row_seq), torch.tensor(row_len),
                         block_tables, scale, window, k_scale, v_scale)
    want = reference(q[row_token], k_cache.double() * k_scale, v_cache.double() * v_scale, tables, row_seq,
                     row_len, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding (8 bits)
    torch.testing.assert_close(out[row_token].double(), want, atol=tol, rtol=tol)
    kept = torch.ones(T, dtype=torch.bool)
    kept[row_token] = False
    assert torch.all(out[kept] == 7.0)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_refuses_what_it_cannot_do(isa) -> None:
    ops = native_ops(isa)
    q = torch.zeros(1, 4, 48)
    cache = torch.zeros(2, 4, 16, 48)
    zero = torch.zeros(1, dtype=torch.long)
    call = ops.paged_attention_
    with pytest.raises(RuntimeError, match="head_dim"):
        call(q, torch.empty_like(q), cache, cache, zero, zero, zero + 1, zero[None], 1.0, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        call(q.double(), q.double(), cache, cache, zero, zero, zero + 1, zero[None], 1.0, 0)
    # Out-of-range indices are refused before any memory is read.
    q, cache = torch.zeros(2, 4, 16), torch.zeros(2, 4, 16, 16)
    tables = torch.tensor([[1, 2]])
    for token, length, table in ((2, 5, tables), (0, 33, tables), (0, 0, tables), (0, 5, torch.tensor([[1, 4]]))):
        with pytest.raises(RuntimeError, match="out of range|outside"):
            call(q, torch.empty_like(q), cache, cache, torch.tensor([token]), zero, torch.tensor([length]), table, 1.0, 0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
                                    (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float32)],
                         ids=["f32", "f32_to_bf16", "bf16", "f32_to_fp8", "bf16_to_fp8", "bf16_to_f32"])
def test_cache_kv_writes_each_head_of_each_token_at_its_slot(isa, dtypes) -> None:
    ops = native_ops(isa)
    src, cache_dtype = dtypes
    g = torch.Generator().manual_seed(3)
    T, H, Hkv, D, NB, bs = 5, 6, 2, 64, 7, 4
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 300).to(src)  # float8 saturates beyond 448
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)  # strided views, as the model passes them
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    k_cache, v_cache = torch.zeros(Hkv, NB, bs, D, dtype=cache_dtype), torch.zeros(Hkv, NB, bs, D, dtype=cache_dtype)
    slots = torch.randperm(NB * bs, generator=g)[:T]
    fp8 = cache_dtype == torch.float8_e4m3fn
    k_scale, v_scale = (0.5, 4.0) if fp8 else (1.0, 1.0)
    ops.cache_kv_(k, v, k_cache, v_cache, slots, k_scale, v_scale)

    def stored(x: torch.Tensor, scale: float) -> torch.Tensor:  # torch's own rounding, after saturation
        return (x.float() / scale).clamp(-448, 448).to(cache_dtype) if fp8 else x.to(cache_dtype)

    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        want_k[:, slot // bs, slot % bs] = stored(k[t], k_scale)
        want_v[:, slot // bs, slot % bs] = stored(v[t], v_scale)
    # Compared as bytes: float8 tensors have no equality op on the CPU.
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.cache_kv_(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, NB * bs]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn)],
                         ids=["f32", "bf16", "bf16_fp8cache"])
def test_tree_rows_read_their_last_key_where_it_is_stored(isa, dtype, cache_dtype) -> None:
    """Tree drafts: alternatives to a first draft token sit at its position and are stored past it (row_last).
    Each row sees the keys below its position and its own key, wherever that is stored; and it computes bit for
    bit what the same row computes once that key has been moved into place (what the engine does when it
    keeps one), the same keys read in the same order."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(11)
    Hkv, H, D, bs, NB = 3, 9, 64, 4, 12
    tables = [[7, 2, 9, 4, 11]]  # one sequence of up to 20 tokens, blocks scattered
    k_cache = torch.randn(Hkv, NB, bs, D, generator=g).to(cache_dtype or dtype)
    v_cache = torch.randn(Hkv, NB, bs, D, generator=g).to(cache_dtype or dtype)
    # The last real token at index 9, drafts at 10 (the chain's first) and alternatives at 11, 12, 13, all at
    # position 10; a window of 0 and one that cuts into the context.
    row_len = torch.tensor([10, 11, 11, 11, 11])
    row_last = torch.tensor([9, 10, 11, 12, 13])
    q = torch.randn(5, H, D, generator=g).to(dtype)
    tokens, seqs = torch.arange(5), torch.zeros(5, dtype=torch.long)
    block_tables = torch.tensor(tables)
    for window in (0, 6):
        out = torch.empty_like(q)
        ops.paged_attention_(q, out, k_cache, v_cache, tokens, seqs, row_len, block_tables, 0.125, window,
                             1.0, 1.0, row_last)
        expected = reference(q, k_cache, v_cache, tables, seqs.tolist(), row_len.tolist(), 0.125, window,
                             row_last.tolist())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
        # The last alternative (row 4, stored at 13) moved to index 10, then read in place: the same bits.
        moved_k, moved_v = k_cache.clone(), v_cache.clone()
        slot = [tables[0][i // bs] * bs + i % bs for i in (13, 10)]
        ops.copy_slots_([moved_k], [moved_v], slot[:1], slot[1:])
        in_place = torch.empty_like(q)
        ops.paged_attention_(q, in_place, moved_k, moved_v, tokens, seqs, row_len, block_tables, 0.125, window)
        assert torch.equal(in_place[4], out[4])
    with pytest.raises(RuntimeError, match="stores its last key"):
        ops.paged_attention_(q, out, k_cache, v_cache, tokens, seqs, row_len, block_tables, 0.125, 0, 1.0, 1.0,
                             torch.tensor([9, 10, 9, 12, 13]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["f32", "bf16", "fp8"])
def test_copy_slots_moves_every_layers_k_and_v(isa, cache_dtype) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(5)
    Hkv, NB, bs, D, layers = 2, 6, 4, 32, 3
    caches = [torch.randn(Hkv, NB, bs, D, generator=g).to(cache_dtype) for _ in range(2 * layers)]
    before = [c.clone() for c in caches]
    src, dst = [13, 22], [9, 3]
    ops.copy_slots_(caches[:layers], caches[layers:], src, dst)
    for c, b in zip(caches, before):
        want = b.view(Hkv, -1, D).clone()
        want[:, dst] = b.view(Hkv, -1, D)[:, src]
        assert torch.equal(c.view(torch.uint8), want.view(Hkv, NB, bs, D).view(torch.uint8))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.copy_slots_(caches[:layers], caches[layers:], [NB * bs], [0])
