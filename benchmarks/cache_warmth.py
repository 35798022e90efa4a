"""Decode steps right after a pause in reading the weights: how much of a one-row step is the weights
staying in the last-level cache.

A one-row decode step of the default model reads its ~100 MB of weights. Where the CPU's last-level
cache is larger than that (the Intel Xeon VMs: 260 MB of L3, shared with the host's other tenants), the
weights mostly stay there from step to step, and a step reads them at L3 speed rather than DRAM speed.
Anything that keeps the process off them for a while (a prefill, a long verification step, or simply no
work) lets other data take their place, and the next steps pay for DRAM until the weights are back.

One sequence at --context tokens decodes in the engine's own steps (ModelRunner.execute, the state not
advanced). After --warm steps in a row, each "between" runs once, then the next --after steps are timed
one by one; --rounds rounds, the betweens taking turns, and the table gives the median time of each of
those steps against the steady step (nothing between):

    nothing      the steady step
    prefill N    a prompt chunk of N tokens (what a new request's prefill does)
    sleep MS     time.sleep: the process idle
    spin MS      a Python busy loop: the core busy, no memory touched
    touch MB     a fresh buffer of MB megabytes written once

    python benchmarks/cache_warmth.py           # results/cache_warmth_<isa>.{json,md}
    python benchmarks/cache_warmth.py --rounds 1 --after 3   # smoke
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import report
from kvserve import LLM, SamplingParams
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.kernels import cpu as cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=400, help="tokens the decoding sequence attends to")
    ap.add_argument("--prefill", type=int, nargs="+", default=[64, 400],
                    help="tokens of the prompt chunks (at most --context)")
    ap.add_argument("--sleep-ms", type=float, nargs="+", default=[5, 60])
    ap.add_argument("--spin-ms", type=float, nargs="+", default=[60])
    ap.add_argument("--touch-mb", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--warm", type=int, default=12, help="steady steps before each between")
    ap.add_argument("--after", type=int, default=8, help="steps timed after each between")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="cache_warmth")
    args = ap.parse_args()

    llm = LLM(enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("decode", torch.randint(1000, 20000, (args.context,)).tolist(),
                       SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # its prompt
    (seq,) = engine.scheduler.running
    if not engine.block_manager.allocate(seq, 1):  # room for the decode position
        raise SystemExit("no KV blocks for the decode step")
    decode = SchedulerOutput(scheduled=[(seq, 1)], spec_token_ids={}, num_batched_tokens=1)

    def step() -> float:
        t0 = time.perf_counter()
        engine.runner.execute(decode)
        return time.perf_counter() - t0

    def prefill(n: int):
        # A prompt chunk of n tokens: the sequence's own last n prompt tokens computed again (their K/V
        # rewritten as they were), so nothing else in the engine moves.
        chunk = SchedulerOutput(scheduled=[(seq, n)], spec_token_ids={}, num_batched_tokens=n)

        def run() -> None:
            computed = seq.num_computed_tokens
            seq.num_computed_tokens = args.context - n
            engine.runner.execute(chunk)
            seq.num_computed_tokens = computed
        return run

    def sleep(ms: float):
        def run() -> None:
            time.sleep(ms / 1e3)
        return run

    def spin(ms: float):
        def run() -> None:
            end = time.perf_counter() + ms / 1e3
            while time.perf_counter() < end:
                pass
        return run

    def touch(mb: int):
        def run() -> None:
            torch.empty(mb << 18, dtype=torch.float32).fill_(1.0)
        return run

    betweens = {"nothing": lambda: None,
                **{f"prefill {n}": prefill(n) for n in args.prefill},
                **{f"sleep {ms:g} ms": sleep(ms) for ms in args.sleep_ms},
                **{f"spin {ms:g} ms": spin(ms) for ms in args.spin_ms},
                **{f"touch {mb} MB": touch(mb) for mb in args.touch_mb}}
    times: dict[str, list[list[float]]] = {name: [] for name in betweens}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, between in betweens.items():
                for _ in range(args.warm):
                    step()
                between()
                times[name].append([step() for _ in range(args.after)])
            print(f"round {r}: " + ", ".join(f"{n} {1e3 * t[-1][0]:.2f}" for n, t in times.items()), flush=True)

    medians = {name: [statistics.median(run[i] for run in runs) for i in range(args.after)]
               for name, runs in times.items()}
    steady = statistics.median(medians["nothing"])
    head = " | ".join(f"step {i + 1}" for i in range(args.after))
    lines = [f"| between | {head} | extra over the {args.after} steps, ms |",
             "|---|" + "---:|" * (args.after + 1)]
    for name, m in medians.items():
        cells = " | ".join(f"{1e3 * t:.2f} ({t / steady:.2f}x)" for t in m)
        lines.append(f"| {name} | {cells} | {1e3 * sum(t - steady for t in m):.1f} |")
    setup = (f"Model: the default SmolLM2-135M-Instruct (dtype auto, quantization auto). One sequence at "
             f"{args.context} tokens decoding in the engine's own steps; after {args.warm} steady steps, one "
             f"\"between\", then {args.after} steps timed one by one; medians over {args.rounds} rounds (ms, and "
             f"against the steady step, {1e3 * steady:.2f} ms).")
    report(args.name, "Decode steps after a pause in reading the weights", args, setup, "\n".join(lines),
           {"steady_s": steady, "medians_s": medians, "times_s": times}, isa=cpu_kernels.isa())


if __name__ == "__main__":
    main()
