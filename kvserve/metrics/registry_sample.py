"""One reading of a Prometheus registry, reduced to what a dashboard draws: every gauge, counter and
histogram count/sum summed over its label sets (a gauge that is a fraction, KV-cache usage, averaged over them
instead: three engines 60% full are not 180% full; weighed by their pools' sizes where kvserve:engine_info
gives them, else each engine alike), every histogram's cumulative buckets summed the same way, and the
per-replica split of the gauges where metrics carry a `replica` label (and there are several).
Plus Prometheus's own quantile estimate from buckets.

Reading the registry (rather than keeping counters of our own) is what makes the dashboard agree with
/metrics: both render the same objects."""
from __future__ import annotations

import bisect
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

# Gauges that are each engine's fraction of something (0..1): their label sets are averaged, not summed. KV-cache
# usage is weighed by each engine's pool (the tokens its kvserve:engine_info's blocks hold) where every engine says.
KV_USAGE = "kvserve:kv_cache_usage_perc"
MEAN_GAUGES = frozenset({KV_USAGE})
ENGINE_INFO = "kvserve:engine_info"


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]        # bucket upper bounds, ascending, the last one +Inf
    cumulative: tuple[float, ...]    # observations <= each bound

    def minus(self, earlier: "Histogram") -> "Histogram":
        """Observations made after `earlier` (counters only grow, so this is a histogram again)."""
        assert self.bounds == earlier.bounds, "bucket layout changed between samples"
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative)))

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0


@dataclass(frozen=True)
class RegistrySample:
    t: float                                           # wall-clock seconds (time.time()) of the reading
    values: dict[str, float]                           # every sample but buckets, by its /metrics name
    histograms: dict[str, Histogram]                   # by family name (the part before _bucket)
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> gauge name -> value


def read_registry(registry: CollectorRegistry, t: float | None = None) -> RegistrySample:
    values: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    # (model_name, replica) -> gauge name -> value
    engines: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    label_sets: dict[str, int] = defaultdict(int)   # per MEAN_GAUGES name
    pools: dict[tuple[str, str], float] = {}        # (model_name, replica) -> KV tokens, from kvserve:engine_info
    for family in registry.collect():
        if family.type == "counter" and not family.samples:
            values[family.name + "_total"] = 0.0   # a labelled counter nothing has incremented yet
        for s in family.samples:
            if s.name.endswith("_created"):
                continue            # a timestamp prometheus_client adds beside counters, not a value
            if family.type == "histogram" and s.name.endswith("_bucket"):
                buckets[family.name][float(s.labels["le"])] += s.value
                continue
            if family.type not in ("gauge", "counter", "histogram", "info"):  # info: 1 per labelled engine
                continue
            blocks, block_size = s.labels.get("num_kv_blocks", ""), s.labels.get("block_size", "1")
            if s.name == ENGINE_INFO and blocks.isdigit() and block_size.isdigit():  # a pool's tokens
                pools[(s.labels.get("model_name", ""), s.labels.get("replica", ""))] = float(blocks) * int(block_size)
            values[s.name] += s.value  # gauges, counters, and histograms' _count and _sum
            if s.name in MEAN_GAUGES:
                label_sets[s.name] += 1
            if family.type == "gauge" and "replica" in s.labels:
                engines[(s.labels.get("model_name", ""), s.labels["replica"])][s.name] += s.value
    for name, n in label_sets.items():
        values[name] /= n
    usage = {key: g[KV_USAGE] for key, g in engines.items() if KV_USAGE in g}
    if len(usage) > 1 and all(key in pools for key in usage):  # each engine weighed by its pool's size
        values[KV_USAGE] = sum(u * pools[key] for key, u in usage.items()) / sum(pools[key] for key in usage)
    histograms = {name: Histogram(tuple(sorted(b)), tuple(b[le] for le in sorted(b))) for name, b in buckets.items()}
    return RegistrySample(time.time() if t is None else t, dict(values), histograms, _replicas(engines))


def _replicas(engines: dict[tuple[str, str], dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per replica, named by its `replica` label, or "model/replica" when several models have replicas. One
    engine in all is no split worth showing: then none."""
    if len(engines) < 2:
        return {}
    several_models = len({model for model, _ in engines}) > 1
    return {(f"{model}/{replica}" if several_models else replica): dict(g) for (model, replica), g in engines.items()}


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """Prometheus's histogram_quantile: find the bucket holding rank q * count and interpolate linearly
    inside it (the lowest bucket starts at 0). A rank in the +Inf bucket gives the highest finite bound.
    None when the histogram is empty."""
    assert 0.0 <= q <= 1.0 and h.bounds and math.isinf(h.bounds[-1])
    total = h.count
    if total <= 0:
        return None
    rank = q * total
    b = bisect.bisect_left(h.cumulative, rank)
    if b >= len(h.bounds) - 1:
        return h.bounds[-2] if len(h.bounds) > 1 else None
    upper = h.bounds[b]
    lower = h.bounds[b - 1] if b > 0 else min(0.0, upper)
    below = h.cumulative[b - 1] if b > 0 else 0.0
    in_bucket = h.cumulative[b] - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / in_bucket
