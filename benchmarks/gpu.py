"""kvserve on an NVIDIA GPU, in one run (issue 12's benchmark):

- decode step time at batch 1, 16, 64, 256 with CUDA graphs and eagerly, Triton attention and the torch
  fallback side by side, against the HBM bound: (weight bytes + KV bytes read) / the copy bandwidth
  measured in this run;
- offline throughput on nano-vllm's shape (256 sequences, prompt and output lengths uniform in 100-1024,
  random token ids) against transformers' own batched `generate` on the same GPU.

The model is a random-weight checkpoint of Qwen3-0.6B's shape (`--shape llama3.2-1b`: Llama-3.2-1B's), built
here with transformers (bf16).

    python benchmarks/gpu.py            # needs CUDA; writes benchmarks/results/gpu.{json,md}
    python benchmarks/gpu.py --tiny     # a tiny shape and workload: runs on the CPU too (eager, torch
                                        # attention there), to exercise the script; writes gpu_tiny.*
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from common import git_rev, machine_info, save
from kvserve import LLM, SamplingParams

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
# --shape: (transformers architecture, shape)
SHAPES = {"qwen3-0.6b": ("qwen3", QWEN3_06B), "llama3.2-1b": ("llama", LLAMA32_1B)}
NAMES = {"qwen3-0.6b": "Qwen3-0.6B", "llama3.2-1b": "Llama-3.2-1B"}


def build_checkpoint(shape: dict, path: Path, dtype: torch.dtype, device: torch.device, arch: str = "qwen3") -> None:
    """Random weights of a Qwen3 or Llama shape, saved with transformers, and a byte-level tokenizer (prompts
    are token ids here; the engine only needs one to load). Initialised on `device`: far faster on a GPU."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    cfg = config_cls(**shape, bos_token_id=256, eos_token_id=257)
    with device:
        model = model_cls(cfg).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second moved by a device-to-device copy (read + write), best of 10."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def make_llm(path: Path, backend: str, args, device: torch.device) -> LLM:
    kw = dict(dtype=args.dtype, device=str(device), attention_backend=backend, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager)
    if device.type != "cuda":
        kw["kv_cache_memory"] = 256 * 2**20
    return LLM(model=str(path), **kw)


def start_decoding(engine, batch: int, ctx: int, max_tokens: int) -> list[str]:
    """`batch` sequences of ctx random tokens, stepped until every one is decoding; their request ids."""
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(ctx)],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    engine.step()
    return ids


def decode_steps(llm: LLM, batch: int, ctx: int, steps: int, device: torch.device, graphs: bool) -> float:
    """Mean seconds of one decode step with `batch` sequences at ~ctx tokens of context each."""
    engine = llm.engine
    saved = engine.runner.graphs
    if not graphs:
        engine.runner.graphs = None  # the same engine, every step eager
    ids = start_decoding(engine, batch, ctx, steps + 8)
    engine.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.graphs = saved
    return dt


def model_bytes(llm: LLM) -> tuple[int, int]:
    """(weight bytes read per step, KV bytes per token of context across all layers)."""
    model = llm.engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied matrix counts once
    mc = llm.engine.model_config
    if not mc.tie_word_embeddings:  # an untied embedding table is gathered (B rows), not streamed
        weights -= sum(p.numel() * p.element_size() for p in model.embed_tokens.parameters())
    kv_elem = torch.empty((), dtype=llm.engine.kv_cache_dtype).element_size()
    return weights, mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * kv_elem


def nano_vllm_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def run_kvserve(llm: LLM, prompts, outputs, device: torch.device) -> dict:
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    dt = time.perf_counter() - t0
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    assert n_out == sum(outputs)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt}


