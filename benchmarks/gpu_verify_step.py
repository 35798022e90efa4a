"""What a decode or verification step costs on a GPU, by shape, from the engine's own captured graphs (CUDA
only): the GPU time of one replay (the mean over back-to-back replays, timed with CUDA events) and the wall time of one
StepGraphs.run (inputs padded and copied, the replay, logits gathered), for 1, 2 and 4 sequences (--sizes) of
one token (decode) or 1 + k tokens (verification, captured up to 4 sequences) at a given context length, and
what the engine's BLAS choice measured for each shape's candidates when it captured them.

    python benchmarks/gpu_verify_step.py                      # the default model, float32, context 448, k 4
    python benchmarks/gpu_verify_step.py --no-verify-split    # verification rows' attention left unsplit
    python benchmarks/gpu_verify_step.py --blas preferred     # every graph with torch's BLAS preference
    python benchmarks/gpu_verify_step.py --sizes 1 4 8 16 32  # decode at more sequences too (captured sizes only)

The sequences read the same blocks, and their new tokens write nothing (slot -1): the attention reads and
the matmuls are a real step's; the cache writes, a few hundred bytes, are left out.
"""
from __future__ import annotations

import argparse

import torch
from common import BLAS_CHOICES, median_seconds, report, use_blas

from kvserve import LLM
from kvserve.attention.triton import backend as triton_backend
from kvserve.worker.cuda_graphs import StepInputs


def inputs_for(size: int, width: int, context: int, block_size: int) -> StepInputs:
    table = list(range(1, -(-context // block_size) + 1))
    first = context - width
    return StepInputs([11] * (size * width), [first + j for _ in range(size) for j in range(width)],
                      [-1] * (size * width), [width] * size, [context] * size, [table] * size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=448, help="tokens in each sequence, its new ones included")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens: verification rows of 1 + k")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4],
                    help="sequences per step (verification steps only up to 4, as captured)")
    ap.add_argument("--no-verify-split", action="store_true",
                    help="split-KV for decode steps only, as before verification steps could split")
    ap.add_argument("--blas", choices=BLAS_CHOICES, default="choose", help="the graphs' BLAS library (common.use_blas)")
    ap.add_argument("--name", default="gpu_verify_step")
    args = ap.parse_args()
    use_blas(args.blas)
    if args.no_verify_split:
        triton_backend.SPLIT_MAX_QUERY_LEN = 1
    llm = LLM(dtype=args.dtype, max_num_seqs=max(4, *args.sizes), kv_cache_memory=512 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                  "disable_by_batch_size": 4})
    runner = llm.engine.runner
    graphs, bs = runner.graphs, runner.block_size
    assert graphs is not None, "needs CUDA graphs (a GPU, without --enforce-eager)"
    results, lines = {}, ["| sequences | tokens each | BLAS | GPU ms per replay | run() wall ms | x one decode token "
                          "| at capture, ms per replay by library |", "|---:|---:|---|---:|---:|---:|---|"]
    base = None
    for width in graphs.widths:
        for size in args.sizes:
            shape = (size, width)
            if shape not in graphs.graphs:
                print(f"{size} x {width}: not a captured shape, skipped")
                continue
            inputs = inputs_for(size, width, args.context, bs)
            graphs.load(inputs, shape)
            for _ in range(10):
                graphs.replay(shape)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                graphs.replay(shape)
            end.record()
            end.synchronize()
            gpu_ms = start.elapsed_time(end) / args.repeats
            # As a step reads its tokens back.
            wall_ms = 1000 * median_seconds(lambda: graphs.run(inputs, shape)[1].argmax(-1).tolist(), args.repeats)
            if shape == (1, 1):  # the column's unit: one decode token (n/a where --sizes leaves 1 out)
                base = gpu_ms
            blas, capture_ms = graphs.blas[shape], graphs.blas_ms[shape]
            results[f"{size}x{width}"] = {"gpu_ms": gpu_ms, "run_wall_ms": wall_ms, "blas": blas,
                                          "capture_ms": capture_ms}
            at_capture = ", ".join(f"{name} {t:.3f}" for name, t in capture_ms.items()) or "one library"
            ratio = f"{gpu_ms / base:.2f}" if base else "n/a"
            lines.append(f"| {size} | {width} | {blas} | {gpu_ms:.3f} | {wall_ms:.3f} | {ratio} | {at_capture} |")
    setup = (f"GPU: {torch.cuda.get_device_name()}; the default model, {args.dtype}; context {args.context} "
             f"tokens per sequence; verification attention {'unsplit' if args.no_verify_split else 'split-KV'}; "
             f"BLAS per graph: {args.blas}; "
             f"{args.repeats} replays per shape (run() wall: the median).")
    report(args.name, "Decode and verification steps on a GPU", args, setup, "\n".join(lines), results,
           script="gpu_verify_step")


if __name__ == "__main__":
    main()
