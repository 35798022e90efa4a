"""The server's speculative-decoding counters over a benchmark run, as `vllm bench serve` reports them.

A speculating server's throughput means little without its acceptance: the same method gains 2x on text
the model copies and nothing on open chat. So the benchmark reads the server's /metrics just before its
first request and again after its last, and reports the difference of vLLM's counters
(`<prefix>:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`,
`..._num_accepted_tokens_per_pos_total{position=...}`; kvserve and vLLM both export them, under `kvserve:`
and `vllm:`). A server without them (one that does not speculate, or no /metrics) gets no such section.

- acceptance rate   = accepted draft tokens / draft tokens
- acceptance length = 1 + accepted draft tokens / drafts: tokens a verification step gives a sequence
- by position       = accepted at position i / drafts (0-based; position i counts only when all before it
                      were accepted, so the rates fall with i and add up to acceptance length - 1)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.metrics_page import MetricsUnavailable, fetch_metrics_text

_DRAFTS, _DRAFT_TOKENS, _ACCEPTED, _PER_POS = (
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total")


@dataclass
class SpecCounters:
    """One reading of the counters, summed over the server's engines (label sets) for one model."""
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)


def parse_spec_counters(text: str, model: str | None = None) -> SpecCounters | None:
    """The counters of `model` in a /metrics page (Prometheus text), or None when it has none.

    A server of one model (every sample's model_name label the same, or none) counts whatever name the
    benchmark sends, an alias included. On a server of several models only the samples labelled with
    `model` count: another model's drafts say nothing about this one's, so a model that does not speculate
    there gets None (give a model's main name, the one its metrics carry)."""
    samples, served = [], set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "model_name" in s.labels:
                served.add(s.labels["model_name"])
            name = s.name.rpartition(":")[2]  # "kvserve:..." or "vllm:..."
            if name in (_DRAFTS, _DRAFT_TOKENS, _ACCEPTED, _PER_POS):
                samples.append((name, s.labels, s.value))
    if model is not None and len(served) > 1:
        samples = [s for s in samples if s[1].get("model_name") == model]
    if not samples:
        return None
    c = SpecCounters()
    for name, labels, value in samples:
        if name == _PER_POS:
            if "position" in labels:  # a sample without one counts at no position
                pos = int(labels["position"])
                c.accepted_per_pos[pos] = c.accepted_per_pos.get(pos, 0.0) + value
        elif name == _DRAFTS:
            c.drafts += value
        elif name == _DRAFT_TOKENS:
            c.draft_tokens += value
        else:
            c.accepted += value
    return c


@dataclass
class SpecDecodeStats:
    """What the run's requests drafted and had accepted (after - before)."""
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None  # None without draft tokens (e.g. drafting turned off at this load)
    acceptance_length: float | None
    acceptance_by_position: list[float]

    @classmethod
    def between(cls, before: SpecCounters, after: SpecCounters) -> SpecDecodeStats:
        if after.drafts < before.drafts or after.draft_tokens < before.draft_tokens or after.accepted < before.accepted:
            before = SpecCounters()  # the counters restarted (a new server process): all they hold is this run's
        drafts = round(after.drafts - before.drafts)
        tokens = round(after.draft_tokens - before.draft_tokens)
        accepted = round(after.accepted - before.accepted)
        positions = range(max(after.accepted_per_pos, default=-1) + 1)
        by_pos = [after.accepted_per_pos.get(i, 0.0) - before.accepted_per_pos.get(i, 0.0) for i in positions]
        return cls(drafts, tokens, accepted,
                   acceptance_rate=accepted / tokens if tokens else None,
                   acceptance_length=1 + accepted / drafts if drafts else None,
                   acceptance_by_position=[a / drafts for a in by_pos] if drafts else [])


async def read_spec_counters(session: aiohttp.ClientSession, base_url: str, model: str,
                             headers: dict[str, str]) -> SpecCounters | None:
    """The server's counters now; None when its /metrics has none (it does not speculate, or kvserve has
    not drafted yet: it registers them at the first draft). Raises MetricsUnavailable."""
    text = await fetch_metrics_text(session, base_url, headers)
    try:
        return parse_spec_counters(text, model)
    except ValueError as e:  # not Prometheus text
        raise MetricsUnavailable(str(e)) from e


async def settled_spec_counters(session: aiohttp.ClientSession, base_url: str, model: str,
                                headers: dict[str, str], timeout_s: float = 3.0) -> SpecCounters | None:
    """The counters once they stop moving: a server may book a request's last step a moment after its
    last chunk reached the client. Read until two readings 0.2 s apart agree (at most timeout_s; a failed
    re-reading keeps the last good one). Raises MetricsUnavailable if the first reading fails."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    now = await read_spec_counters(session, base_url, model, headers)
    while now is not None and loop.time() < deadline:
        await asyncio.sleep(0.2)
        try:
            again = await read_spec_counters(session, base_url, model, headers)
        except MetricsUnavailable:
            break
        if again == now:
            break
        now = again
    return now
