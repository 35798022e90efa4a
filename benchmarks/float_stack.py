"""Float weights in the native decoder stack (kvserve/models/native_stack.py) against the decoder layers run
one module at a time, side by side in one engine per dtype.

The default model unquantized (--quantization none, as an HF model's bf16 or float32 weights load), its
projections on the CPU kernels FloatMethod uses (dense_linear, or AMX tiles for bfloat16 where the CPU has
AMX-BF16); the two methods differ only in whether the layers run in one native call: the same kernels, the
same bits. Measures (engine_measures, shared with dense_linear.py): a --prompt-tokens prompt's prefill alone,
and greedy decoding of --max-tokens tokens for 1 and --streams requests of 16-token prompts (output tok/s).
The methods take turns within each of --rounds rounds; the table gives the median round and the median of
the rounds' ratios.

    python benchmarks/float_stack.py                          # results/float_stack_<isa>.{json,md}
    KVSERVE_CPU_ISA=avx512 python benchmarks/float_stack.py   # AMX off where the CPU has it
"""
from __future__ import annotations

import argparse
import statistics

from common import report
from dense_linear import engine_measures, measured_in_turns, speedup
from kvserve import LLM
from kvserve.kernels import cpu as cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default=None, help="results/<name>.{json,md} (default: float_stack_<the kernels' ISA>)")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("float_stack.py times the native decoder stack, and no CPU kernels are built here")
    lines = ["| dtype | measure | layers | stack | stack x layers | per round |", "|---|---|---:|---:|---:|---|"]
    results: dict = {}
    for name in args.dtypes:
        llm = LLM(quantization="none", dtype=name, enable_prefix_caching=False)
        model = llm.engine.runner.model
        stack = model.native_stack
        if stack is None:
            raise SystemExit(f"the default model in {name} has no native stack here")
        times = measured_in_turns(engine_measures(llm, args), {
            "layers": lambda: setattr(model, "native_stack", None),
            "stack": lambda: setattr(model, "native_stack", stack)}, args.rounds)
        for m in times["stack"]:
            # > 1: the stack is faster. Per round, the two methods ran minutes apart at most: this host's speed
            # drifts more than that over a run, so the ratio is the median of the rounds' ratios.
            rounds = [speedup(m, a, b) for a, b in zip(times["layers"][m], times["stack"][m])]
            a, b = statistics.median(times["layers"][m]), statistics.median(times["stack"][m])
            lines.append(f"| {name} | {m} | {a:.3g} | {b:.3g} | {statistics.median(rounds):.2f} | "
                         f"{min(rounds):.2f}-{max(rounds):.2f} |")
            print(lines[-1], flush=True)
        results[name] = times
    setup = ("Engine: SmolLM2-135M-Instruct with --quantization none, prefix caching off, float projections on "
             f"kvserve's kernels ({cpu_kernels.describe()}); 'layers': the decoder layers one module at a time "
             "(model.native_stack = None); 'stack': the same layers in one native call. Prefill of a "
             f"{args.prompt_tokens}-token random prompt alone (s); decoding {args.max_tokens} tokens (ignore_eos) "
             f"for 1 and {args.streams} requests of 16-token prompts (output tok/s). Median of {args.rounds} rounds, "
             "the methods in turn within each; 'stack x layers': the median of the rounds' ratios, > 1: the stack is "
             "faster.")
    isa = cpu_kernels.isa()
    report(args.name or "float_stack", "Float weights in the native decoder stack", args, setup,
           "\n".join(lines), results, isa=None if args.name else isa, script="float_stack")


if __name__ == "__main__":
    main()
