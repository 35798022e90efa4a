"""The serving dashboard's data: the server's Prometheus registry read once a second into a bounded history,
turned into the time series the web page draws (the JSON of GET /api/dashboard).

What each series is, as a Prometheus query would put it (names without the `kvserve:` prefix):
  num_requests_running, num_requests_waiting, kv_cache_usage_perc   the gauges, as read
  gateway_queue_requests                            the gateway's queue (all models), as read
  generation_tokens_per_s, prompt_tokens_per_s      rate(..._tokens_total[RATE_WINDOW_S])
  prefix_cache_hit_rate                             increase(hits) / increase(queries) over DISTRIBUTION_WINDOW_S
  ttft_p50_s ... itl_p99_s                          histogram_quantile(q, increase(..._bucket[DISTRIBUTION_WINDOW_S]))
  num_preemptions_total                             the counter, as read
  spec_decode_acceptance_rate                       increase(accepted) / increase(draft tokens), only once the
                                                    engine exports vLLM's spec_decode_* counters
and `replicas`, per engine (a `replica` label on the gauges, "model/replica" with several models; none while
there is only one engine), the same three gauges per replica. A series whose metrics are absent is left out,
so the page hides its chart. A point is null where its window saw nothing to measure (no requests, no prefix lookups).
`totals` are the registry's samples at the moment of the request (all but histogram buckets), under their
/metrics names and summed over their labels (KV-cache usage, a fraction, averaged: registry_sample.py)."""
from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvserve.metrics.prometheus import PREFIX
from kvserve.metrics.registry_sample import RegistrySample, histogram_quantile, read_registry

INTERVAL_S = 1.0              # how often the history reads the registry
KEEP_S = 300.0                # how far back the history reaches (the page's charts span this)
RATE_WINDOW_S = 5.0           # tokens/s: short, so the chart follows load changes within seconds
DISTRIBUTION_WINDOW_S = 60.0  # quantiles and hit rates need enough events to mean something
MIN_RATE_SPAN_S = 0.5
QUANTILES = (0.5, 0.9, 0.99)

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
# Requests admitted and waiting in the gateway's queue for a place in an engine's batch (summed over models).
# An engine takes at most max_num_seqs of them, so under load they wait there and not in the engine: a
# "Waiting" of 0 beside a full queue had hidden them.
QUEUE = "gateway_queue_requests"
RATES = {"generation_tokens_per_s": "generation_tokens_total", "prompt_tokens_per_s": "prompt_tokens_total"}
RATIOS = {  # series: (numerator counter, denominator counter)
    "prefix_cache_hit_rate": ("prefix_cache_hits_total", "prefix_cache_queries_total"),
    "spec_decode_acceptance_rate": ("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"),
}
LATENCIES = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds"}
CUMULATIVE = ("num_preemptions_total",)

Value = float | None


@dataclass(frozen=True)
class DashboardPoint:
    """Every series at one reading. A series is a key only where its metrics exist in the registry."""
    t: float
    series: dict[str, Value]
    replicas: dict[str, dict[str, Value]]    # replica -> gauge -> value


