"""torch's CPU SDPA (the prefill attention of chunks that do not run on the native kernel) in bfloat16 against
float32, side by side: one sequence of the default model's geometry (9 query heads, 3 KV heads, head_dim 64),
causal over a cached prefix. The fastest of --rounds timings of --repeat calls each.

    python benchmarks/sdpa_dtype.py              # results/sdpa_dtype.{json,md}
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from common import report

SHAPES = [(1024, 0), (1024, 1024), (2048, 0), (1024, 3072), (1024, 6976)]  # (new tokens, cached prefix)


def best_ms(fn, rounds: int, repeat: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - t0) / repeat * 1e3)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows, results = [], {}
    for new, prefix in SHAPES:
        S = new + prefix
        base = [torch.randn(1, h, n, 64, generator=g) for h, n in ((9, new), (3, S), (3, S))]
        mask = torch.arange(S)[None, :] <= torch.arange(prefix, S)[:, None]
        ms = {}
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (x.to(dtype) for x in base)
            ms[str(dtype)[6:]] = best_ms(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True), args.rounds, args.repeat)
        ratio = ms["bfloat16"] / ms["float32"]
        results[f"{new} ({prefix})"] = {**ms, "float32_x_faster": ratio}
        rows.append(f"| {new} ({prefix}) | {ms['bfloat16']:.1f} | {ms['float32']:.1f} | {ratio:.2f}x |")
        print(rows[-1], flush=True)
    table = "\n".join(["| new tokens (cached prefix) | bfloat16 ms | float32 ms | float32 is x faster |",
                       "|---|---:|---:|---:|", *rows])
    report("sdpa_dtype", "torch's CPU SDPA: bfloat16 against float32", args,
           f"torch.nn.functional.scaled_dot_product_attention, 9 query heads over 3 KV heads (enable_gqa), head_dim "
           f"64, a boolean causal mask offset by the prefix; fastest of {args.rounds} rounds of {args.repeat} calls. "
           f"ATEN_CPU_CAPABILITY={torch.backends.cpu.get_cpu_capability()}.", table, results)


if __name__ == "__main__":
    main()
