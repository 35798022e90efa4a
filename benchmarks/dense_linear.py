"""The row-invariant dense kernel (kvserve/kernels/cpu/dense_linear.cpp) against torch's matmuls as the engine
called them for float weights before it (kvserve/layers/quantization/methods.py, FloatMethod: F.linear in
float32, oneDNN's packed bfloat16 linear in bfloat16), side by side.

parts: the default model's projections, qkv 960x576, o 576x576, gate_up 3072x576 and down 576x1536, each of 30
layers its own weights (so that they stream from memory as in a step), and the LM head 49152x576. Per row count
and dtype, the time of one pass over the 30 layers' projections and of the LM head.

engine: the default model unquantized (--quantization none) in one engine per dtype, its float layers switched
between the kernel and torch: a --prompt-tokens prompt's prefill alone, and greedy decoding of --max-tokens
tokens for 1 and --streams requests of a short prompt (output tok/s).

Each measurement takes the methods in turn within each of --rounds rounds; the tables give the median round.

    python benchmarks/dense_linear.py                 # results/dense_linear_<isa>.{json,md}
    KVSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/dense_linear.py --name dense_linear_forced_avx2   # torch's libraries held to AVX2 too
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import prefill_seconds, report
from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.methods import FloatMethod, can_pack
from kvserve.models.native_stack import NativeDecoderStack

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
VOCAB = 49152


def torch_linear(w: torch.Tensor):
    """x -> x @ w^T the way FloatMethod computes it."""
    if can_pack(w):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return lambda x: F.linear(x, w)


def random_model(dtype: torch.dtype, g: torch.Generator) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The default model's float projections at random (LAYERS layers, each its own) and an LM head."""
    weights = [{p: (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype) for p, (n, k) in SHAPES.items()}
               for _ in range(LAYERS)]
    return weights, (torch.randn(VOCAB, 576, generator=g) * 576 ** -0.5).to(dtype)


def parts_in_turns(methods: dict, m: int, dtype: torch.dtype, rounds: int, g: torch.Generator) -> dict:
    """Seconds of each method's pass over the layers ("layers") and of its LM head ("head") at m rows, the methods
    in turn within each round. methods: name -> (per layer {projection: x -> y}, LM head x -> y)."""
    xs = {p: torch.randn(m, k, generator=g).to(dtype) for p, (_, k) in SHAPES.items()}
    xh = torch.randn(m, 576, generator=g).to(dtype)
    times = {meth: {"layers": [], "head": []} for meth in methods}
    with torch.inference_mode():
        for _ in range(rounds):
            for meth, (layers, lm_head) in methods.items():
                for part, fn in (("layers", lambda: [f(xs[p]) for layer in layers for p, f in layer.items()]),
                                 ("head", lambda: lm_head(xh))):
                    fn()  # warm-up: the weights of the other methods passed by in between
                    t0 = time.perf_counter()
                    fn()
                    times[meth][part].append(time.perf_counter() - t0)
    return times


