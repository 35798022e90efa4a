"""What the server under test runs on, read from its /metrics before the run: kvserve's `kvserve:engine_info`
(device, CPU kernels, threads, weight and KV formats, cache size, version), one label set per engine. A
result without it cannot say which ISA or format its figures were measured with; other servers have no
such metric, and their results record none."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.metrics_page import MetricsUnavailable, fetch_metrics_text
from kvserve.metrics.registry_sample import ENGINE_INFO


def parse_engine_info(text: str, model: str | None = None) -> list[dict[str, str]]:
    """Each engine's labels in a /metrics page. On a server of several models, only `model`'s engines (as
    parse_spec_counters picks its counters); on a server of one, whatever name was sent, an alias included."""
    engines = [dict(s.labels) for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == ENGINE_INFO]
    if model is not None and len({e.get("model_name") for e in engines}) > 1:
        engines = [e for e in engines if e.get("model_name") == model]
    return engines


async def read_engine_info(session: aiohttp.ClientSession, base_url: str, model: str,
                           headers: dict[str, str]) -> list[dict[str, str]]:
    """parse_engine_info of the server's /metrics now; [] where it cannot be read."""
    try:
        return parse_engine_info(await fetch_metrics_text(session, base_url, headers), model)
    except (MetricsUnavailable, ValueError):  # ValueError: not Prometheus text
        return []


def describe_engine(info: dict[str, str]) -> str:
    """One line for the result table, e.g. "kvserve 0.1.0, cpu (kernels avx512, 2 threads), bfloat16, weights
    gguf q4 + gguf q8, KV bfloat16 x 4096 blocks"."""
    where = info.get("device", "?")
    if where == "cpu":
        where += f" (kernels {info.get('cpu_kernels', '?')}, {info.get('num_threads', '?')} threads)"
    return (f"kvserve {info.get('version', '?')}, {where}, {info.get('dtype', '?')}, weights "
            f"{info.get('weights', '?')}, KV {info.get('kv_cache_dtype', '?')} x {info.get('num_kv_blocks', '?')} "
            f"blocks")


async def first_listed_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    """The first model the server lists at /v1/models: the name a run sends when --model is left out (as in
    vLLM's benchmark). Raises RuntimeError, saying to pass --model, where there is none to read."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            body = await resp.json(content_type=None) if resp.status == 200 else f"HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        body = str(e) or type(e).__name__
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        why = body if isinstance(body, str) else "no model listed"
        raise RuntimeError(f"no --model given, and {url} names none ({why}): pass --model")
    return str(models[0]["id"])
