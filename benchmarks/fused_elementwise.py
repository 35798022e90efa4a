"""The fused CPU elementwise kernels (residual add + RMSNorm, rotary, SiLU * up) on and off, whole engine
steps on the default model, alternating in one run: decode steps at batch 1 and 64, and a 2048-token
prefill step (8 prompts of 256). The attention kernel stays on in both arms. Results go to
results/fused_elementwise_<isa>.* (the kernel variant in use; KVSERVE_CPU_ISA picks one).

    python benchmarks/fused_elementwise.py
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
import types

import kvserve.layers.activation as activation
import kvserve.layers.norm as norm
import kvserve.layers.rotary as rotary
from common import report
from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels

_OFF = types.SimpleNamespace(applies=lambda t: False)


def use_fused(on: bool) -> None:
    for module in (norm, activation, rotary):
        module.cpu_kernels = cpu_kernels if on else _OFF


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="alternations of on/off per measurement")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    args = ap.parse_args()
    assert cpu_kernels.available(), "the CPU kernels did not build on this machine"
    llm = LLM(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048)
    eng = llm.engine
    rng = random.Random(0)
    times: dict[str, dict[bool, list[float]]] = {}

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    for batch in (1, 64):
        ids = [f"d{batch}-{i}" for i in range(batch)]
        for rid in ids:
            eng.add_request(rid, prompt(rng.randint(32, 512)),
                            SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            eng.step()
        for _ in range(args.rounds):
            for on in (True, False):
                use_fused(on)
                eng.step()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                times.setdefault(f"decode step, batch {batch}", {}).setdefault(on, []).append(
                    (time.perf_counter() - t0) / args.steps * 1e3)
        eng.abort_request(ids)

    for _ in range(args.rounds):
        for on in (True, False):
            use_fused(on)
            for _ in range(8):
                eng.add_request(f"p{rng.random()}", prompt(256), SamplingParams(temperature=0, max_tokens=1))
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            times.setdefault("prefill step, 8 x 256 tokens", {}).setdefault(on, []).append(
                (time.perf_counter() - t0) * 1e3)
    use_fused(True)

    lines = ["| step | fused ms (median) | torch ops ms (median) | fused is x faster |", "|---|---:|---:|---:|"]
    rows = {}
    for name, t in times.items():
        on, off = statistics.median(t[True]), statistics.median(t[False])
        rows[name] = {"fused_ms": t[True], "torch_ms": t[False]}
        lines.append(f"| {name} | {on:.1f} | {off:.1f} | {off / on:.2f}x |")
    report("fused_elementwise", "Fused elementwise kernels on vs off", args,
           f"Default model (SmolLM2-135M-Instruct) in bfloat16, whole engine steps; the two arms alternate "
           f"{args.rounds} times in one process; decode rows have contexts of 32-512 prompt tokens plus what "
           f"they generated.", "\n".join(lines), rows, isa=cpu_kernels.isa())


if __name__ == "__main__":
    main()
