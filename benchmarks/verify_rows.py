"""What each extra row of a speculative verification step costs on this machine, part by part.

A decode step at one stream computes one row (token); a step verifying k drafts computes 1 + k rows of the
same sequence. Where the step is memory-bound, the extra rows ride along with the weights already read;
where the matmuls are compute-bound (two AVX2 cores) each row costs its own multiply-adds. This times the
parts of a step of the default model (SmolLM2-135M-Instruct, its Q4_1 weights kept quantized) at 1 to 9
rows, with the engine's own kernels, weights and activation dtype:

  matmuls    the decoder stack's 120 projections (qkv, o, gate_up, down in each of 30 layers)
  lm_head    the logits of every row (the tied embedding, 49152 x 576)
  attention  paged attention of every row over --context tokens of one sequence, 30 layers, each its own
             cache (bfloat16, the engine's choice on a CPU)

The three run in that order in every repetition, as in a step, each timed on its own: so the LM head's
30 MB come from DRAM after the stack's 66 MB have passed, not from a cache that a loop of it alone keeps warm.

Beside them, in the same rounds, the engine's whole step at each row count: one sequence at that context,
its step carrying rows - 1 drafts (norms, rotary, KV writes, verification, sampling and the runner's Python
included), what the draft-length rule weighs. The row counts take turns within each of --rounds rounds, and
the table gives each part's fastest round (this host's speed drifts; the fastest round is the least
disturbed) and the median.

    python benchmarks/verify_rows.py                 # results/verify_rows_<isa>.{json,md}
    KVSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/verify_rows.py --name verify_rows_avx2_forced
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

WEIGHTS_PER_LAYER = 14                    # kvserve/kernels/cpu/decoder_stack.cpp's order
PROJECTIONS = {"qkv": 1, "o": 4, "gate_up": 8, "down": 11}  # index of each projection's quantized weight


def layout(layer) -> str:
    """How a linear layer's weight is stored, e.g. "q4 in 16-row tiles"."""
    segments = getattr(layer, "segments", None) or []
    return "/".join(f"{s.layout} in {s.tile}-row tiles" for s in segments) or "float"


