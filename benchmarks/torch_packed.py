"""kvserve's quantized matmul against torch's own packed CPU kernels, per batch size (issue 8, "use torch's
packed kernels where they win; measure both and keep the faster per batch size").

For every linear layer of the default model (SmolLM2-135M: qkv 960x576, o 576x576, gate/up 3072x576,
down 576x1536; 30 layers, each its own weights so they stream from memory as in a real step), one pass
over all 120 matmuls at M activation rows, for:

  kvserve q4 x8    quant_linear_x8 on 4-bit blocks (group 32, asymmetric: the Q4_1 file's format)
  kvserve q4 x16   quant_linear_x16, the same blocks in 16-row tiles
  torch int4       aten._weight_int4pack_mm_for_cpu, the same values (group 32, scale + zero per group)
  kvserve q8 x8    quant_linear_x8 on per-channel int8
  kvserve q8 x16   quant_linear_x16, the same int8 weights in 16-row tiles
  torch int8       aten._weight_int8pack_mm, the same values and scales
  dequant+f32      kvserve's 4-bit blocks dequantized per call, then F.linear in float32 (a prefill strategy)
  float32          F.linear on float32 weights (reference, 4x the bytes)

Rounds alternate the methods and each figure is the minimum over rounds, so a busy machine slows all of
them alike. Activations are float32 (the engine's compute dtype on AVX2).

    python benchmarks/torch_packed.py [--rows 1 4 16 64 256] [--rounds 5] [--threads 1]
    KVSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/torch_packed.py   # the AVX2 side on AVX-512
    python benchmarks/torch_packed.py --methods "kvserve q4 x8" "kvserve q4 x16" "kvserve q8 x8" \
        "kvserve q8 x16" --rows 1 2 3 4 5 8 16 64 256 --threads 2 --name tile_layouts   # the two tile layouts

Writes results/<name>_<isa>.{json,md} (name: torch_packed unless --name), <isa> being kvserve's kernels in use.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import RESULTS, git_rev, machine_info
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.blocks import BlockWeight, quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one SmolLM2-135M layer
LAYERS = 30
GROUP = 32


def torch_int4(b: BlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """kvserve's q4 blocks (w = q * scale + min) -> torch's int4 pack and [K / g, N, 2] scale-and-zero,
    where torch computes w = (q - 8) * scale + zero, so zero = min + 8 * scale."""
    n, k = b.shape
    q = b.values().to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scale, mins = b.scales.float(), b.mins.float()
    sz = torch.stack([scale.t(), (mins + 8 * scale).t()], dim=-1).contiguous()
    return packed, sz


def build(n: int, k: int, gen: torch.Generator) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    w = torch.randn(n, k, generator=gen) * 0.05
    ops = cpu_kernels.ops()
    q4 = quantize_int4(w, GROUP)
    q8 = quantize_int8(w)
    q4x, q8x = q4.interleave8(), q8.interleave8()
    q4y, q8y = q4.interleave16(), q8.interleave16()
    p4, sz = torch_int4(q4)
    w8 = q8.values().to(torch.int8).contiguous()
    s8 = q8.scales[:, 0].float().contiguous()
    wf = w.contiguous()
    return {
        "kvserve q4 x8": lambda x: ops.quant_linear_x8(x, q4x.qs, q4x.scales, q4x.mins),
        "kvserve q4 x16": lambda x: ops.quant_linear_x16(x, q4y.qs, q4y.scales, q4y.mins),
        "torch int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4, GROUP, sz),
        "kvserve q8 x8": lambda x: ops.quant_linear_x8(x, q8x.qs, q8x.scales, None),
        "kvserve q8 x16": lambda x: ops.quant_linear_x16(x, q8y.qs, q8y.scales, None),
        "torch int8": lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, s8),
        "dequant+f32": lambda x: F.linear(x, q4x.dequantize()),
        "float32": lambda x: F.linear(x, wf),
        # Not timed: the exact weights of the 4-bit and 8-bit methods, to check they agree.
        "_ref4": lambda x: F.linear(x, q4.dequantize()),
        "_ref8": lambda x: F.linear(x, q8.dequantize()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=LAYERS, help="layers of distinct weights per pass (default: the model's 30)")
    p.add_argument("--methods", nargs="+", help="only these columns (default: all)")
    p.add_argument("--name", default="torch_packed", help="results/<name>_<isa>.{json,md}")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("kvserve's CPU kernels are not available on this machine")
    gen = torch.Generator().manual_seed(0)
    layers = [[build(n, k, gen) for n, k in SHAPES] for _ in range(args.layers)]
    methods = [m for m in layers[0][0] if not m.startswith("_")]
    if args.methods:
        unknown = set(args.methods) - set(methods)
        if unknown:
            raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {methods}")
        methods = [m for m in methods if m in args.methods]

    # The packed formats must compute the same product as kvserve's blocks (same values, same scales).
    x = torch.randn(8, SHAPES[0][1], generator=gen)
    for name, ref in (("kvserve q4 x8", "_ref4"), ("kvserve q4 x16", "_ref4"), ("torch int4", "_ref4"),
                      ("kvserve q8 x8", "_ref8"), ("kvserve q8 x16", "_ref8"), ("torch int8", "_ref8")):
        want = layers[0][0][ref](x)
        err = (layers[0][0][name](x) - want).abs().max().item() / want.abs().max().item()
        # kvserve's kernels quantize activations to 8 bits per block (as llama.cpp does): ~1% relative.
        assert err < 3e-2, f"{name} disagrees with its dequantized weights: relative error {err:.3g}"
    if cpu_kernels.isa() == "avx2":  # there the two layouts' kernels also sum in the same order
        for bits in ("q4", "q8"):
            assert torch.equal(layers[0][0][f"kvserve {bits} x8"](x), layers[0][0][f"kvserve {bits} x16"](x)), bits

    inputs = {m: {k: torch.randn(m, k, generator=gen) for k in {k for _, k in SHAPES}} for m in args.rows}
    best: dict[tuple[int, str], float] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for m in args.rows:
                for name in methods:
                    t0 = time.perf_counter()
                    for layer in layers:
                        for (n, k), fns in zip(SHAPES, layer):
                            fns[name](inputs[m][k])
                    dt = time.perf_counter() - t0
                    best[m, name] = min(best.get((m, name), float("inf")), dt)

    info = machine_info()
    load = os.getloadavg()
    head = ["rows"] + [f"{n} ms" for n in methods] + ["fastest"]
    table = []
    for m in args.rows:
        times = {n: best[m, n] * 1e3 for n in methods}
        fastest = min((n for n in methods if n != "float32"), key=times.get, default="")
        table.append([m] + [round(times[n], 2) for n in methods] + [fastest])
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    print("\n".join(lines))
    cmd = "python benchmarks/torch_packed.py " + " ".join(
        [f"--rows {' '.join(map(str, args.rows))}", f"--rounds {args.rounds}", f"--threads {args.threads}",
         f"--layers {args.layers}"]
        + ([f"--methods {' '.join(repr(m) for m in methods)}"] if args.methods else [])
        + ([f"--name {args.name}"] if args.name != "torch_packed" else []))
    print(f"load average after the run: {load[0]:.2f}")
    if args.no_write:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"command": cmd, "git": git_rev(), "machine": info, "isa": cpu_kernels.isa(), "threads": args.threads,
            "load_average_after": load, "layers": args.layers, "shapes": SHAPES,
            "ms_per_pass": {str(m): {n: best[m, n] * 1e3 for n in methods} for m in args.rows}}
    name = f"{args.name}_{cpu_kernels.isa()}"  # one file per instruction set: runs on both sit side by side
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    title = "kvserve's quantized matmul vs torch's packed CPU kernels" if not args.methods else \
        "Quantized matmul: " + ", ".join(methods)
    md = [f"# {title}\n",
          f"Command: `{cmd}` (git {git_rev()})\n",
          f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {args.threads} thread(s), "
          f"kvserve kernels: {cpu_kernels.isa()}. Load average after the run: {load[0]:.2f} (1 min). "
          f"One pass = the {4 * args.layers} matmuls of {args.layers} SmolLM2-135M layers, each layer its own weights; "
          f"float32 activations; minimum over {args.rounds} alternating rounds.\n",
          *lines, ""]
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
