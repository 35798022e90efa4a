"""What the load benchmarks (many_streams.py, soak.py) watch on a running `kvserve serve` from the outside:
/health latency from a separate process (so the load generator's own event loop cannot delay the probe),
the resident memory of the server and its engine process, and the server log's error lines. No torch."""
from __future__ import annotations

import multiprocessing
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def raise_fd_limit() -> int:
    """Lift the soft open-files limit to the hard one (thousands of sockets; servers started later inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# ---------------------------------------------------------------- /health from another process

def _probe(base_url: str, interval_s: float, stop: "multiprocessing.synchronize.Event",
           out: "multiprocessing.Queue") -> None:
    latencies, bad = [], 0
    with httpx.Client(base_url=base_url, timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - t0)
            bad += not ok
            time.sleep(interval_s)
    out.put((latencies, bad))


class HealthProbe:
    """GET /health every interval_s until stop(); returns {p50, p99, max} in ms, probe count, non-200s."""

    def __init__(self, base_url: str, interval_s: float = 0.05) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._out = ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_probe, args=(base_url, interval_s, self._stop, self._out), daemon=True)
        self._proc.start()

    def stop(self) -> dict:
        self._stop.set()
        latencies, bad = self._out.get(timeout=60)
        self._proc.join(10)
        ms = lambda x: round(1000 * x, 2)  # noqa: E731
        return {"probes": len(latencies), "non_200": bad, "p50_ms": ms(percentile(latencies, 50)),
                "p99_ms": ms(percentile(latencies, 99)), "max_ms": ms(max(latencies, default=float("nan")))}


# ---------------------------------------------------------------- a control: an idle server on the same stack

class ControlServer:
    """An idle FastAPI app (uvicorn, the same event loop and HTTP parser as kvserve) answering /health.
    Probed alongside the real server, it shows how much of /health's latency the machine's load alone
    causes: on a busy machine a probe waits for a core whatever the server does."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "serving_probes:control_app", "--port", str(port),
             "--log-level", "warning"], cwd=Path(__file__).parent, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError("control server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _make_control_app():
    from fastapi import FastAPI, Response

    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def __getattr__(name: str):  # uvicorn imports control_app; build it (and import fastapi) only then
    if name == "control_app":
        return _make_control_app()
    raise AttributeError(name)


# ---------------------------------------------------------------- memory

def rss_bytes(pid: int) -> int:
    """Resident memory of pid and all its descendants (the server, its engine process, the resource tracker)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


@dataclass
class RssSampler:
    """Samples rss_bytes(pid) every interval_s in a thread: (seconds since start, bytes)."""
    pid: int
    interval_s: float = 0.5
    samples: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._t0, rss_bytes(self.pid)))
            self._stop.wait(self.interval_s)

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples


# ---------------------------------------------------------------- the server log

_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if _ERROR_LINE.search(line)]
