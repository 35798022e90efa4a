"""Decode with and without huge pages behind the weights (kvserve/utils/huge_pages.py).

Whether a buffer sits in huge pages is fixed for a process's life, so the two settings run in separate
processes (KVSERVE_HUGE_PAGES=0 turns the advice off), in --pairs pairs back to back, the order swapped
every pair: this host's speed drifts over minutes, and a pair's ratio is taken seconds apart. Each process
loads the default model, then times greedy decode at one stream (--tokens-1 tokens, ignore_eos) and at 32
(--tokens-32 each), the best of --repeat runs each, and reports how much of its memory the kernel put in
huge pages (AnonHugePages).

    python benchmarks/huge_pages.py                  # results/huge_pages_<isa>.{json,md}
    python benchmarks/huge_pages.py --pairs 1 --tokens-1 16 --tokens-32 8 --repeat 1   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def child(args) -> None:
    from kvserve import LLM, SamplingParams
    llm = LLM(max_num_seqs=32, kv_cache_memory=512 << 20)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16))  # warm-up
    out = {}
    for name, n, tokens in (("c1", 1, args.tokens_1), ("c32", 32, args.tokens_32)):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        prompts = [f"{PROMPT} Variation {i}." for i in range(n)]
        best = 0.0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            done = llm.generate(prompts, params)
            best = max(best, sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - t0))
        out[name] = best
    with open("/proc/self/smaps_rollup") as f:
        huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    out["huge_mib"] = huge >> 10
    print(json.dumps(out))


def run(on: bool, args) -> dict:
    env = dict(os.environ, KVSERVE_HUGE_PAGES="1" if on else "0")
    cmd = [sys.executable, __file__, "--child", "--tokens-1", str(args.tokens_1), "--tokens-32",
           str(args.tokens_32), "--repeat", str(args.repeat)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--tokens-1", type=int, default=256, help="tokens decoded at one stream")
    ap.add_argument("--tokens-32", type=int, default=128, help="tokens each of 32 streams decodes")
    ap.add_argument("--repeat", type=int, default=3, help="runs per process and concurrency (the best counts)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    from common import report
    from kvserve.kernels import cpu as cpu_kernels

    pairs = []
    for k in range(args.pairs):
        first = k % 2 == 0  # on first in even pairs, off first in odd ones
        a = run(first, args)
        b = run(not first, args)
        on, off = (a, b) if first else (b, a)
        pairs.append({"on": on, "off": off})
        print(f"pair {k}: one stream {on['c1']:.1f} vs {off['c1']:.1f} tok/s ({on['c1'] / off['c1']:.3f}x), "
              f"32 streams {on['c32']:.1f} vs {off['c32']:.1f} ({on['c32'] / off['c32']:.3f}x); huge pages "
              f"{on['huge_mib']} vs {off['huge_mib']} MiB", flush=True)

    lines = ["| streams | with huge pages, tok/s (median) | without | ratio per pair (median) | pairs won | ratios |",
             "|---:|---:|---:|---:|---:|---|"]
    results = {"pairs": pairs}
    for key, streams in (("c1", 1), ("c32", 32)):
        ratios = [p["on"][key] / p["off"][key] for p in pairs]
        results[key] = {"ratio_median": statistics.median(ratios), "won": sum(r > 1 for r in ratios)}
        lines.append(f"| {streams} | {statistics.median(p['on'][key] for p in pairs):.1f} | "
                     f"{statistics.median(p['off'][key] for p in pairs):.1f} | {statistics.median(ratios):.3f} | "
                     f"{results[key]['won']} of {len(pairs)} | {' / '.join(f'{r:.3f}' for r in ratios)} |")
    huge_on = statistics.median(p["on"]["huge_mib"] for p in pairs)
    huge_off = statistics.median(p["off"]["huge_mib"] for p in pairs)
    setup = (f"Model: the default SmolLM2-135M-Instruct (dtype and quantization auto), KV cache 512 MiB; greedy "
             f"decode of {args.tokens_1} tokens at one stream and {args.tokens_32} tokens each at 32, best of "
             f"{args.repeat} runs per process; {args.pairs} pairs of processes, with and without "
             f"(KVSERVE_HUGE_PAGES=0), the order swapped every pair. Memory in huge pages (AnonHugePages, median): "
             f"{huge_on} MiB with, {huge_off} MiB without.")
    report("huge_pages", "Huge pages behind the weights", args, setup, "\n".join(lines), results,
           isa=cpu_kernels.isa())


if __name__ == "__main__":
    main()
