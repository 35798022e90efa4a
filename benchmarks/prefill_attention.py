"""Prefill attention, one layer of the default model's geometry: the native kernel (every query token a
row reading K/V in place) against the torch path (gather + one SDPA call per sequence), in one run.
Both include the KV write. This is the measurement behind _KERNEL_MAX_PREFILL_CONTEXT in
kvserve/attention/torch_plan.py (longer prefills stay with SDPA).

    python benchmarks/prefill_attention.py     # results/prefill_attention_<isa>.*
"""
from __future__ import annotations

import argparse
import random

import torch

from common import median_seconds, report
from kvserve.attention.backend import StepBatch
from kvserve.attention.torch_backend import TorchPagedBackend
from kvserve.attention.torch_plan import _kernel_rows
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.attention import PagedAttention
from kvserve.models.kv_cache import KVCacheSpec

H, HKV, D, BS = 9, 3, 64, 16  # SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64
# (sequences, new tokens each, cached prefix): a 2048-token step budget filled different ways, then chunks of
# a long prompt (chunked prefill) over long cached prefixes.
SHAPES = [(32, 64, 0), (8, 256, 0), (4, 512, 0), (2, 256, 768), (2, 1024, 0), (1, 2048, 0), (1, 2048, 2048),
          (1, 2048, 6144)]


def make_step(nseq: int, new: int, prefix: int, num_blocks: int, dtype: torch.dtype):
    free = list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    lens = [prefix + new] * nseq
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    slots, starts = [], [0]
    for t, n in zip(tables, lens):
        slots += [t[p // BS] * BS + p % BS for p in range(prefix, n)]
        starts.append(starts[-1] + new)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(starts[-1], h, D, generator=g).to(dtype) for h in (H, HKV, HKV)]

    batch = StepBatch(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(lens),
        block_tables=torch.tensor(tables), query_start_loc_list=starts, seq_lens_list=lens, block_size=BS)
    return batch, qkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--name", default="prefill_attention", help="results/<name>_<isa>.{json,md}")
    args = ap.parse_args()
    assert cpu_kernels.available(), "the native kernel did not build on this machine"
    dtype = getattr(torch, args.dtype)
    attn = PagedAttention(H, HKV, D, layer_idx=0)
    spec, cpu = KVCacheSpec(1, BS, HKV, D, dtype), torch.device("cpu")
    native = TorchPagedBackend([attn], spec, 4096, cpu, dtype)
    torch_path = TorchPagedBackend([attn], spec, 4096, cpu, dtype, native_kernels=False)
    g = torch.Generator().manual_seed(1)
    cache = tuple(torch.randn(HKV, 4096, BS, D, generator=g).to(dtype) for _ in range(2))
    rows, lines = {}, ["| sequences x new tokens (cached prefix) | native kernel ms | torch SDPA ms | kernel is x faster |",
                       "|---|---:|---:|---:|"]
    with torch.inference_mode():
        for nseq, new, prefix in SHAPES:
            batch, (q, k, v) = make_step(nseq, new, prefix, 4096, dtype)
            m_kernel, m_torch = native.build_metadata(batch), torch_path.build_metadata(batch)
            # Force every row through the kernel, whatever the cut-over, to measure both sides of it.
            plan = m_kernel.plans[(None, True)]
            plan.kernel_rows, plan.prefills = _kernel_rows(batch, []), []
            run = lambda m: m.backend.forward(attn, q, k, v, cache, m)  # noqa: E731
            torch.testing.assert_close(run(m_kernel).float(), run(m_torch).float(), atol=3e-2, rtol=3e-2)
            t_k = median_seconds(lambda: run(m_kernel), args.repeat)
            t_t = median_seconds(lambda: run(m_torch), args.repeat)
            name = f"{nseq} x {new} ({prefix})"
            rows[name] = {"native_kernel_ms": t_k * 1e3, "torch_sdpa_ms": t_t * 1e3}
            lines.append(f"| {name} | {t_k * 1e3:.2f} | {t_t * 1e3:.2f} | {t_t / t_k:.2f}x |")
    report(args.name, "Prefill attention, one layer", args,
           f"Geometry of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64), block size {BS}, {args.dtype}, "
           f"blocks scattered through the pool; median of {args.repeat} calls, each including the KV write.",
           "\n".join(lines), rows, isa=cpu_kernels.isa(), script="prefill_attention")


if __name__ == "__main__":
    main()
