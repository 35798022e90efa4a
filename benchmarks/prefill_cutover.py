"""Where long prefill chunks should leave the native attention kernel for torch's SDPA, end to end: the time
to prefill one prompt alone with the cut-over (_KERNEL_MAX_PREFILL_CONTEXT for this CPU's kernels) set to each
of --cutovers, in one engine, the settings taking turns in each round on the same fresh prompt (prefix caching
off). Past the cut-over a chunk of more than 16 tokens runs on SDPA, and where a long prompt is cut into
chunks then depends on its batch, so a lower cut-over buys speed with batch invariance (README, "Exact").

    python benchmarks/prefill_cutover.py [--cutovers 1024 2048 4096] [--lengths 2048 4096 6144]
                                                                     # results/prefill_cutover_<isa>.*
"""
from __future__ import annotations

import argparse
import random
import statistics

from common import add_prefill_options, prefill_engine, prefill_seconds, report
from kvserve.attention import torch_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cutovers", nargs="+", type=int, default=[1024, 2048, 4096], help="tokens of context")
    add_prefill_options(ap, [2048, 4096, 6144], 3, "prefill_cutover")
    args = ap.parse_args()
    llm, isa = prefill_engine(args)
    shipped = torch_plan._KERNEL_MAX_PREFILL_CONTEXT[isa]
    rng = random.Random(0)
    prefill_seconds(llm, [rng.randrange(100, 40000) for _ in range(256)])  # warm-up

    results: dict = {"shipped_cutover": shipped, "points": []}
    rows = []
    try:
        for n in args.lengths:
            seconds: dict[int, list[float]] = {c: [] for c in args.cutovers}
            for k in range(args.rounds):
                prompt = [rng.randrange(100, 40000) for _ in range(n)]
                for c in (args.cutovers if k % 2 == 0 else args.cutovers[::-1]):
                    torch_plan._KERNEL_MAX_PREFILL_CONTEXT[isa] = c
                    seconds[c].append(prefill_seconds(llm, prompt)[0])
            base = statistics.median(seconds[shipped]) if shipped in seconds else None
            cells = []
            for c in args.cutovers:
                med = statistics.median(seconds[c])
                results["points"].append({"prompt_tokens": n, "cutover": c, "seconds": seconds[c], "median_s": med})
                cells.append(f"{med:.2f}" + (f" ({base / med:.2f}x)" if base else ""))
            rows.append(f"| {n} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    finally:
        torch_plan._KERNEL_MAX_PREFILL_CONTEXT[isa] = shipped

    head = " | ".join(f"cut-over {c}{' (shipped)' if c == shipped else ''}, median s" for c in args.cutovers)
    table = "\n".join([f"| prompt tokens | {head} |", "|---:|" + "---:|" * len(args.cutovers), *rows])
    setup = (f"Model: the default SmolLM2-135M-Instruct (dtype auto: {str(llm.engine.dtype)[6:]}, quantization auto); "
             f"one request of random prompt tokens at a time, max_tokens 1, chunks of {args.max_num_batched_tokens} "
             f"tokens, prefix caching off; {args.rounds} rounds, the cut-overs taking turns on the same prompt. "
             f"Time to the first token (the whole prefill); in brackets the speed against the shipped cut-over "
             f"({shipped}).")
    report(args.name, "Prefill time by the kernel/SDPA cut-over", args, setup, table, results, isa=isa,
           script="prefill_cutover")


if __name__ == "__main__":
    main()
