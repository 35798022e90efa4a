"""The engine's metrics as objects, for `LLM.get_metrics()`: what vLLM's offline `LLM.get_metrics()` returns
(vllm.v1.metrics.reader), so code that reads acceptance counts from it carries over with the prefix changed.

They are read from a Prometheus registry that ServerMetrics fed from the engine's stats, so names and labels
are those of the server's /metrics by construction: a counter is named without `_total` (as its family is),
and a counter with a `position` label, the accepted draft tokens by position, comes as one Vector per label
set. Request histograms (time to first token, latencies) and finished requests by reason are the server's,
counted as responses are delivered; an engine's stats hold none of them, so they are not returned.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvserve.engine.core_process import StepResult
from kvserve.engine.stats import EngineStats
from kvserve.metrics.prometheus import ServerMetrics


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]  # [i]: the count at position i


def read_metrics(registry: CollectorRegistry) -> list[Metric]:
    """Every counter and gauge series in the registry (histograms are left out)."""
    out: list[Metric] = []
    for family in registry.collect():
        if family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name.endswith("_total")]  # not the _created timestamps
            if not any("position" in s.labels for s in totals):
                out += [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
                continue
            by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
            for s in totals:
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "position"))
                by_labels.setdefault(rest, {})[int(s.labels["position"])] = int(s.value)
            for rest, counts in by_labels.items():
                out.append(Vector(family.name, dict(rest), [counts.get(i, 0) for i in range(max(counts) + 1)]))
    return out


def engine_metrics(stats: EngineStats, model_name: str) -> list[Metric]:
    """One engine's counters (since it started) and gauges (as of its last step), labelled as the server
    labels a one-model, one-replica engine."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(model_name, registry)
    metrics.on_step(StepResult(outputs=[], errors=[], stats=stats, num_added=0, step_time=0.0, stepped=False))
    # The server counts tokens as it delivers them; offline, the engine's own counts are the same tokens.
    metrics.prompt_tokens.inc(stats.num_prompt_tokens)
    metrics.generation_tokens.inc(stats.num_generation_tokens)
    return read_metrics(registry)
