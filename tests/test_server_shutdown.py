"""Shutdown with requests still in flight when the grace period runs out, or on a second signal: every client
is told (a 503; a stream's error event, then [DONE]) instead of having its connection cut, the line behind
them is not admitted, and the server exits 0 without a traceback. (A stream that finishes within the grace
period: test_server.py's last test.)"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from kvserve.entrypoints.openai.launcher import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
STOPPED = "the server is shutting down and stopped this request before it finished"


def stop_with_requests_in_flight(server: RemoteServer, signals: int) -> tuple[list[str], httpx.Response, float]:
    """A stream far longer than any grace period here runs on the one sequence place, a second request waits
    in line behind it; then `signals` SIGTERMs. Returns the stream's events, the queued request's response and
    the seconds from the first signal to the server's exit."""
    queued: list[httpx.Response] = []
    long_stream = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 3000, "ignore_eos": True,
                   "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=long_stream) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            waiter = threading.Thread(target=lambda: queued.append(c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Waits in line", "max_tokens": 8})))
            waiter.start()
            time.sleep(0.5)
            assert not queued, "the second request should be waiting for the one place"
            start = time.monotonic()
            for _ in range(signals):
                server.proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
            events = [first] + [line for line in lines if line]
            waiter.join(60)
    code = server.proc.wait(60)
    assert code == 0, server.output()[-3000:]
    return events, queued[0], time.monotonic() - start


def check_told(events: list[str], queued: httpx.Response, output: str) -> None:
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and error["message"] == STOPPED
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]]
    assert all(t is not None for t in texts) and len(texts) >= 1
    assert queued.status_code == 503 and queued.json()["error"]["message"] == STOPPED
    assert "stopping 2 requests still in flight" in output
    assert "Traceback" not in output and "Application shutdown complete" in output, output[-3000:]


@pytest.mark.parametrize("signals, grace", [(1, "1"), (2, "300")], ids=["grace-over", "second-signal"])
def test_requests_still_in_flight_are_told_and_the_server_exits_0(signals: int, grace: str):
    args = ["--max-num-seqs", "1", "--max-model-len", "4096", "--num-kv-blocks", "256", "--shutdown-grace", grace]
    with RemoteServer(args) as server:
        events, queued, seconds = stop_with_requests_in_flight(server, signals)
        output = server.output()
    check_told(events, queued, output)
    # 3,000 tokens take far longer than this: the stream was stopped, not finished (and with a second signal
    # the 300 s grace period was not waited out).
    assert seconds < 20, (seconds, output[-2000:])