class MetricsHistory:
    """The registry's readings and the points derived from them, for the last KEEP_S seconds. Each point
    depends only on readings up to its own, so it is derived once, when its reading is taken; a request
    then only derives the point for "now". Owned by one server; `run` samples until cancelled."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = INTERVAL_S, keep_s: float = KEEP_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.registry, self.interval_s, self.keep_s = registry, interval_s, keep_s
        self._clock = clock
        # A minute of readings beyond the points kept: the oldest point's trailing window reaches back there.
        self._readings: deque[RegistrySample] = deque(maxlen=int((keep_s + DISTRIBUTION_WINDOW_S) / interval_s) + 1)
        self._points: deque[DashboardPoint] = deque(maxlen=int(keep_s / interval_s) + 1)

    def read(self) -> RegistrySample:
        return read_registry(self.registry, self._clock() if self._clock else None)

    def sample(self) -> DashboardPoint:
        self._readings.append(self.read())
        point = derive_point(list(self._readings))
        self._points.append(point)
        return point

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def dashboard(self, window_s: float | None = None) -> dict:
        """The page's JSON: the kept points within `window_s` of now, plus a point for a reading taken now
        (so the newest point and `totals` are current, not up to a second old)."""
        window_s = self.keep_s if window_s is None else min(window_s, self.keep_s)
        now = self.read()
        recent = [r for r in self._readings if now.t - DISTRIBUTION_WINDOW_S - self.interval_s <= r.t < now.t]
        latest = derive_point(recent + [now])
        points = [p for p in self._points if now.t - window_s <= p.t < now.t] + [latest]
        return {
            "object": "dashboard",
            "interval_s": self.interval_s,
            "window_s": window_s,
            "rate_window_s": RATE_WINDOW_S,
            "distribution_window_s": DISTRIBUTION_WINDOW_S,
            "time": [p.t for p in points],
            # The series that exist now; a point from before a metric existed reads null.
            "series": {k: [p.series.get(k) for p in points] for k in latest.series},
            "replicas": {r: {g: [p.replicas.get(r, {}).get(g) for p in points] for g in gauges}
                         for r, gauges in latest.replicas.items()},
            "totals": dict(sorted(now.values.items())),
        }


def _name(short: str) -> str:
    return PREFIX + short


def derive_point(readings: Sequence[RegistrySample]) -> DashboardPoint:
    """The point of the last reading, from it and the readings before it (in time order)."""
    times = [r.t for r in readings]
    now = readings[-1]
    out: dict[str, Value] = {}
    for g in GAUGES + (QUEUE,) + CUMULATIVE:
        if _name(g) in now.values:
            out[g] = now.values[_name(g)]
    for series, counter in RATES.items():
        if _name(counter) in now.values:
            out[series] = _rate(readings, times, _name(counter))
    for series, (num, den) in RATIOS.items():
        if _name(num) in now.values and _name(den) in now.values:
            out[series] = _ratio(readings, times, _name(num), _name(den))
    for short, family in LATENCIES.items():
        if _name(family) in now.histograms:
            values = _quantiles(readings, times, _name(family))
            for q, v in zip(QUANTILES, values):
                out[f"{short}_p{round(q * 100)}_s"] = v
    replicas = {r: {g: gauges[_name(g)] for g in GAUGES if _name(g) in gauges} for r, gauges in sorted(now.replicas.items())}
    return DashboardPoint(now.t, out, replicas)


def _window_start(times: list[float], window_s: float) -> int | None:
    """Index of the earliest reading within `window_s` before the last; None if there is none before it."""
    i = len(times) - 1
    j = bisect.bisect_left(times, times[i] - window_s - 1e-6)
    return j if j < i else None


def _rate(readings: Sequence[RegistrySample], times: list[float], name: str) -> Value:
    j = _window_start(times, RATE_WINDOW_S)
    # Just after start-up the only earlier reading may be milliseconds old: too short to be a rate.
    if j is None or times[-1] - times[j] < MIN_RATE_SPAN_S:
        return None
    return (readings[-1].values.get(name, 0.0) - readings[j].values.get(name, 0.0)) / (times[-1] - times[j])


def _ratio(readings: Sequence[RegistrySample], times: list[float], num: str, den: str) -> Value:
    j = _window_start(times, DISTRIBUTION_WINDOW_S)
    if j is None:
        return None
    d = readings[-1].values.get(den, 0.0) - readings[j].values.get(den, 0.0)
    if d <= 0:
        return None
    return (readings[-1].values.get(num, 0.0) - readings[j].values.get(num, 0.0)) / d


def _quantiles(readings: Sequence[RegistrySample], times: list[float], family: str) -> list[Value]:
    j = _window_start(times, DISTRIBUTION_WINDOW_S)
    if j is None or family not in readings[j].histograms:
        return [None] * len(QUANTILES)
    window = readings[-1].histograms[family].minus(readings[j].histograms[family])
    if window.count <= 0:
        return [None] * len(QUANTILES)
    return [histogram_quantile(q, window) for q in QUANTILES]
