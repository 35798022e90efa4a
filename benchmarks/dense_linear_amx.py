"""bfloat16 float weights on a CPU with AMX: the AMX kernel (kvserve/kernels/cpu/dense_linear_amx.cpp), the
AVX-512 one it replaces there (dense_linear.cpp), and torch's oneDNN linear (on AMX too, but its rows round by
the step's shape), side by side.

parts: the default model's projections in bfloat16 (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), each
of 30 layers its own weights so that they stream from memory as in a step, and the LM head 49152x576: per row
count, one pass over the 30 layers' projections and one LM head.

engine: the default model unquantized in bfloat16 (--quantization none), its float layers switched between the
two kvserve kernels: a --prompt-tokens prompt's prefill alone, and greedy decoding of --max-tokens tokens for 1
and --streams requests (output tok/s).

The methods take turns within each of --rounds rounds; the tables give the median round.

    python benchmarks/dense_linear_amx.py            # results/dense_linear_amx.{json,md}
"""
from __future__ import annotations

import argparse
import statistics

import torch

from common import report
from dense_linear import (engine_measures, measured_in_turns, parts_in_turns, random_model, speedup,
                          torch_linear)
from kvserve import LLM
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.methods import FloatMethod, amx_pack, amx_rows
from kvserve.models.native_stack import NativeDecoderStack


def parts(args, ops) -> tuple[list[str], dict]:
    g = torch.Generator().manual_seed(0)
    lines = ["| rows | layers: dense_linear ms | AMX ms | torch ms | AMX x dense_linear | AMX x torch | "
             "LM head: dense_linear ms | AMX ms | torch ms | AMX x dense_linear | AMX x torch |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    results: dict = {}
    bf16 = torch.bfloat16
    weights, head = random_model(bf16, g)

    def amx(w: torch.Tensor):
        packed = amx_pack(w)
        return lambda x: ops.dense_linear_amx(x, packed, None)

    def dense(w: torch.Tensor):
        return lambda x: ops.dense_linear(x, w, None)

    methods = {name: ([{p: make(w) for p, w in layer.items()} for layer in weights], make(head))
               for name, make in (("dense_linear", dense), ("amx", amx), ("torch", torch_linear))}
    for m in args.rows:
        times = parts_in_turns(methods, m, bf16, args.rounds, g)
        med = {meth: {part: statistics.median(v) for part, v in ps.items()} for meth, ps in times.items()}
        cells = []
        for part in ("layers", "head"):
            d, a, t = (med[meth][part] for meth in ("dense_linear", "amx", "torch"))
            cells += [f"{1e3 * d:.2f}", f"{1e3 * a:.2f}", f"{1e3 * t:.2f}", f"{d / a:.2f}", f"{t / a:.2f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        results[str(m)] = {"median_s": med, "all_s": times}
    return lines, results


def switch(model, layers: list, to_amx: bool) -> None:
    """The float layers on the AMX kernel (their packed weight) or on dense_linear (their weight unpacked); the
    native decoder stack, which holds the weights it multiplies, rebuilt with them."""
    for layer, packed, unpacked in layers:
        layer.amx_weight, layer.weight = (packed, None) if to_amx else (None, unpacked)
    model.native_stack = NativeDecoderStack.build(model)


def engine(args) -> tuple[list[str], dict]:
    lines = ["| measure | dense_linear | AMX | AMX x dense_linear |", "|---|---:|---:|---:|"]
    llm = LLM(quantization="none", dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    layers = [(m, m.amx_weight, torch.nn.Parameter(amx_rows(m.amx_weight, torch.arange(m.output_size)),
                                                   requires_grad=False))
              for m in model.modules() if isinstance(getattr(m, "method", None), FloatMethod)]
    assert layers and all(packed is not None for _, packed, _ in layers), "the engine did not pack for AMX"
    measures = engine_measures(llm, args)
    times = measured_in_turns(measures, {"dense_linear": lambda: switch(model, layers, False),
                                         "amx": lambda: switch(model, layers, True)}, args.rounds)
    switch(model, layers, True)
    for m in measures:
        d, a = statistics.median(times["dense_linear"][m]), statistics.median(times["amx"][m])
        ratio = speedup(m, d, a)  # > 1: AMX is faster
        lines.append(f"| {m} | {d:.3g} | {a:.3g} | {ratio:.2f} |")
        print(lines[-1], flush=True)
    return lines, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", nargs="+", default=["parts", "engine"], choices=["parts", "engine"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 9, 64, 512])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="dense_linear_amx")
    args = ap.parse_args()
    if not cpu_kernels.amx():
        raise SystemExit("dense_linear_amx.py needs the AMX kernel: a CPU with AMX-BF16, and KVSERVE_CPU_ISA "
                         "unset, auto or amx")
    tables, results = [], {}
    if "parts" in args.what:
        lines, results["parts"] = parts(args, cpu_kernels.ops())
        tables.append("Parts (ms, median round):\n\n" + "\n".join(lines))
    if "engine" in args.what:
        lines, results["engine"] = engine(args)
        tables.append("Engine, the default model unquantized in bfloat16 (median round):\n\n" + "\n".join(lines))
    setup = ("CPU kernels: AVX512 + AMX. bfloat16 activations and weights. 'dense_linear': kvserve's AVX-512 "
             "kernel; 'AMX': dense_linear_amx, the weight packed at load; 'torch': oneDNN's linear on a weight "
             "packed at load (FloatMethod's call without kvserve's kernels). engine: SmolLM2-135M-Instruct with "
             "--quantization none --dtype bfloat16, prefix caching off, its float layers switched between the two "
             f"kvserve kernels; prefill of a "
             f"{args.prompt_tokens}-token random prompt alone; decoding {args.max_tokens} tokens (ignore_eos) for 1 "
             f"and {args.streams} requests of 16-token prompts, output tok/s. Median of {args.rounds} rounds, the "
             "methods in turn within each (parts: each timing after one untimed pass); a ratio 'x' > 1: AMX is "
             "faster.")
    report(args.name, "bfloat16 float weights on AMX tiles", args, setup, "\n\n".join(tables), results,
           script="dense_linear_amx")


if __name__ == "__main__":
    main()
