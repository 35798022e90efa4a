"""bf16 GEMMs of the default model's shapes on CPU: torch's F.linear against kvserve's float linear layer
with its weight packed once for oneDNN (FloatMethod.pack, the path where kvserve's kernels are not built),
side by side in one run.

    python benchmarks/linear_packing.py
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from common import git_rev, machine_info, median_seconds, save
from kvserve.layers.linear import ColumnLinear, pack_float_weights
from kvserve.layers.quantization import FloatMethod

# SmolLM2-135M: fused qkv, o_proj, fused gate/up, down_proj, LM head ([out, in]).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    lines = ["| rows | layer | F.linear ms | packed ms | speed-up |", "|---:|---|---:|---:|---:|"]
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            tot_plain = tot_packed = 0.0
            for name, (n, k) in SHAPES.items():
                lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
                method = FloatMethod(torch.bfloat16, torch.device("cpu"))
                # FloatMethod's oneDNN path, as on a CPU without kvserve's kernels (with them it runs dense_linear,
                # benchmarks/dense_linear.py, or AMX tiles, dense_linear_amx.py).
                method.kernel, method.amx = None, False
                packed = ColumnLinear(k, n, method, name)
                packed.weight_loader(0, lin.weight.detach())
                packed.finalize()
                pack_float_weights(packed)
                x = torch.randn(rows, k).to(torch.bfloat16)
                t_plain = median_seconds(lambda: F.linear(x, lin.weight), args.repeat)
                t_packed = median_seconds(lambda: packed(x), args.repeat)
                # The layers run 30 times a step, the LM head once.
                mult = 1 if name == "lm_head" else 30
                tot_plain, tot_packed = tot_plain + mult * t_plain, tot_packed + mult * t_packed
                results.append({"rows": rows, "layer": name, "plain_ms": t_plain * 1e3, "packed_ms": t_packed * 1e3})
                lines.append(f"| {rows} | {name} {n}x{k} | {t_plain * 1e3:.3f} | {t_packed * 1e3:.3f} | "
                             f"{t_plain / t_packed:.2f}x |")
            lines.append(f"| {rows} | **all GEMMs of one forward** | {tot_plain * 1e3:.1f} | {tot_packed * 1e3:.1f} | "
                         f"**{tot_plain / tot_packed:.2f}x** |")
    table = "\n".join(lines)
    print(table)
    info = machine_info()
    md = (f"# bf16 linear: F.linear vs weight packed for oneDNN\n\nCommand: `python benchmarks/linear_packing.py "
          f"--rows {' '.join(map(str, args.rows))} --repeat {args.repeat}` (git {git_rev()})\n\nMachine: "
          f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads). "
          f"Median of {args.repeat} calls per shape; the forward total weights each layer shape by 30 (layers) "
          f"and the LM head by 1.\n\n{table}\n")
    save("linear_packing", {"args": vars(args), "machine": info, "git": git_rev(), "results": results}, md)


if __name__ == "__main__":
    main()
