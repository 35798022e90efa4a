"""The serving dashboard's data: the server's Prometheus registry read once a second into a bounded history,
turned into the time series the web page draws (the JSON of GET /api/dashboard).

What each series is, as a Prometheus query would put it (names without the `kvserve:` prefix):
  num_requests_running, num_requests_waiting, kv_cache_usage_perc   the gauges, as read
  generation_tokens_per_s, prompt_tokens_per_s      rate(..._tokens_total[RATE_WINDOW_S])
  prefix_cache_hit_rate                             increase(hits) / increase(queries) over DISTRIBUTION_WINDOW_S
  ttft_p50_s ... itl_p99_s                          histogram_quantile(q, increase(..._bucket[DISTRIBUTION_WINDOW_S]))
  num_preemptions_total                             the counter, as read
  spec_decode_acceptance_rate                       increase(accepted) / increase(draft tokens), only once the
                                                    engine exports vLLM's spec_decode_* counters
and `replicas`, per value of a `replica` label on the gauges (none until replicas exist), the same three
gauges per replica. A series whose metrics are absent is left out, so the page hides its chart.
A point is null where its window saw nothing to measure (no requests, no prefix lookups).
`totals` are the registry's samples at the moment of the request (all but histogram buckets), under their
/metrics names and summed over their labels."""
from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Callable

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
RATES = {"generation_tokens_per_s": "generation_tokens_total", "prompt_tokens_per_s": "prompt_tokens_total"}
RATIOS = {  # series: (numerator counter, denominator counter)
    "prefix_cache_hit_rate": ("prefix_cache_hits_total", "prefix_cache_queries_total"),
    "spec_decode_acceptance_rate": ("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"),
}
LATENCIES = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds"}
CUMULATIVE = ("num_preemptions_total",)

Point = float | None


class MetricsHistory:
    """The last KEEP_S seconds of registry readings. Owned by one server; `run` samples until cancelled."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = INTERVAL_S, keep_s: float = KEEP_S,
                 clock: Callable[[], float] | None = None) -> None:
        self.registry, self.interval_s, self.keep_s = registry, interval_s, keep_s
        self._clock = clock
        self._samples: deque[RegistrySample] = deque(maxlen=int(keep_s / interval_s) + 1)

    def read(self) -> RegistrySample:
        return read_registry(self.registry, self._clock() if self._clock else None)

    def sample(self) -> RegistrySample:
        s = self.read()
        self._samples.append(s)
        return s

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def dashboard(self, window_s: float | None = None) -> dict:
        """The page's JSON: the kept readings within `window_s` of now, plus a reading taken now (so the
        newest point and `totals` are current, not up to a second old)."""
        window_s = self.keep_s if window_s is None else min(window_s, self.keep_s)
        now = self.read()
        # Readings older than the window still feed the first points' trailing windows.
        lookback = window_s + DISTRIBUTION_WINDOW_S
        history = [s for s in self._samples if now.t - lookback <= s.t < now.t] + [now]
        first_shown = bisect.bisect_left([s.t for s in history], now.t - window_s)
        return {
            "object": "dashboard",
            "interval_s": self.interval_s,
            "window_s": window_s,
            "rate_window_s": RATE_WINDOW_S,
            "distribution_window_s": DISTRIBUTION_WINDOW_S,
            "time": [s.t for s in history[first_shown:]],
            "series": {k: v[first_shown:] for k, v in build_series(history).items()},
            "replicas": {r: {k: v[first_shown:] for k, v in series.items()}
                         for r, series in build_replica_series(history).items()},
            "totals": dict(sorted(now.values.items())),
        }


def _name(short: str) -> str:
    return PREFIX + short


def _start_of(times: list[float], i: int, window_s: float) -> int | None:
    """Index of the earliest reading within `window_s` before reading i; None if there is none before i."""
    j = bisect.bisect_left(times, times[i] - window_s - 1e-6)
    return j if j < i else None


def build_series(history: list[RegistrySample]) -> dict[str, list[Point]]:
    times = [s.t for s in history]
    latest = history[-1]
    out: dict[str, list[Point]] = {}
    for g in GAUGES + CUMULATIVE:
        if _name(g) in latest.values:
            out[g] = [s.values.get(_name(g)) for s in history]
    for series, counter in RATES.items():
        if _name(counter) in latest.values:
            out[series] = [_rate(history, times, i, _name(counter)) for i in range(len(history))]
    for series, (num, den) in RATIOS.items():
        if _name(num) in latest.values and _name(den) in latest.values:
            out[series] = [_ratio(history, times, i, _name(num), _name(den)) for i in range(len(history))]
    for short, family in LATENCIES.items():
        if _name(family) in latest.histograms:
            per_point = [_quantiles(history, times, i, _name(family)) for i in range(len(history))]
            for k, q in enumerate(QUANTILES):
                out[f"{short}_p{round(q * 100)}_s"] = [p[k] if p else None for p in per_point]
    return out


def build_replica_series(history: list[RegistrySample]) -> dict[str, dict[str, list[Point]]]:
    out: dict[str, dict[str, list[Point]]] = {}
    for replica, gauges in sorted(history[-1].replicas.items()):
        out[replica] = {g: [s.replicas.get(replica, {}).get(_name(g)) for s in history]
                        for g in GAUGES if _name(g) in gauges}
    return out


def _rate(history: list[RegistrySample], times: list[float], i: int, name: str) -> Point:
    j = _start_of(times, i, RATE_WINDOW_S)
    # Just after start-up the only earlier reading may be milliseconds old: too short to be a rate.
    if j is None or times[i] - times[j] < MIN_RATE_SPAN_S:
        return None
    return (history[i].values.get(name, 0.0) - history[j].values.get(name, 0.0)) / (times[i] - times[j])


def _ratio(history: list[RegistrySample], times: list[float], i: int, num: str, den: str) -> Point:
    j = _start_of(times, i, DISTRIBUTION_WINDOW_S)
    if j is None:
        return None
    d = history[i].values.get(den, 0.0) - history[j].values.get(den, 0.0)
    if d <= 0:
        return None
    return (history[i].values.get(num, 0.0) - history[j].values.get(num, 0.0)) / d


def _quantiles(history: list[RegistrySample], times: list[float], i: int, family: str) -> list[Point] | None:
    j = _start_of(times, i, DISTRIBUTION_WINDOW_S)
    if j is None or family not in history[j].histograms:
        return None
    window = history[i].histograms[family].minus(history[j].histograms[family])
    if window.count <= 0:
        return None
    return [histogram_quantile(q, window) for q in QUANTILES]
