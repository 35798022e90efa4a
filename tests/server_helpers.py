"""Helpers for tests that talk to a running server over HTTP: waiting for a condition, reading /metrics."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def wait_for(pred, timeout_s: float = 10.0, what: str = "condition", every_s: float = 0.05):
    """Calls pred every every_s seconds until it returns something true, and returns that; fails after
    timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def metrics(http: httpx.Client) -> dict[str, float]:
    """{sample name with its labels but the model's and replica's: value} from /metrics, histogram buckets
    left out; e.g. "kvserve:spec_decode_num_accepted_tokens_per_pos_total{position=0}"."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if "le" in s.labels:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "replica"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
