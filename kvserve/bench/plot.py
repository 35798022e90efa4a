"""Latency-throughput curves from sweep results: one curve per server/setting, one point per
request rate or concurrency, output tok/s on x against TTFT and TPOT (median and p99) on y."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

PANELS = (("ttft_ms", "median", "Median TTFT (ms)"), ("ttft_ms", "p99", "P99 TTFT (ms)"),
          ("tpot_ms", "median", "Median TPOT (ms)"), ("tpot_ms", "p99", "P99 TPOT (ms)"))


def load_results(paths: list[Path]) -> list[dict]:
    out = []
    for p in paths:
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            d = json.loads(f.read_text())
            if isinstance(d, dict) and "metrics" in d and "config" in d:  # skip summaries etc.
                d.setdefault("_file", f.stem)  # names a CDF curve of a run saved without --label
                out.append(d)
    return out


def _stat(dist: dict, which: str) -> float:
    return dist["median"] if which == "median" else dist["percentiles"].get(which, float("nan"))


def plot_curves(results: list[dict], out_png: Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    curves: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        curves[r.get("label") or r["config"]["endpoint"]["base_url"]].append(r)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (metric, which, ylabel) in zip(axes.flat, PANELS):
        for name, runs in sorted(curves.items()):
            runs = sorted(runs, key=lambda r: _point_value(r))
            xs = [r["metrics"]["output_throughput"] for r in runs]
            ys = [_stat(r["metrics"][metric], which) for r in runs]
            ax.plot(xs, ys, marker="o", label=name)
            for x, y, r in zip(xs, ys, runs):
                ax.annotate(_point_label(r), (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        ax.set_xlabel("Output token throughput (tok/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend()
    if title:
        fig.suptitle(title)
    return _save(fig, out_png)


def _point_value(r: dict) -> float:
    sweep = r["config"].get("tags", {}).get("sweep", {})
    v = sweep.get("value")
    return float("inf") if v in ("inf", None) else float(v)


def _point_label(r: dict) -> str:
    sweep = r["config"].get("tags", {}).get("sweep", {})
    if not sweep:
        return ""
    v = sweep.get("value")
    return ("c=" if sweep.get("axis") == "concurrency" else "r=") + (
        f"{v:g}" if isinstance(v, (int, float)) else str(v))


CDF_METRICS = {"ttft": "ttft_s", "e2el": "latency_s"}


def cdf_curve_name(r: dict) -> str:
    """A result's legend entry: its label and sweep point; unlabelled and not a sweep's point (which had
    left the curve without an entry), its file's name."""
    return " ".join(x for x in (r.get("label", ""), _point_label(r)) if x) or r.get("_file", "")


def plot_cdf(results: list[dict], metric: str, out_png: Path, title: str = "") -> Path:
    """Empirical CDF of a per-request latency, one curve per result file (server and point)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    key = CDF_METRICS[metric]
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in sorted(results, key=lambda r: (r.get("label", ""), _point_value(r))):
        vals = np.sort([q[key] * 1e3 for q in r["requests"] if q["success"]])
        if len(vals) == 0:
            continue
        ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=cdf_curve_name(r))
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _save(fig, out_png)


def _save(fig, out_png: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
