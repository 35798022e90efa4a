"""The server's /metrics page as text: what the benchmark reads its speculative-decoding counters
(spec_decode.py) and its engines' account of themselves (server_info.py) from."""

from __future__ import annotations

import asyncio

import aiohttp


class MetricsUnavailable(Exception):
    """The server's /metrics could not be read."""


async def fetch_metrics_text(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    """GET /metrics; raises MetricsUnavailable on an HTTP error or a failed connection."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise MetricsUnavailable(f"HTTP {resp.status}")
            return await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise MetricsUnavailable(str(e)) from e
