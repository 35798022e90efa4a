"""The native paged-decode kernel (kvserve/kernels/cpu) against attention computed in float64 from each
sequence's K/V gathered by hand: scattered block tables, partial last blocks, GQA, sliding windows, and
decode rows interleaved with other rows of the flat batch that it must leave alone."""
from __future__ import annotations

import pytest
import torch

from paged_helpers import require_native_kernel


def reference(q, k_cache, v_cache, tables, lens, scale, window):
    Hkv, _, bs, D = k_cache.shape
    G = q.shape[1] // Hkv
    out = []
    for b, n in enumerate(lens):
        slots = [tables[b][t // bs] * bs + t % bs for t in range(n)]
        first = max(0, n - window) if window > 0 else 0
        k = k_cache.double().view(Hkv, -1, D)[:, slots[first:]]           # [Hkv, n', D]
        v = v_cache.double().view(Hkv, -1, D)[:, slots[first:]]
        qb = q[b].double().view(Hkv, G, D)
        p = torch.softmax(qb @ k.transpose(1, 2) * scale, dim=-1)
        out.append((p @ v).reshape(-1, D))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,H,Hkv,bs,window", [(64, 9, 3, 16, 0), (128, 8, 1, 16, 0), (16, 4, 2, 4, 0),
                                                (32, 6, 6, 8, 20), (64, 16, 1, 16, 37)])
def test_kernel_matches_float64_reference(dtype, D, H, Hkv, bs, window) -> None:
    require_native_kernel()
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
    k_cache = torch.randn(Hkv, num_blocks, bs, D, generator=g).to(dtype)
    v_cache = torch.randn(Hkv, num_blocks, bs, D, generator=g).to(dtype)
    # Decode rows at odd rows of a 2B-row batch; the even rows hold a marker the kernel must not touch.
    T = 2 * len(lens)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    out = torch.full((T, H, D), 7.0, dtype=dtype)
    token_idx = torch.arange(1, T, 2)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    scale = D ** -0.5
    torch.ops.kvserve.paged_decode_(q, out, k_cache, v_cache, token_idx, block_tables, torch.tensor(lens),
                                    scale, window)
    want = reference(q[token_idx], k_cache, v_cache, tables, lens, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding (8 bits)
    torch.testing.assert_close(out[token_idx].double(), want, atol=tol, rtol=tol)
    assert torch.all(out[0::2] == 7.0)


def test_kernel_refuses_what_it_cannot_do() -> None:
    require_native_kernel()
    q = torch.zeros(1, 4, 48)
    cache = torch.zeros(2, 4, 16, 48)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.kvserve.paged_decode_(q, torch.empty_like(q), cache, cache, one, one[None], one + 1, 1.0, 0)
    with pytest.raises(RuntimeError):  # dtype mismatch between q and the cache
        torch.ops.kvserve.paged_decode_(q.double(), q.double(), cache, cache, one, one[None], one + 1, 1.0, 0)
