"""Engine crash recovery against a real `kvserve serve`: the engine process is killed with SIGKILL (and, for
the quarantine, kills itself on one request through kvserve.engine.faults); the server must say so on
/health at once (its watcher polls every 0.1 s; the test allows 3 s for a slow, busy host), fail the requests
in flight cleanly, start a new engine and serve again."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.faults import ENV_CRASH_ON_TOKEN
from kvserve.entrypoints.openai.launcher import RemoteServer

CRASH_TOKEN = 49151            # the default model's last token id: in no text prompt of these tests
LONG = {"prompt": "Tell me a very long story about the sea.", "max_tokens": 400, "ignore_eos": True}

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server():
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-seqs", "8"]
    with RemoteServer(args, env={ENV_CRASH_ON_TOKEN: str(CRASH_TOKEN)}) as s:
        yield s


def engine_pid(server: RemoteServer) -> int:
    """The server's engine child (multiprocessing's spawn_main; its resource tracker is the other child)."""
    pid = server.proc.pid
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
            except FileNotFoundError:
                continue
    raise AssertionError("no engine process found")


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_healthy(server: RemoteServer, timeout_s: float = 180.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not healthy again after {timeout_s}s:\n{server.output()[-3000:]}")


def test_kill_9_fails_in_flight_requests_and_a_new_engine_serves(server):
    assert metric(server, "kvserve:engine_restarts_total") == 0
    old_pid = engine_pid(server)
    blocking: dict[str, httpx.Response] = {}
    plain = threading.Thread(target=lambda: blocking.update(
        r=httpx.post(server.base_url + "/v1/completions", json=LONG, timeout=120)))
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert json.loads(next(line for line in lines if line)[6:])["object"] == "chat.completion.chunk"
            plain.start()
            deadline = time.monotonic() + 60
            while metric(server, "kvserve:num_requests_running") < 2:
                assert time.monotonic() < deadline, "the second request never started"
                time.sleep(0.05)

            os.kill(old_pid, signal.SIGKILL)
            killed = time.monotonic()
            while httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                time.sleep(0.01)
            assert time.monotonic() - killed < 3.0
            events = [line[6:] for line in lines if line]
    # The stream ends with an OpenAI error event, then [DONE].
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "died" in error["message"]
    plain.join(30)
    r = blocking["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == 503

    recovery_s = wait_healthy(server)
    new_pid = engine_pid(server)
    assert new_pid != old_pid
    ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": "The capital of France is",
                                                              "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert metric(server, "kvserve:engine_restarts_total") == 1
    assert metric(server, "kvserve:num_requests_running") == 0
    print(f"healthy again {recovery_s:.1f}s after the 503")


def test_request_that_keeps_crashing_the_engine_is_refused(server):
    wait_healthy(server)
    restarts = metric(server, "kvserve:engine_restarts_total")
    poison = {"prompt": [1, 504, CRASH_TOKEN, 2], "max_tokens": 4}
    for crash in range(2):
        r = httpx.post(server.base_url + "/v1/completions", json=poison, timeout=60)
        assert r.status_code == 503, r.text          # in flight when its engine died: failed, never resubmitted
        wait_healthy(server)
        assert metric(server, "kvserve:engine_restarts_total") == restarts + crash + 1
    refused = httpx.post(server.base_url + "/v1/completions", json=poison, timeout=60)
    assert refused.status_code == 400 and "died 2 times" in refused.json()["error"]["message"]
    time.sleep(0.5)
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert metric(server, "kvserve:engine_restarts_total") == restarts + 2   # no third crash
    ok = httpx.post(server.base_url + "/v1/completions", json={**poison, "prompt": [1, 504, 2]}, timeout=60)
    assert ok.status_code == 200
