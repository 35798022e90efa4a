"""Shutdown with requests still in flight when the grace period runs out, or on a second signal: every client
is told (a 503; a stream's error event, then [DONE]) instead of having its connection cut, the line behind
them is not admitted, and the server exits 0 without a traceback. (A stream that finishes within the grace
period: test_server.py's last test.)"""
from __future__ import annotations

import pytest
from server_helpers import check_stopped, stop_with_requests_in_flight

from kvserve.entrypoints.openai.launcher import RemoteServer


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
