"""Shutdown with requests still in flight when the grace period runs out, or on a second signal: every client
is told (a 503; a stream's error event, then [DONE]) instead of having its connection cut, the one waiting in
line too (that the line is not admitted: test_gateway_admission), the engine is told to abort them, and the
server exits 0 without a traceback. (A stream that finishes within the grace period: test_server.py's last
test.)"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from server_helpers import check_stopped, stop_with_requests_in_flight, wait_for

from kvserve.config import EngineConfig
from kvserve.engine.core_process import AbortRequest, AddRequest, StepResult
from kvserve.engine.stats import EngineStats
from kvserve.entrypoints.async_llm import AsyncLLM, ServerStopping
from kvserve.entrypoints.openai.api_server import STOPPED_MESSAGE
from kvserve.entrypoints.openai.launcher import RemoteServer
from kvserve.outputs import CompletionDelta, RequestDelta
from kvserve.sampling_params import SamplingParams


@pytest.mark.parametrize("signals, grace", [(1, "1"), (2, "300")], ids=["grace-over", "second-signal"])
def test_requests_still_in_flight_are_told_and_the_server_exits_0(signals: int, grace: str):
    args = ["--max-num-seqs", "1", "--max-model-len", "4096", "--num-kv-blocks", "256", "--shutdown-grace", grace]
    with RemoteServer(args) as server:
        events, queued, seconds = stop_with_requests_in_flight(server, signals)
        assert server.proc.wait(60) == 0, server.output()[-3000:]
        output = server.output()
    check_stopped(events, queued)
    assert "stopping 2 requests still in flight" in output
    assert "Traceback" not in output and "Application shutdown complete" in output, output[-3000:]
    # 3,000 tokens take far longer than this: the stream was stopped, not finished (and with a second signal
    # the 300 s grace period was not waited out).
    assert seconds < 20, (seconds, output[-2000:])


def test_a_third_signal_exits_at_once_without_a_traceback_or_a_stray_engine():
    """The third signal lands 20 ms after the second, while the server is still shutting down: it skips the
    lifespan's shutdown event (uvicorn's forced exit). The loop's closing then cancels the lifespan after its
    clean-up, which Starlette reported as a failed shutdown and uvicorn logged with a CancelledError
    traceback. The engine process must be gone all the same."""
    args = ["--max-num-seqs", "1", "--max-model-len", "4096", "--num-kv-blocks", "256", "--shutdown-grace", "300"]
    with RemoteServer(args) as server:
        engine_pid = int(re.search(r"engine ready \(process mode, pid (\d+)\)", server.output()).group(1))
        _, _, seconds = stop_with_requests_in_flight(server, 3, gaps_s=(0.3, 0.02))
        assert server.proc.wait(60) == 0, server.output()[-3000:]
        output = server.output()
    assert "second signal; stopping 2 requests still in flight" in output, output[-3000:]
    assert "Application shutdown complete" not in output, "the third signal should have skipped it: " + output[-2000:]
    assert "Traceback" not in output and "ERROR" not in output, output[-3000:]
    assert seconds < 20, (seconds, output[-2000:])
    wait_for(lambda: not process_alive(engine_pid), 10, "the engine process to end")


def process_alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that no longer exists to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_stopping_aborts_every_request_in_the_engine_after_what_it_sent():
    """AsyncLLM alone (the test plays the engine): stop_requests sends one AbortRequest naming every running
    request, each stream first receives what the engine already sent, then ends with ServerStopping; a request
    after that is refused the same way and never sent."""
    async def main() -> None:
        llm = AsyncLLM(EngineConfig(), mode="thread")
        sent: list = []
        llm._send = sent.append
        got: dict[str, list] = {"a": [], "b": []}

        async def consume(rid: str) -> None:
            try:
                async for delta in llm.generate([1, 2, 3], SamplingParams(max_tokens=50), request_id=rid):
                    got[rid].extend(delta.outputs[0].token_ids)
            except ServerStopping as e:
                got[rid].append(str(e))

        tasks = [asyncio.create_task(consume(rid)) for rid in got]
        await asyncio.sleep(0)
        engine_ids = [m.request_id for m in sent if isinstance(m, AddRequest)]
        llm._on_step(StepResult([RequestDelta(eid, [CompletionDelta(0, [7], "t")], False, num_prompt_tokens=3)
                                 for eid in engine_ids], [], EngineStats(), num_added=2, step_time=0.0, stepped=True))
        llm.stop_requests("stopping")
        await asyncio.gather(*tasks)
        assert got == {"a": [7, "stopping"], "b": [7, "stopping"]}
        aborts = [m for m in sent if isinstance(m, AbortRequest)]
        assert len(aborts) == 1 and sorted(aborts[0].request_ids) == sorted(engine_ids)
        assert llm.num_unfinished == 0
        with pytest.raises(ServerStopping):
            async for _ in llm.generate([1], SamplingParams(max_tokens=1), request_id="late"):
                pass
        assert sum(isinstance(m, AddRequest) for m in sent) == 2
    asyncio.run(main())


def test_a_request_still_uploading_its_body_is_answered_503_when_the_grace_period_ends():
    """Its handler waits for body bytes, not on a model, so stopping the models' requests did not reach it: the
    drain waited 5 s, uvicorn 5 s more, then cancelled it (cut connection, a traceback in the log)."""
    import signal
    import socket
    import time

    with RemoteServer(["--shutdown-grace", "1", "--num-kv-blocks", "64"]) as server:
        body = b'{"prompt": "Hello", "max_tokens": 4}'
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
            time.sleep(0.5)   # the request is past the draining check, waiting for the rest of its body
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            seconds = time.monotonic() - start
        assert server.proc.wait(60) == 0
        output = server.output()
    assert reply.startswith(b"HTTP/1.1 503"), reply[:300]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"] == STOPPED_MESSAGE
    assert seconds < 4, seconds   # the grace period (1 s), not the 10 s of waiting it took before
    assert "Traceback" not in output, output[-3000:]
