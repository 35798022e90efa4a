"""Decode attention, one layer of the default model's geometry, four ways in one run:

- block-major: the cache as [blocks, bs, Hkv, D] (kvserve before 5c3a26a): the gather comes out
  [B, L, Hkv, D] and the matmuls copy it into [B, Hkv, L, D] first;
- head-major, one group: kvserve's PagedAttention with every decode row padded to the longest context;
- head-major, grouped: kvserve's torch path (rows grouped by context length);
- native kernel: kvserve/kernels/cpu, K/V read in place (the default where it builds: CPUs with AVX-512,
  or AVX2 + FMA + F16C; results go to results/decode_attention_<isa>.*).

    python benchmarks/decode_attention.py            # batch 64, contexts 32-768 and all-equal 320
"""
from __future__ import annotations

import argparse
import random

import torch

from common import median_seconds, report
from kvserve.attention import torch_plan
from kvserve.attention.backend import StepBatch
from kvserve.attention.torch_backend import TorchPagedBackend
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.attention import PagedAttention
from kvserve.models.kv_cache import KVCacheSpec

H, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64


def make_batch(lens: list[int], num_blocks: int, dtype: torch.dtype):
    """One decode step: every sequence appends its last token. Random blocks, random cache contents."""
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    width = max(map(len, tables))
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)]
    starts = list(range(len(lens) + 1))
    meta = StepBatch(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc_list=starts, seq_lens_list=list(lens), block_size=BS)
    g = torch.Generator().manual_seed(0)
    cache = (torch.randn(HKV, num_blocks, BS, D, generator=g).to(dtype),
             torch.randn(HKV, num_blocks, BS, D, generator=g).to(dtype))
    qkv = [torch.randn(len(lens), h, D, generator=g).to(dtype) for h in (H, HKV, HKV)]
    return meta, cache, qkv


def block_major(q, k_new, v_new, cache_bm, meta: StepBatch) -> torch.Tensor:
    """The previous design, kept here only as the baseline: gather [B, L, Hkv, D], matmul on a transposed view."""
    k_cache, v_cache = cache_bm
    k_cache.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, k_new)
    v_cache.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, v_new)
    B, L = meta.num_seqs, max(meta.seq_lens_list)
    nb = -(-L // BS)
    k = k_cache[meta.block_tables[:, :nb]].flatten(1, 2)[:, :L].transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[meta.block_tables[:, :nb]].flatten(1, 2)[:, :L].transpose(1, 2)
    qd = q.view(B, HKV, H // HKV, D)
    mask = torch.arange(L)[None, :] < meta.seq_lens[:, None]
    scores = torch.matmul(qd, k.transpose(-1, -2)).float() * D ** -0.5
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v).reshape(B, H * D)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rng = random.Random(1)
    workloads = {"contexts 32-768 (uniform)": [rng.randint(32, 768) for _ in range(args.batch)],
                 "contexts all 320": [320] * args.batch}
    attn = PagedAttention(H, HKV, D, layer_idx=0)
    rows, lines = {}, ["| workload | block-major ms | head-major, one group ms | head-major, grouped ms | "
                       "native kernel ms | grouped vs block-major | kernel vs grouped |",
                       "|---|---:|---:|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for name, lens in workloads.items():
            meta, cache, (q, k, v) = make_batch(lens, 8192, dtype)
            cache_bm = tuple(c.permute(1, 2, 0, 3).contiguous() for c in cache)
            spec = KVCacheSpec(1, BS, HKV, D, dtype)
            torch_path = TorchPagedBackend([attn], spec, 8192, torch.device("cpu"), dtype, native_kernels=False)
            native = TorchPagedBackend([attn], spec, 8192, torch.device("cpu"), dtype)
            # Plans are built once per step and shared by all layers, so each variant keeps its own metadata.
            meta_grouped, meta_kernel = torch_path.build_metadata(meta), native.build_metadata(meta)
            saved = torch_plan._GROUP_COST_BLOCKS
            torch_plan._GROUP_COST_BLOCKS = 10 ** 9  # one group whatever the lengths
            try:
                meta_one = torch_path.build_metadata(meta)
            finally:
                torch_plan._GROUP_COST_BLOCKS = saved
            run = lambda m: m.backend.forward(attn, q, k, v, cache, m)  # noqa: E731
            one_group = run(meta_one)
            want = block_major(q, k, v, cache_bm, meta).float()
            torch.testing.assert_close(one_group.float(), want, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(run(meta_grouped).float(), want, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(run(meta_kernel).float(), want, atol=2e-2, rtol=2e-2)
            assert meta_kernel.plans[(None, True)].kernel_rows is not None, "kernel not used"
            groups = len(meta_grouped.plans[(None, False)].decode)
            t_bm = median_seconds(lambda: block_major(q, k, v, cache_bm, meta), args.repeat)
            t_one = median_seconds(lambda: run(meta_one), args.repeat)
            t_grouped = median_seconds(lambda: run(meta_grouped), args.repeat)
            t_kernel = median_seconds(lambda: run(meta_kernel), args.repeat)
            rows[name] = {"block_major_ms": t_bm * 1e3, "head_major_one_group_ms": t_one * 1e3,
                          "head_major_grouped_ms": t_grouped * 1e3, "native_kernel_ms": t_kernel * 1e3,
                          "groups": groups}
            lines.append(f"| {name} | {t_bm * 1e3:.2f} | {t_one * 1e3:.2f} | {t_grouped * 1e3:.2f} | "
                         f"{t_kernel * 1e3:.2f} | {t_bm / t_grouped:.2f}x | {t_grouped / t_kernel:.2f}x |")
    report("decode_attention", "Decode attention, one layer", args,
           f"Geometry of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64), block size {BS}, batch "
           f"{args.batch} decode rows, {args.dtype}; median of {args.repeat} calls, each including the KV write; "
           f"the per-step index plan (built once for all layers) is built outside the timing.",
           "\n".join(lines), rows, isa=cpu_kernels.isa())


if __name__ == "__main__":
    main()