def parts(args, ops) -> tuple[list[str], dict]:
    g = torch.Generator().manual_seed(0)
    lines = ["| dtype | rows | layers, torch ms | layers, kernel ms | kernel x torch | LM head, torch ms | "
             "LM head, kernel ms | kernel x torch |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    results: dict = {}
    for name in args.dtypes:
        dtype = getattr(torch, name)
        weights, head = random_model(dtype, g)
        with torch.inference_mode():
            methods = {"torch": ([{p: torch_linear(w) for p, w in layer.items()} for layer in weights],
                                 torch_linear(head)),
                       "kernel": ([{p: (lambda x, w=w: ops.dense_linear(x, w)) for p, w in layer.items()}
                                   for layer in weights], lambda x: ops.dense_linear(x, head))}
        for m in args.rows:
            times = parts_in_turns(methods, m, dtype, args.rounds, g)
            med = {meth: {part: statistics.median(v) for part, v in ps.items()} for meth, ps in times.items()}
            t, k = med["torch"], med["kernel"]
            lines.append(f"| {name} | {m} | {1e3 * t['layers']:.2f} | {1e3 * k['layers']:.2f} | "
                         f"{t['layers'] / k['layers']:.2f} | {1e3 * t['head']:.2f} | {1e3 * k['head']:.2f} | "
                         f"{t['head'] / k['head']:.2f} |")
            print(lines[-1], flush=True)
            results[f"{name}/{m}"] = {"median_s": med, "all_s": times}
    return lines, results


def switch_float_layers(model, to_torch: bool, kernel) -> None:
    """The model's float layers on torch's matmuls (a bfloat16 weight packed for oneDNN, as FloatMethod does
    without the kernel), one module at a time, or on the kernel, in the native decoder stack as a loaded model
    runs them (rebuilt: it holds the weights it multiplies, and takes only layers on the kernel)."""
    for layer in model.modules():
        method = getattr(layer, "method", None)
        if isinstance(method, FloatMethod):
            method.kernel = None if to_torch else kernel
            if to_torch and layer.packed_weight is None and can_pack(layer.weight):
                layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
    model.native_stack = NativeDecoderStack.build(model)


def engine_measures(llm: LLM, args) -> dict[str, Callable[[], float]]:
    """What the engine tables measure: a --prompt-tokens prompt's prefill alone (seconds), and greedy decoding of
    --max-tokens tokens for 1 and --streams requests of 16-token prompts (output tok/s). The same prompts each
    call."""
    g = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(1000, 20000, (args.prompt_tokens,), generator=g).tolist()
    short = [torch.randint(1000, 20000, (16,), generator=g).tolist() for _ in range(args.streams)]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def decode(n: int) -> float:
        t0 = time.perf_counter()
        outs = llm.generate(short[:n], greedy, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    return {f"prefill {args.prompt_tokens} tokens, s": lambda: prefill_seconds(llm, long_prompt)[0],
            "decode, 1 stream, tok/s": lambda: decode(1),
            f"decode, {args.streams} streams, tok/s": lambda: decode(args.streams)}


def speedup(measure: str, base: float, new: float) -> float:
    """How many times as fast new is as base at one of engine_measures' measures (> 1: new is faster): the
    prefill is timed in seconds, decoding in tok/s."""
    return base / new if measure.startswith("prefill") else new / base


def measured_in_turns(measures: dict[str, Callable[[], float]], methods: dict[str, Callable[[], None]],
                      rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each method (a switch of the engine's layers) takes its turn at every measure, in each of rounds rounds."""
    times = {meth: {m: [] for m in measures} for meth in methods}
    with torch.inference_mode():
        for _ in range(rounds):
            for meth, switch in methods.items():
                switch()
                for m, fn in measures.items():
                    times[meth][m].append(fn())
    return times


def engine(args, ops) -> tuple[list[str], dict]:
    lines = ["| dtype | measure | torch | kernel | kernel x torch |", "|---|---|---:|---:|---:|"]
    results: dict = {}
    for name in args.dtypes:
        llm = LLM(quantization="none", dtype=name, enable_prefix_caching=False)
        model = llm.engine.runner.model
        measures = engine_measures(llm, args)
        times = measured_in_turns(measures, {
            "torch": lambda: switch_float_layers(model, True, ops.dense_linear),
            "kernel": lambda: switch_float_layers(model, False, ops.dense_linear)}, args.rounds)
        for m in measures:
            t, k = statistics.median(times["torch"][m]), statistics.median(times["kernel"][m])
            ratio = speedup(m, t, k)  # > 1: the kernel is faster
            lines.append(f"| {name} | {m} | {t:.3g} | {k:.3g} | {ratio:.2f} |")
            print(lines[-1], flush=True)
        results[name] = times
    return lines, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", nargs="+", default=["parts", "engine"], choices=["parts", "engine"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 9, 64, 512])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default=None, help="results/<name>.{json,md} (default: dense_linear_<the kernels' ISA>)")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("dense_linear.py times a native CPU kernel, and none is built here")
    if cpu_kernels.amx() and "bfloat16" in args.dtypes and "engine" in args.what:
        raise SystemExit("here the engine's bfloat16 layers run on AMX (dense_linear_amx.py compares them): set "
                         "KVSERVE_CPU_ISA=avx512 to time dense_linear")
    ops = cpu_kernels.ops()
    tables, results = [], {}
    if "parts" in args.what:
        lines, results["parts"] = parts(args, ops)
        tables.append("Parts (ms, median round):\n\n" + "\n".join(lines))
    if "engine" in args.what:
        lines, results["engine"] = engine(args, ops)
        tables.append("Engine, the default model unquantized (median round):\n\n" + "\n".join(lines))
    isa = cpu_kernels.isa()
    setup = ("parts: the default model's float projections at random (30 layers, each its own), and its LM head. "
             "'torch' is FloatMethod's call without the kernel (float32: F.linear; bfloat16: oneDNN's linear on a "
             "weight packed at load where oneDNN supports bfloat16, else F.linear); 'kernel' is dense_linear, whose "
             "rows round alike whatever the row count. engine: SmolLM2-135M-Instruct with --quantization none, "
             f"prefix caching off; prefill of a {args.prompt_tokens}-token random prompt alone; decoding "
             f"{args.max_tokens} tokens (ignore_eos) for 1 and {args.streams} requests of 16-token prompts, output "
             f"tok/s. Median of {args.rounds} rounds, the methods in turn within each (parts: each timing after one "
             "untimed pass); a ratio 'x torch' > 1: the kernel is faster.")
    report(args.name or "dense_linear", "Row-invariant dense linear against torch's matmuls", args, setup,
           "\n\n".join(tables), results, isa=None if args.name else isa, script="dense_linear")


if __name__ == "__main__":
    main()