@torch.inference_mode()
def run_transformers(path: Path, prompts, outputs, batch_size: int, dtype: torch.dtype,
                     device: torch.device) -> dict:
    """transformers' own generate, left-padded batches in arrival order, each run to its longest output;
    only the tokens each request asked for count."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    sync(device)
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
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(ms),
                       min_new_tokens=max(ms), do_sample=True, temperature=0.6, pad_token_id=0)
        n_out += sum(ms)
    sync(device)
    dt = time.perf_counter() - t0
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "batch_size": batch_size}


def markdown(r: dict) -> str:
    lines = [f"# kvserve on {r['gpu'] or 'CPU (--tiny)'}", "",
             f"git {r['git']}; model: random weights, {r['model_shape']} shape, {r['dtype']}; copy bandwidth "
             f"{r['copy_bandwidth_gb_s']:.0f} GB/s (measured in this run); context {r['decode_context']} tokens.", "",
             "## Decode step (ms)", "",
             "| batch | Triton + graphs | Triton eager | torch eager | HBM bound | graphs / bound |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b, row in r["decode_step"].items():
        if "hbm_bound_ms" not in row:  # not reached (see the failed parts below)
            continue
        g = row.get("graphs_ms")
        ratio = f"{g / row['hbm_bound_ms']:.2f}x" if g else "-"
        fmt = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
        lines.append(f"| {b} | {fmt(g)} | {fmt(row.get('eager_ms'))} | {fmt(row.get('torch_eager_ms'))} | "
                     f"{row['hbm_bound_ms']:.3f} | {ratio} |")
    t = r["throughput"]
    lines += ["", f"## Offline throughput ({t['workload']})", "",
              "| engine | output tok/s | seconds |", "|---|---:|---:|"]
    for name in ("kvserve", "kvserve_torch_attention", "transformers"):
        if name in t:
            lines.append(f"| {name} | {t[name]['output_tok_s']:.0f} | {t[name]['seconds']:.1f} |")
    if "kvserve" in t and "transformers" in t:
        ratio = t["kvserve"]["output_tok_s"] / t["transformers"]["output_tok_s"]
        lines += ["", f"kvserve / transformers: {ratio:.1f}x"]
    if r.get("errors"):
        lines += ["", "## Parts that failed", ""] + [f"- {k}: `{v.splitlines()[0][:300]}`" for k, v in r["errors"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and workload; also runs on the CPU")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES),
                    help="the random checkpoint's shape (nano-vllm's benchmark uses Qwen3-0.6B)")
    ap.add_argument("--batch-sizes", default=None, help="decode batch sizes (default 1,16,64,256; tiny 1,4)")
    ap.add_argument("--decode-context", type=int, default=None, help="context of each decode row (default 1024)")
    ap.add_argument("--num-seqs", type=int, default=None, help="throughput sequences (default 256)")
    ap.add_argument("--hf-batch-size", type=int, default=64, help="transformers generate batch size")
    ap.add_argument("--skip-torch-attention", action="store_true", help="leave out the torch-backend rows")
    ap.add_argument("--skip-transformers", action="store_true", help="leave out transformers' throughput")
    ap.add_argument("--name", default=None, help="results file name (default gpu, or gpu_tiny)")
    ap.add_argument("--torch-throughput", action="store_true",
                    help="also the offline throughput with torch attention (default: its decode-step rows only)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        sys.exit("benchmarks/gpu.py needs an NVIDIA GPU: torch.cuda.is_available() is False here. "
                 "(`--tiny` runs the script's code paths on a tiny shape on the CPU.)")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"GPU: {gpu or 'none (--tiny on the CPU)'}", flush=True)
    tiny = args.tiny
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,4" if tiny else "1,16,64,256")).split(",")]
    ctx = args.decode_context or (48 if tiny else 1024)
    n_seqs = args.num_seqs or (8 if tiny else 256)
    lo, hi = (16, 48) if tiny else (100, 1024)
    args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    args.enforce_eager = False
    args.max_num_seqs = max(max(batch_sizes), n_seqs)
    args.max_num_batched_tokens = 256 if tiny else 16384
    args.max_model_len = 2 * hi + 16 if not tiny else 128
    torch_dtype = getattr(torch, args.dtype)
    backends = ["triton"] if device.type == "cuda" else []
    if not args.skip_torch_attention:
        backends.append("torch")

    result = {"gpu": gpu, "machine": machine_info(), "git": git_rev(), "dtype": args.dtype,
              "model_shape": "tiny Qwen3" if tiny else NAMES[args.shape], "decode_context": ctx,
              "decode_step": {str(b): {} for b in batch_sizes}, "throughput": {}, "errors": {}}
    name = args.name or ("gpu_tiny" if tiny else "gpu" if args.shape == "qwen3-0.6b" else f"gpu_{args.shape}")

    def section(key: str, fn) -> None:
        """One measurement; a failure is recorded and the run goes on (a GPU lease is short: one broken
        part must not cost the others). Results are saved after each one."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded in the results, printed with its traceback
            traceback.print_exc()
            result["errors"][key] = f"{type(e).__name__}: {e}"[:2000]
        print(f"[{key}: {time.perf_counter() - t0:.1f} s]", flush=True)
        save(name, result, markdown(result))

    bw = copy_bandwidth(device, (64 if tiny else 1024) * 2**20)
    result["copy_bandwidth_gb_s"] = bw / 1e9
    if device.type == "cuda":
        result["cuda"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                          "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)}
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)

    arch, shape = ("qwen3", TINY) if tiny else SHAPES[args.shape]
    prompts, outputs = nano_vllm_workload(n_seqs, lo, hi, shape["vocab_size"])
    result["throughput"]["workload"] = f"{n_seqs} sequences, prompt and output uniform in {lo}-{hi} tokens"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(shape, path, torch_dtype, device, arch)
        for backend in backends:
            holder = {}

            def load() -> None:
                try:
                    holder["llm"] = make_llm(path, backend, args, device)
                except Exception:  # CUDA graphs (or the KV sizing around them) failed: the eager rows still count
                    if device.type != "cuda" or args.enforce_eager:
                        raise
                    traceback.print_exc()
                    args.enforce_eager = True
                    holder["llm"] = make_llm(path, backend, args, device)
                    args.enforce_eager = False
                    raise RuntimeError("loading with CUDA graphs failed (traceback above); loaded eagerly")
            section(f"load {backend}", load)
            llm = holder.get("llm")
            if llm is None:
                continue
            weights, kv_per_token = model_bytes(llm)
            has_graphs = llm.engine.runner.graphs is not None
            for b in batch_sizes:
                def decode(b: int = b) -> None:
                    row = result["decode_step"][str(b)]
                    row["hbm_bound_ms"] = 1e3 * (weights + b * ctx * kv_per_token) / bw
                    if backend == "triton":
                        row["graphs_ms"] = 1e3 * decode_steps(llm, b, ctx, 20, device, True) if has_graphs else None
                        row["eager_ms"] = 1e3 * decode_steps(llm, b, ctx, 20, device, False)
                    else:
                        row["torch_eager_ms"] = 1e3 * decode_steps(llm, b, ctx, 10 if tiny else 20, device, False)
                    print(f"decode batch {b} ({backend}): {row}", flush=True)
                section(f"decode {backend} b={b}", decode)
            if backend == backends[0] or args.torch_throughput:
                key = "kvserve" if backend == backends[0] else f"kvserve_{backend}_attention"

                def throughput() -> None:
                    result["throughput"][key] = run_kvserve(llm, prompts, outputs, device)
                    print(f"throughput {key}: {result['throughput'][key]}", flush=True)
                section(f"throughput {key}", throughput)
            del llm, holder
            if device.type == "cuda":
                torch.cuda.empty_cache()

        def hf() -> None:
            result["throughput"]["transformers"] = run_transformers(path, prompts, outputs, args.hf_batch_size,
                                                                    torch_dtype, device)
            print(f"throughput transformers: {result['throughput']['transformers']}", flush=True)
        if not args.skip_transformers:
            section("throughput transformers", hf)

    print(markdown(result))


if __name__ == "__main__":
    main()