def timed_in_turn(parts: dict, repeat: int) -> dict[str, float]:
    """Mean seconds of each part, the parts called one after another, repeat times (after one untimed pass)."""
    for fn in parts.values():
        fn()
    seconds = dict.fromkeys(parts, 0.0)
    for _ in range(repeat):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            seconds[name] += time.perf_counter() - t0
    return {name: t / repeat for name, t in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 5, 9])
    ap.add_argument("--context", type=int, default=400, help="tokens each row attends to (a copy's ~300-token "
                    "prompt plus its output so far)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=20, help="calls per timing")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the engine step's request: 0 verifies greedily, as speculative.py's runs do (before "
                         "git 41a16e8 this script's request sampled at 1.0, which verifies each row by rejection "
                         "sampling over its full softmax)")
    ap.add_argument("--name", default=None, help="results/<name>.{json,md} (default: verify_rows_<the kernels' ISA>)")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("verify_rows.py times the native CPU kernels, and none are built here")

    llm = LLM()
    model = llm.engine.runner.model
    stack = model.native_stack
    if stack is None:
        raise SystemExit("the default model did not get the native decoder stack here")
    ops = cpu_kernels.ops()
    w = stack.weights
    layers = len(model.layers)
    hidden = model.config.hidden_size
    attn = model.layers[0].self_attn
    heads, kv_heads, head_dim = attn.num_heads, model.config.num_key_value_heads, model.config.head_dim
    act = w[0].dtype  # the activations' dtype in the engine's steps (its norms' weights are in it)

    def projection(layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        i = layer * WEIGHTS_PER_LAYER + PROJECTIONS[name]
        qs, scales, mins = w[i], w[i + 1], w[i + 2]
        op = ops.quant_linear_x16 if qs.dim() == 4 else ops.quant_linear_x8
        return op(x, qs, scales, mins)

    # One sequence's K/V in every layer: --context tokens in blocks of 16, scattered as a pool hands them out.
    bs = 16
    num_blocks = (args.context + bs - 1) // bs
    k_caches = [torch.randn(kv_heads, 4 * num_blocks, bs, head_dim).to(torch.bfloat16) for _ in range(layers)]
    v_caches = [torch.randn_like(k) for k in k_caches]
    table = torch.randperm(4 * num_blocks)[:num_blocks].view(1, -1).contiguous()
    scale = head_dim ** -0.5

    def parts(r: int) -> dict:
        x = {n: torch.randn(r, hidden if n != "down" else model.config.intermediate_size).to(act)
             for n in PROJECTIONS}
        h = torch.randn(r, hidden).to(act)
        q = torch.randn(r, heads, head_dim).to(act)
        out = torch.empty_like(q)
        row_token = torch.arange(r)
        row_seq = torch.zeros(r, dtype=torch.int64)
        row_len = torch.arange(args.context - r + 1, args.context + 1)  # causal: row i sees one more key

        def matmuls() -> None:
            for layer in range(layers):
                for name in PROJECTIONS:
                    projection(layer, name, x[name])

        def attention() -> None:
            for k_cache, v_cache in zip(k_caches, v_caches):
                ops.paged_attention_(q, out, k_cache, v_cache, row_token, row_seq, row_len, table, scale, 0)

        return {"matmuls": matmuls, "lm_head": lambda: model.compute_logits(h), "attention": attention}

    # The engine's own step at each row count: one sequence at --context tokens, and the runner executing a
    # step that carries r - 1 drafts for it (norms, rotary, KV writes, the logits of every row, sampling and
    # the runner's Python included, which the parts leave out). Its state is not advanced: every call writes
    # the same positions again.
    engine = llm.engine
    engine.add_request("verify-rows", torch.randint(1000, 20000, (args.context,)).tolist(),
                       SamplingParams(temperature=args.temperature, max_tokens=max(args.rows) + 2,
                                      ignore_eos=True))
    engine.step()  # the prompt
    (seq,) = engine.scheduler.running
    if not engine.block_manager.allocate(seq, max(args.rows)):  # room for the largest step's positions
        raise SystemExit("no KV blocks for the engine's steps")

    def engine_step(r: int):
        drafts = {seq.seq_id: [seq.token_ids[-1]] * (r - 1)} if r > 1 else {}
        sched = SchedulerOutput(scheduled=[(seq, r)], spec_token_ids=drafts, num_batched_tokens=r)
        return lambda: engine.runner.execute(sched)

    fns = {r: parts(r) for r in args.rows}
    steps = {r: engine_step(r) for r in args.rows}
    step_times: dict[int, list[float]] = {r: [] for r in args.rows}
    times: dict[int, dict[str, list[float]]] = {r: {p: [] for p in fns[r]} for r in args.rows}
    with torch.inference_mode():
        for k in range(args.rounds):
            for r in args.rows:
                for part, t in timed_in_turn(fns[r], args.repeat).items():
                    times[r][part].append(t)
            for r, t in timed_in_turn(steps, args.repeat).items():
                step_times[r].append(t)
            print(f"round {k}: " + ", ".join(
                f"{r} rows {1e3 * sum(times[r][p][-1] for p in times[r]):.2f} ms (engine {1e3 * step_times[r][-1]:.2f})"
                for r in args.rows), flush=True)

    best = {r: {p: min(v) for p, v in times[r].items()} for r in args.rows}
    median = {r: {p: statistics.median(v) for p, v in times[r].items()} for r in args.rows}
    first = args.rows[0]
    step_best = {r: min(v) for r, v in step_times.items()}
    step_median = {r: statistics.median(v) for r, v in step_times.items()}
    lines = ["| rows | matmuls ms | lm_head ms | attention ms | sum ms | x 1 row | each row beyond the first, ms "
             "(matmuls / lm_head / attention) | sum, medians ms | engine step ms | x 1 row | each row beyond the "
             "first, of a 1-row step | engine step, medians ms |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    results = {}
    for r in args.rows:
        b = best[r]
        total, total_first = sum(b.values()), sum(best[first].values())
        extra = "" if r == first else " / ".join(f"{1e3 * (b[p] - best[first][p]) / (r - first):.2f}" for p in b)
        lines.append(f"| {r} | {1e3 * b['matmuls']:.2f} | {1e3 * b['lm_head']:.2f} | {1e3 * b['attention']:.2f} | "
                     f"{1e3 * total:.2f} | {total / total_first:.2f} | {extra} | "
                     f"{1e3 * sum(median[r].values()):.2f} | {1e3 * step_best[r]:.2f} | "
                     f"{step_best[r] / step_best[first]:.2f} | "
                     + ("" if r == first else f"{(step_best[r] / step_best[first] - 1) / (r - first):.3f}")
                     + f" | {1e3 * step_median[r]:.2f} |")
        results[str(r)] = {"best_s": b, "median_s": median[r], "all_s": times[r],
                           "engine_step_best_s": step_best[r], "engine_step_median_s": step_median[r],
                           "engine_step_all_s": step_times[r]}
    setup = (f"Model: the default SmolLM2-135M-Instruct (the file's blocks kept: projections "
             f"{layout(model.layers[0].mlp.gate_up_proj)}, lm_head {layout(model.lm_head)}), "
             f"{layers} layers, {heads} query / {kv_heads} KV heads of {head_dim}; attention over {args.context} "
             f"tokens, bfloat16 KV cache, {str(act).removeprefix('torch.')} activations. Fastest of {args.rounds} "
             f"rounds of {args.repeat} repetitions (the "
             "columns 'medians': medians), the row counts taking turns in each round. The parts leave out the "
             "norms, rotary, KV writes, sampling and Python of a step; 'engine step' is the engine's whole step "
             "for one sequence at this context carrying rows - 1 drafts (ModelRunner.execute: the forward, the "
             "logits of every row, verification and sampling), timed in the same rounds.")
    report(args.name or f"verify_rows_{cpu_kernels.isa()}", "Cost of a verification step's rows, part by part", args,
           setup, "\n".join(lines), results, script="verify_rows")


if __name__ == "__main__":
    main()
