"""The Triton kernels (kvserve/attention/triton) against float64 attention computed from the raw K/V:
decode rows, prefills, chunks over a cached prefix, speculative rows, GQA, sliding windows, head sizes
that are and are not powers of two, float8 caches, and padding (tiles of sequence -1, slots of -1).
On a CPU they run under TRITON_INTERPRET=1, so the shapes stay small."""
from __future__ import annotations

import math

import pytest
import torch

from triton_helpers import triton_device

DEVICE = triton_device()

from kvserve.attention.backend import StepBatch  # noqa: E402
from kvserve.attention.triton.backend import TritonBackend  # noqa: E402
from kvserve.attention.triton.cache_write import write_kv  # noqa: E402
from kvserve.attention.triton import paged_attention as pa  # noqa: E402
from kvserve.attention.triton.paged_attention import (num_kv_splits, paged_attention, schedule_tiles,  # noqa: E402
                                                      tile_rows)
from kvserve.layers.attention import PagedAttention  # noqa: E402
from kvserve.models.kv_cache import KVCacheSpec  # noqa: E402

FP8 = torch.float8_e4m3fn


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float,
              window: int | None, positions: list[int] | None = None) -> torch.Tensor:
    """float64 attention of q [n, H, D] (stored at first_pos...) over one sequence's k, v [S, Hkv, D]. positions:
    where a tree puts its tokens (default: where they are stored); a token sees the keys stored below its
    position (each at the position it is stored at) and its own key (backend.py)."""
    n, H, D = q.shape
    G = H // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    idx = torch.arange(first_pos, first_pos + n)[:, None]
    pos = idx if positions is None else torch.tensor(positions)[:, None]
    key = torch.arange(k.shape[0])[None, :]
    visible = (key < pos) | (key == idx)
    if window is not None:
        visible &= torch.where(key == idx, pos, key) > pos - window
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


