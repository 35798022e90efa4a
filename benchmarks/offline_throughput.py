"""Offline throughput on the default model: kvserve (continuous and static batching) against
transformers `generate`, one request at a time and as padded batches, plus decode step times beside the
machine's memory-bandwidth and compute bounds, all measured in one run.

    python benchmarks/offline_throughput.py                  # the full run (tens of minutes on 2 cores)
    python benchmarks/offline_throughput.py --num-requests 32 --hf-sequential 4 --hf-batched 32   # quick

The transformers baselines are slow, so they run on the first --hf-sequential / --hf-batched requests of
the same workload; throughput is a rate, so the ratios stay comparable.
"""
from __future__ import annotations

import argparse
import gc
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import git_rev, machine_info, save
from kvserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def make_workload(n: int, seed: int, vocab_lo: int = 100, vocab_hi: int = 40000):
    """Token-id prompts of 32-512 tokens and output lengths 16-256, uniform, seeded."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    outputs = [rng.randint(16, 256) for _ in range(n)]
    return prompts, outputs


def run_kvserve(llm: LLM, prompts, outputs) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outputs)
    return {"seconds": dt, "output_tokens": n_out, "requests": len(prompts), "output_tok_s": n_out / dt}


def load_hf(dtype: torch.dtype):
    """transformers' own LlamaForCausalLM on the default model's weights, dense, as a user would run it.
    The directory comes from benchmarks/peers/export_default.py (run here if missing)."""
    from transformers import AutoModelForCausalLM
    hf_dir = ROOT / "third_party" / "models" / "SmolLM2-135M-Instruct-hf"
    if not (hf_dir / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "export_default.py")], check=True)
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()


@torch.inference_mode()
def run_hf_sequential(model, prompts, outputs) -> dict:
    t0 = time.perf_counter()
    n_out = 0
    for p, m in zip(prompts, outputs):
        ids = torch.tensor([p])
        out = model.generate(ids, max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=0)
        n_out += out.shape[1] - len(p)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "requests": len(prompts), "output_tok_s": n_out / dt}


@torch.inference_mode()
def run_hf_padded(model, prompts, outputs, batch_size: int) -> dict:
    """Left-padded static batches: each batch runs until its longest output is done. Only the tokens
    each request asked for count as output."""
    t0 = time.perf_counter()
    n_out = 0
    for b in range(0, len(prompts), batch_size):
        ps, ms = prompts[b:b + batch_size], outputs[b:b + batch_size]
        width = max(map(len, ps))
        ids = torch.zeros((len(ps), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        model.generate(ids, attention_mask=mask, max_new_tokens=max(ms), min_new_tokens=max(ms),
                       do_sample=False, pad_token_id=0)
        n_out += sum(ms)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "requests": len(prompts), "output_tok_s": n_out / dt}


def measure_bounds() -> dict:
    """Copy bandwidth (read + write of 512 MiB) and bf16 / fp32 matmul throughput, on this machine now."""
    a = torch.empty(2**28, dtype=torch.uint8)  # 256 MiB
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    bw = 10 * 2 * a.numel() / (time.perf_counter() - t0)
    del a, b
    flops = {}
    for dt in (torch.bfloat16, torch.float32):
        x, w = torch.randn(256, 1536, dtype=dt), torch.randn(4096, 1536, dtype=dt)
        torch.nn.functional.linear(x, w)
        t0 = time.perf_counter()
        for _ in range(20):
            torch.nn.functional.linear(x, w)
        flops[str(dt).split(".")[1]] = 20 * 2 * 256 * 1536 * 4096 / (time.perf_counter() - t0)
    return {"copy_bandwidth_gb_s": bw / 1e9, "matmul_gflop_s": {k: v / 1e9 for k, v in flops.items()}}


def decode_step_times(llm: LLM, batch_sizes=(1, 16, 64), ctx: int = 256, steps: int = 20) -> dict:
    """Mean wall time of one decode step with `b` sequences at ~ctx tokens of context each."""
    engine = llm.engine
    rng = random.Random(0)
    result = {}
    for b in batch_sizes:
        for i in range(b):
            engine.add_request(f"d{b}-{i}", [rng.randrange(100, 40000) for _ in range(ctx)],
                               SamplingParams(temperature=0, max_tokens=steps + 50, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        result[b] = (time.perf_counter() - t0) / steps
        engine.abort_request([f"d{b}-{i}" for i in range(b)])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64, help="kvserve max_num_seqs and the HF batch size")
    ap.add_argument("--hf-sequential", type=int, default=12, help="requests for transformers one-at-a-time")
    ap.add_argument("--hf-batched", type=int, default=128, help="requests for transformers padded batches")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="offline_throughput")
    args = ap.parse_args()

    prompts, outputs = make_workload(args.num_requests, args.seed)
    info = machine_info()
    print(f"machine: {info}")
    bounds = measure_bounds()
    print(f"bounds: {bounds}")

    llm = LLM(dtype=args.dtype, max_num_seqs=args.batch_size, max_num_batched_tokens=2048)
    rows = {}
    rows["kvserve continuous"] = run_kvserve(llm, prompts, outputs)
    print("kvserve continuous", rows["kvserve continuous"])
    step_times = decode_step_times(llm)
    llm.engine.scheduler.config.batching = "static"
    rows["kvserve static"] = run_kvserve(llm, prompts, outputs)
    print("kvserve static", rows["kvserve static"])
    mc, dtype_bytes = llm.engine.model_config, torch.empty((), dtype=llm.engine.dtype).element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    del llm
    gc.collect()

    hf = load_hf(getattr(torch, args.dtype))
    rows["transformers one-at-a-time"] = run_hf_sequential(hf, prompts[: args.hf_sequential],
                                                           outputs[: args.hf_sequential])
    print("transformers one-at-a-time", rows["transformers one-at-a-time"])
    rows[f"transformers padded batch {args.batch_size}"] = run_hf_padded(
        hf, prompts[: args.hf_batched], outputs[: args.hf_batched], args.batch_size)
    print("transformers padded", rows[f"transformers padded batch {args.batch_size}"])

    base = rows["kvserve continuous"]["output_tok_s"]
    lines = ["| engine | requests | output tokens | seconds | output tok/s | continuous is x faster |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['requests']} | {r['output_tokens']} | {r['seconds']:.1f} | "
                     f"{r['output_tok_s']:.1f} | {base / r['output_tok_s']:.2f} |")

    # Decode step bounds: every step reads all weights and each sequence's KV; flops ~ 2 * params * batch.
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype_bytes
    n_params = weight_bytes / dtype_bytes
    peak = bounds["matmul_gflop_s"][args.dtype] * 1e9
    lines += ["", "| decode batch | step ms (measured) | memory bound ms | compute bound ms |",
              "|---:|---:|---:|---:|"]
    step_rows = {}
    for b, t in step_times.items():
        mem = (weight_bytes + b * 256 * kv_per_token) / (bounds["copy_bandwidth_gb_s"] * 1e9)
        comp = 2 * n_params * b / peak
        step_rows[b] = {"measured_ms": t * 1e3, "memory_bound_ms": mem * 1e3, "compute_bound_ms": comp * 1e3}
        lines.append(f"| {b} | {t * 1e3:.1f} | {mem * 1e3:.1f} | {comp * 1e3:.1f} |")
    table = "\n".join(lines)
    print(table)

    cmd = "python benchmarks/offline_throughput.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    md = (f"# Offline throughput\n\nCommand: `{cmd}` (git {git_rev()})\n\n"
          f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
          f"({info['torch_threads']} threads).\n\nModel: SmolLM2-135M-Instruct (embedded GGUF, Q4_1 "
          f"dequantized to {args.dtype} for both engines). Workload: {args.num_requests} requests, prompts "
          f"32-512 random tokens, outputs 16-256 tokens (seed {args.seed}, ignore_eos, greedy); transformers "
          f"runs the same weights as a dense Hugging Face model (SDPA attention). transformers "
          f"one-at-a-time ran the first {args.hf_sequential} requests, padded batches the first "
          f"{args.hf_batched}.\n\n{table}\n\nBounds measured in the same run: copy bandwidth "
          f"{bounds['copy_bandwidth_gb_s']:.1f} GB/s, {args.dtype} matmul "
          f"{bounds['matmul_gflop_s'][args.dtype]:.0f} GFLOP/s (256x1536 @ 1536x4096).\n")
    save(args.name, {"args": vars(args), "machine": info, "git": git_rev(), "bounds": bounds,
                     "throughput": rows, "decode_step": step_rows}, md)


if __name__ == "__main__":
    main()
