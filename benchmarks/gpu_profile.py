"""Where a decode step's time goes on a GPU (issue 12): the captured graph's replay alone (CUDA events), the
whole engine step around it, the host's share by function (cProfile), and the GPU's kernels in an eager
step (torch.profiler). Same random-weight Qwen3-0.6B checkpoint and decode setup as benchmarks/gpu.py.

    python benchmarks/gpu_profile.py [--batch-sizes 1,64] [--decode-context 1024]   # needs CUDA
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu import QWEN3_06B, build_checkpoint, start_decoding
from kvserve import LLM
from kvserve.worker.cuda_graphs import padded_size


def replay_ms(graphs, size: int, n: int = 50) -> float:
    """The graph alone, inputs as the last step left them: GPU time per replay."""
    g = graphs.graphs[size]
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def step_ms(engine, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--decode-context", type=int, default=1024)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_profile.py needs an NVIDIA GPU")
    device = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(device)}", flush=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(QWEN3_06B, path, torch.bfloat16, device)
        llm = LLM(model=str(path), dtype="bfloat16", device="cuda", max_num_seqs=max(sizes),
                  max_num_batched_tokens=16384, max_model_len=2 * args.decode_context + 256)
        engine = llm.engine
        graphs = engine.runner.graphs
        for b in sizes:
            ids = start_decoding(engine, b, args.decode_context, 400)
            size = padded_size(b, graphs.sizes)
            rows = {"replay_ms": replay_ms(graphs, size), "step_graphs_ms": step_ms(engine, 30)}
            engine.runner.graphs = None
            rows["step_eager_ms"] = step_ms(engine, 10)
            engine.runner.graphs = graphs
            print(f"batch {b} (graph size {size}): {rows}", flush=True)

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(30):
                engine.step()
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            print(f"--- host profile, 30 graph steps, batch {b} (tottime)\n{s.getvalue()}", flush=True)

            engine.runner.graphs = None
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as p:
                for _ in range(3):
                    engine.step()
                torch.cuda.synchronize()
            engine.runner.graphs = graphs
            print(f"--- kernels, 3 eager steps, batch {b}\n"
                  + p.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60),
                  flush=True)
            print(f"--- host ops, 3 eager steps, batch {b}\n"
                  + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60),
                  flush=True)
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()


if __name__ == "__main__":
    main()