class Pool:
    """Sequences' blocks in a shuffled pool (block 0 never used), so tables are not in order."""

    def __init__(self, num_blocks: int, block_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.block_size = block_size
        self.tables: list[list[int]] = []

    def step(self, lens_before: list[int], q_lens: list[int]) -> StepBatch:
        bs = self.block_size
        while len(self.tables) < len(q_lens):
            self.tables.append([])
        slots, starts, seq_lens = [], [0], []
        for i, (old, n) in enumerate(zip(lens_before, q_lens)):
            while len(self.tables[i]) * bs < old + n:
                self.tables[i].append(self.free.pop())
            slots += [self.tables[i][p // bs] * bs + p % bs for p in range(old, old + n)]
            starts.append(starts[-1] + n)
            seq_lens.append(old + n)
        width = max(len(t) for t in self.tables[:len(q_lens)])
        tables = [t + [0] * (width - len(t)) for t in self.tables[:len(q_lens)]]
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
        return StepBatch(t(slots), t(starts), t(seq_lens), t(tables), starts, seq_lens, bs)


def run_steps(H: int, Hkv: int, D: int, bs: int, window: int | None, dtype: torch.dtype, kv_dtype: torch.dtype,
              steps: list[list[int]], fused_qkv: bool = False, seed: int = 0, num_splits: int | None = None,
              block_n: int | None = None, positions: list[list[int] | None] | None = None) -> None:
    """Run steps of new-token counts per sequence (0: not in this step's batch is not modelled; every
    sequence is in every step) through TritonBackend.forward and check every output row.
    num_splits: force split-KV with that many parts on every step (the backend itself splits only steps of
    short rows: decodes and verification). positions: per step, each token's position where a tree puts some
    off their index (StepBatch.positions_list; None: none), which the reference takes too."""
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(steps[0])
    spec = KVCacheSpec(1, bs, Hkv, D, kv_dtype)
    layer = PagedAttention(H, Hkv, D, 0, window, scale=0.7 / math.sqrt(D))
    if kv_dtype == FP8:
        layer.k_scale, layer.v_scale = 0.5, 2.0
    backend = TritonBackend([layer], spec, 64, DEVICE, dtype)
    if block_n is not None:
        backend.block_n = block_n
    # Random cache contents: a read of a slot never written would show.
    kv = [(torch.randn(backend.kv_cache_shape(64), generator=g).to(DEVICE, kv_dtype),
           torch.randn(backend.kv_cache_shape(64), generator=g).to(DEVICE, kv_dtype))]
    pool = Pool(64, bs, seed)
    hist_k = [torch.empty(0, Hkv, D) for _ in range(num_seqs)]
    hist_v = [torch.empty(0, Hkv, D) for _ in range(num_seqs)]
    for step, q_lens in enumerate(steps):
        lens = [len(h) for h in hist_k]
        batch = pool.step(lens, q_lens)
        batch.positions_list = positions[step] if positions is not None else None
        T = batch.num_tokens
        if fused_qkv:  # q, k, v as views of one projection's output, as the models pass them
            qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(DEVICE, dtype)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
            q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        else:
            q, k, v = (torch.randn(T, n, D, generator=g).to(DEVICE, dtype) for n in (H, Hkv, Hkv))
        meta = backend.build_metadata(batch)
        if num_splits is not None:
            meta.num_splits = {bq: num_splits for bq in meta.num_splits}
        assert (meta.positions is not None) == (batch.positions_list is not None)
        out = backend.forward(layer, q, k, v, kv[0], meta).view(T, H, D)
        assert out.dtype == dtype
        for i, n in enumerate(q_lens):
            s, e = batch.query_start_loc_list[i], batch.query_start_loc_list[i + 1]
            # What the cache can give back: K/V rounded to the cache's dtype (and scale), as the kernel reads them.
            k_new, v_new = k[s:e].float().cpu(), v[s:e].float().cpu()
            if kv_dtype == FP8:
                k_new = (k_new / layer.k_scale).clamp(-448, 448).to(FP8).float() * layer.k_scale
                v_new = (v_new / layer.v_scale).clamp(-448, 448).to(FP8).float() * layer.v_scale
            else:
                k_new, v_new = k_new.to(kv_dtype).float(), v_new.to(kv_dtype).float()
            hist_k[i], hist_v[i] = torch.cat([hist_k[i], k_new]), torch.cat([hist_v[i], v_new])
            want = reference(q[s:e].float().cpu(), hist_k[i], hist_v[i], lens[i], layer.scale, window,
                             None if batch.positions_list is None else batch.positions_list[s:e])
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[s:e].double().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 2), (8, 1)])
def test_triton_attention_gqa_decode_prefill_and_extend(H: int, Hkv: int) -> None:
    # Step 1: prefills of different lengths (one spans several blocks); step 2: an extend chunk over a
    # cached prefix next to decodes and a speculative row of 1 + 3; step 3: decodes only.
    run_steps(H, Hkv, 32, 4, None, torch.float32, torch.float32, [[7, 1, 12], [1, 4, 9], [1, 1, 1]])


@pytest.mark.parametrize("window", [3, 8])
def test_triton_attention_sliding_window(window: int) -> None:
    run_steps(4, 2, 16, 4, window, torch.float32, torch.float32, [[13, 2], [1, 10], [1, 1]])


@pytest.mark.parametrize("D", [256, 80])
def test_triton_attention_head_sizes(D: int) -> None:
    # 256: Gemma 3; 80: not a power of two, so the head dim is masked.
    run_steps(4, 2, D, 16, None, torch.float32, torch.float32, [[20, 3], [1, 1]])


def test_triton_attention_bfloat16_from_fused_qkv_view() -> None:
    run_steps(4, 2, 64, 16, None, torch.bfloat16, torch.bfloat16, [[18, 5], [1, 6]], fused_qkv=True)


def test_triton_attention_fp8_cache_with_scales() -> None:
    run_steps(4, 2, 32, 8, None, torch.bfloat16, FP8, [[11, 4], [1, 3]])


def test_triton_attention_block_size_not_a_power_of_two() -> None:
    run_steps(2, 1, 16, 5, 6, torch.float32, torch.float32, [[12, 3], [2, 1]])


@pytest.mark.parametrize("splits,window", [(4, None), (3, 5)])
def test_triton_split_kv_matches_reference(splits: int, window: int | None) -> None:
    # Keys in parts of 16: with 4 parts a 21-token context leaves the last parts empty (lse -inf), and the
    # prefill step checks that the parts keep causality within a chunk too.
    run_steps(4, 2, 16, 4, window, torch.float32, torch.float32, [[21, 2, 9], [1, 1, 1]],
              num_splits=splits, block_n=16)


