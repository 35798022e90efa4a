"""Helpers for tests that talk to a running server over HTTP: waiting for a condition, reading /metrics,
stopping a server with requests in flight."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.entrypoints.openai.launcher import RemoteServer


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


def stop_with_requests_in_flight(server: RemoteServer, signals: int, gaps_s: tuple[float, ...] = ()
                                 ) -> tuple[list[str], httpx.Response, float]:
    """A stream far longer than any grace period here runs on the one sequence place (--max-num-seqs 1), a
    second request waits in line behind it; then `signals` SIGTERMs, gaps_s[i] (default 0.3 s) after signal i.
    Returns the stream's events, the queued request's response and the seconds from the first signal to the
    server's exit (waited for up to 120 s)."""
    queued: list[httpx.Response] = []
    long_stream = {"prompt": "Count slowly:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=long_stream) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            waiter = threading.Thread(target=lambda: queued.append(c.post(
                "/v1/completions", json={"prompt": "Waits in line", "max_tokens": 8})))
            waiter.start()
            if c.get("/metrics").status_code == 200:   # the local server: see it in the line
                wait_for(lambda: metrics(c).get("kvserve:gateway_queue_requests") == 1, 30,
                         "the second request in line")
            else:                                     # Ray's ingress has no /metrics
                time.sleep(1.0)
            assert not queued, "the second request should be waiting for the one place"
            start = time.monotonic()
            for i in range(signals):
                server.proc.send_signal(signal.SIGTERM)
                time.sleep(gaps_s[i] if i < len(gaps_s) else 0.3)
            events = [first] + [line for line in lines if line]
            waiter.join(60)
    server.proc.wait(120)
    return events, queued[0], time.monotonic() - start


def check_stopped(events: list[str], queued: httpx.Response) -> None:
    """What stop_with_requests_in_flight's clients must have been told: the stream, after some text, an error
    event (503) and [DONE]; the queued request a 503. Both with the server's one shutdown message."""
    from kvserve.entrypoints.openai.api_server import STOPPED_MESSAGE

    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and error["message"] == STOPPED_MESSAGE
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]]
    assert texts and all(isinstance(t, str) for t in texts)
    assert queued.status_code == 503 and queued.json()["error"]["message"] == STOPPED_MESSAGE, queued.text
