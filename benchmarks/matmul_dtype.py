"""bf16 vs fp32 GFLOP/s of F.linear at the default model's (SmolLM2-135M) shapes, to back the CPU
"auto" dtype choice in kvserve/utils/device.py.

    python benchmarks/matmul_dtype.py [--threads N] [--seconds S]

Writes benchmarks/results/matmul_dtype.json and .md next to this file."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.utils.cpuinfo import cpu_model_name
from kvserve.utils.device import cpu_has_native_bf16, resolve_dtype

SHAPES = [(576, 1536), (1536, 576), (576, 49152)]  # (in, out): gate/up, down, lm_head
ROWS = [1, 16, 64, 256]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Result:
    in_features: int
    out_features: int
    rows: int
    dtype: str
    median_s: float
    gflops: float


def bench(in_f: int, out_f: int, rows: int, dtype: torch.dtype, seconds: float) -> Result:
    x = torch.randn(rows, in_f).to(dtype)
    w = torch.randn(out_f, in_f).to(dtype)
    for _ in range(3):
        F.linear(x, w)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return Result(in_f, out_f, rows, str(dtype).removeprefix("torch."), med, 2 * rows * in_f * out_f / med / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--seconds", type=float, default=0.25, help="timing budget per configuration")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    results = [
        bench(i, o, r, dt, args.seconds) for (i, o) in SHAPES for r in ROWS for dt in DTYPES.values()
    ]
    machine = {
        "cpu": cpu_model_name(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "auto_dtype": str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
        "load_average_at_start": os.getloadavg(),
    }
    command = "python benchmarks/matmul_dtype.py" + (f" --threads {args.threads}" if args.threads else "")

    by_key = {(r.in_features, r.out_features, r.rows, r.dtype): r for r in results}
    lines = [
        "# bf16 vs fp32 `F.linear` GFLOP/s at SmolLM2-135M shapes",
        "",
        f"Machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs, torch {machine['torch']} "
        f"({machine['torch_threads']} threads, capability {machine['torch_cpu_capability']}, "
        f"native bf16: {machine['native_bf16']}, auto dtype: {machine['auto_dtype']}); "
        f"load average at start {', '.join(f'{x:.1f}' for x in machine['load_average_at_start'])}.",
        "",
        f"Command: `{command}`",
        "",
        "| in -> out | rows | fp32 GFLOP/s | bf16 GFLOP/s | bf16 / fp32 |",
        "|---|---:|---:|---:|---:|",
    ]
    for i, o in SHAPES:
        for r in ROWS:
            f32, b16 = by_key[(i, o, r, "float32")], by_key[(i, o, r, "bfloat16")]
            lines.append(f"| {i} -> {o} | {r} | {f32.gflops:.1f} | {b16.gflops:.1f} | {b16.gflops / f32.gflops:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)

    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "matmul_dtype.json").write_text(
        json.dumps({"command": command, "machine": machine, "results": [asdict(r) for r in results]}, indent=2) + "\n"
    )
    (out / "matmul_dtype.md").write_text(table)


if __name__ == "__main__":
    main()