def test_triton_split_kv_bfloat16_fp8() -> None:
    run_steps(8, 1, 32, 8, None, torch.bfloat16, FP8, [[30, 17], [1, 1]], num_splits=2, block_n=16)


def test_triton_backend_splits_long_decodes_and_verification_steps_only(monkeypatch) -> None:
    """The backend's own choice: a long-context decode batch on a GPU with SMs to fill is split, and so is a
    verification step (rows of a few tokens); a step with prefill rows is not; the split steps still match
    the reference."""
    seen: list[int] = []
    launch = pa.paged_attention

    def spy(*args, **kwargs):
        seen.append(args[-1])
        return launch(*args, **kwargs)
    monkeypatch.setattr("kvserve.attention.triton.backend.paged_attention", spy)
    monkeypatch.setattr("kvserve.attention.triton.backend.num_kv_splits",
                        lambda programs, longest, sms, block_n: num_kv_splits(programs, longest, sms, block_n,
                                                                              min_keys_per_split=16))
    monkeypatch.setattr(TritonBackend, "__init__", _with_sms(TritonBackend.__init__, 8))
    run_steps(4, 2, 16, 4, None, torch.float32, torch.float32, [[40, 3], [1, 1], [4, 2], [17, 1]], block_n=16)
    # Prefill step unsplit; decode: 2 seqs x 2 KV heads = 4 programs, 2 parts fill 8 SMs; rows of 4 and 2
    # tokens: one tile each, split the same way; a 17-token chunk beside a decode: unsplit.
    assert seen == [1, 2, 2, 1]


def _with_sms(init, num_sms: int):
    def patched(self, *args, **kwargs):
        init(self, *args, num_sms=num_sms, **kwargs)
    return patched


def test_triton_num_kv_splits_fills_the_gpu_within_bounds() -> None:
    assert num_kv_splits(4, 32768, 132) == 16           # one sequence's decode, long context: the cap
    assert num_kv_splits(4, 2048, 132) == 16             # parts of at least 128 keys
    assert num_kv_splits(4, 2047, 132) == 8
    assert num_kv_splits(512, 32768, 132) == 1           # the batch already fills the GPU
    assert num_kv_splits(64, 32768, 132) == 8            # 64 x 8 = 512 >= 2 x 132 (from 4 x 64 = 256 below)
    assert num_kv_splits(4, 300, 132) == 2
    assert num_kv_splits(4, 255, 132) == 1               # too short to split
    assert num_kv_splits(4, 32768, 0) == 1               # a CPU: no SMs to fill


def test_triton_kv_write_puts_each_head_at_its_slot_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(3)
    T, Hkv, D, bs = 5, 3, 16, 4
    k = torch.randn(T, Hkv, D, generator=g).to(DEVICE)
    v = torch.randn(T, Hkv, D, generator=g).to(DEVICE)
    for dtype, scale in ((torch.float32, 1.0), (FP8, 0.25)):
        k_cache = torch.zeros(6, bs, Hkv, D, device=DEVICE).to(dtype)
        v_cache = torch.zeros(6, bs, Hkv, D, device=DEVICE).to(dtype)
        slots = torch.tensor([9, 2, -1, 23, 4], device=DEVICE)
        write_kv(k, v, k_cache, v_cache, slots, scale, scale)
        k_flat, v_flat = k_cache.float().view(-1, Hkv, D).cpu(), v_cache.float().view(-1, Hkv, D).cpu()
        written = [0, 1, 3, 4]
        want_k, want_v = k.cpu()[written], v.cpu()[written]
        if dtype == FP8:  # stored as x / scale, saturated at 448 (k * 4 stays far inside it)
            want_k = (want_k / scale).clamp(-448, 448).to(FP8).float()
            want_v = (want_v / scale).clamp(-448, 448).to(FP8).float()
        torch.testing.assert_close(k_flat[[9, 2, 23, 4]], want_k, atol=0, rtol=0)
        torch.testing.assert_close(v_flat[[9, 2, 23, 4]], want_v, atol=0, rtol=0)
        untouched = [s for s in range(24) if s not in (9, 2, 23, 4)]
        assert not k_flat[untouched].any() and not v_flat[untouched].any()


