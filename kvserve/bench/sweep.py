"""`kvserve bench sweep`: one benchmark per (server, request rate or concurrency), one JSON each, and
latency-throughput curves (kvserve/bench/plot.py) across them."""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.bench.client import IGNORE_EOS_METHODS
from kvserve.bench.launch import launch, wait_ready
from kvserve.bench.plot import plot_curves
from kvserve.bench.report import format_table
from kvserve.bench.serve import BenchResult, ServeConfig, run_benchmark
from kvserve.bench.tokenizer import BenchTokenizer


@dataclass
class ServerSpec:
    name: str
    base_url: str
    model: str | None = None  # None: the sweep's --model
    ignore_eos_via: str | None = None  # None: the sweep's --ignore-eos-via
    launch_cmd: str | None = None  # started before this server's points, stopped after


def parse_server(spec: str) -> ServerSpec:
    """NAME=URL[,model=MODEL][,ignore_eos_via=METHOD]"""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--server {spec!r}: expected NAME=URL[,model=MODEL][,ignore_eos_via=M]")
    url, *opts = rest.split(",")
    server = ServerSpec(name, url)
    for opt in opts:
        k, _, v = opt.partition("=")
        if k == "model" and v:
            server.model = v
        elif k == "ignore_eos_via" and v in IGNORE_EOS_METHODS:
            server.ignore_eos_via = v
        else:
            raise ValueError(f"--server {spec!r}: bad option {opt!r} (model=NAME, "
                             f"ignore_eos_via={'|'.join(IGNORE_EOS_METHODS)})")
    return server


def parse_points(text: str) -> list[float]:
    return [float("inf") if t.strip() == "inf" else float(t) for t in text.split(",") if t.strip()]


@dataclass
class SweepConfig:
    servers: list[ServerSpec]
    axis: str  # "request_rate" or "concurrency"
    points: list[float]
    base: ServeConfig  # everything else; rate/concurrency/label/seed set per point
    result_dir: Path
    prompts_per_concurrency: int = 0  # at concurrency C send max(num_prompts, this * C)
    launch_timeout_s: float = 600.0


def point_config(sw: SweepConfig, server: ServerSpec, index: int, value: float) -> ServeConfig:
    cfg = copy.deepcopy(sw.base)
    ds = replace(cfg.dataset, seed=cfg.dataset.seed + index)  # fresh prompts per point (no
    # prompt-cache hits carried over from the previous point), identical across servers
    if sw.axis == "concurrency":
        cfg.max_concurrency = int(value)
        ds.num_prompts = max(ds.num_prompts, sw.prompts_per_concurrency * int(value))
    else:
        cfg.request_rate = value
    cfg.dataset = ds
    cfg.endpoint = replace(cfg.endpoint, base_url=server.base_url,
                           model=server.model or cfg.endpoint.model,
                           ignore_eos_via=server.ignore_eos_via or cfg.endpoint.ignore_eos_via)
    cfg.label = server.name
    cfg.tags = {**cfg.tags, "sweep": {"server": server.name, "axis": sw.axis,
                                      "value": "inf" if value == float("inf") else value},
                "server_command": server.launch_cmd or ""}
    return cfg


def _point_name(axis: str, value: float) -> str:
    v = "inf" if value == float("inf") else f"{value:g}"
    return f"{'c' if axis == 'concurrency' else 'rate'}{v}"


def run_sweep(sw: SweepConfig, tokenizer: BenchTokenizer) -> list[BenchResult]:
    sw.result_dir.mkdir(parents=True, exist_ok=True)
    results: list[BenchResult] = []
    for server in sw.servers:
        launched = None
        if server.launch_cmd:
            print(f"[sweep] starting {server.name}: {server.launch_cmd}")
            launched = launch(server.name, server.launch_cmd, server.base_url, sw.result_dir,
                              sw.launch_timeout_s)
        else:
            wait_ready(server.base_url, 30.0)
        try:
            for i, value in enumerate(sw.points):
                cfg = point_config(sw, server, i, value)
                res = asyncio.run(run_benchmark(cfg, tokenizer))
                print(format_table(res.metrics, cfg.request_rate, cfg.burstiness,
                                   cfg.max_concurrency, f"{server.name} {_point_name(sw.axis, value)}",
                                   res.spec_decode, res.server))
                res.save(sw.result_dir / f"{server.name}_{_point_name(sw.axis, value)}.json")
                results.append(res)
        finally:
            if launched is not None:
                launched.stop()
    summary = [{"server": r.config.label, **r.config.tags["sweep"],
                "output_throughput": r.metrics.output_throughput,
                "request_throughput": r.metrics.request_throughput,
                "median_ttft_ms": r.metrics.ttft_ms.median,
                "p99_ttft_ms": r.metrics.ttft_ms.percentiles.get("p99"),
                "median_tpot_ms": r.metrics.tpot_ms.median,
                "p99_tpot_ms": r.metrics.tpot_ms.percentiles.get("p99"),
                "acceptance_rate": r.spec_decode.acceptance_rate if r.spec_decode else None,
                "failed": r.metrics.failed} for r in results]
    (sw.result_dir / "sweep_summary.json").write_text(json.dumps(summary, indent=1))
    png = plot_curves([r.to_json() for r in results], sw.result_dir / "sweep.png",
                      title=f"{sw.base.dataset.name} dataset, sweep over {sw.axis}")
    print(f"[sweep] wrote {len(results)} results and {png}")
    return results