def test_triton_attention_padding_tiles_write_nothing() -> None:
    """Tiles of sequence -1 (a graph's padded batch) leave their rows alone."""
    g = torch.Generator().manual_seed(4)
    H, Hkv, D, bs = 4, 2, 16, 4
    k_cache = torch.randn(8, bs, Hkv, D, generator=g).to(DEVICE)
    v_cache = torch.randn(8, bs, Hkv, D, generator=g).to(DEVICE)
    q = torch.randn(3, H, D, generator=g).to(DEVICE)
    out = torch.full((3, H, D), 7.0, device=DEVICE)
    tile_seq, tile_start = schedule_tiles([0, 1, 2], tile_rows(H, Hkv)[1], DEVICE)
    tile_seq = torch.cat([tile_seq, torch.tensor([-1], dtype=torch.int32, device=DEVICE)])
    tile_start = torch.cat([tile_start, torch.tensor([2], dtype=torch.int32, device=DEVICE)])
    tables = torch.tensor([[1, 2], [3, 0]], device=DEVICE)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    paged_attention(q, out, k_cache, v_cache, tables, i32([6, 3]), i32([0, 1, 2]), tile_seq, tile_start,
                    D ** -0.5, None)
    assert (out[2] == 7.0).all()  # row 2 belongs to no sequence
    kc, vc = k_cache.cpu(), v_cache.cpu()
    for row, (blocks, n) in enumerate((([1, 2], 6), ([3], 3))):
        keys = torch.cat([kc[b] for b in blocks])[:n]
        vals = torch.cat([vc[b] for b in blocks])[:n]
        want = reference(q[row:row + 1].cpu(), keys, vals, n - 1, D ** -0.5, None)
        torch.testing.assert_close(out[row:row + 1].double().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("H,Hkv,window,splits", [(4, 2, None, None), (8, 1, None, None), (4, 2, 5, None),
                                                 (4, 2, None, 2), (6, 2, 4, 2)])
def test_triton_attention_tree_rows(H: int, Hkv: int, window: int | None, splits: int | None) -> None:
    """Speculative tree rows (a chain, then alternatives to its first token, each stored past the chain at that
    token's position) beside a decode and a prompt chunk, against float64 attention with the tree's visibility;
    GQA, sliding windows (a tile that begins at an alternative starts its keys from its lowest position),
    split-KV."""
    history = [19, 6, 33, 5]  # the prompts
    # Then: sequence 0 a chain of 2 and 3 alternatives (rows 1 + 2 + 3), 1 a decode, 2 a chain of 3 and 2, 3 a
    # prompt chunk of 10 (plain rows beside the trees, several tiles).
    rows = [(2, 3), (0, 0), (3, 2), (9, 0)]
    positions = []
    for old, (c, a) in zip(history, rows):
        positions += list(range(old, old + 1 + c)) + [old + 1] * a
    run_steps(H, Hkv, 16, 4, window, torch.float32, torch.float32, [history, [1 + c + a for c, a in rows]], seed=3,
              num_splits=splits, block_n=16, positions=[None, positions])


def test_triton_backend_moves_a_kept_alternatives_kv() -> None:
    """copy_slots: every layer's K and V at the source slots land at the destination slots, float8 too."""
    for dtype in (torch.float32, FP8):
        spec = KVCacheSpec(2, 4, 2, 8, dtype)
        layers = [PagedAttention(4, 2, 8, i, None, scale=1.0) for i in range(2)]
        backend = TritonBackend(layers, spec, 8, DEVICE, torch.float32)
        caches = [(torch.randn(backend.kv_cache_shape(8)).to(DEVICE, dtype),
                   torch.randn(backend.kv_cache_shape(8)).to(DEVICE, dtype)) for _ in layers]
        before = [(k.clone(), v.clone()) for k, v in caches]
        backend.copy_slots(caches, [9, 22], [5, 30])
        for (k, v), (k0, v0) in zip(caches, before):
            for cache, old in ((k, k0), (v, v0)):
                flat, was = cache.view(torch.uint8).flatten(0, 1), old.view(torch.uint8).flatten(0, 1)
                assert torch.equal(flat[5], was[9]) and torch.equal(flat[30], was[22])
                keep = [s for s in range(32) if s not in (5, 30)]
                assert torch.equal(flat[keep], was[keep])
