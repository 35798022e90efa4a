"""`--backend ray` with the default model: what `kvserve serve` does on SIGTERM holds through Ray Serve too
(requests still in flight after the grace period are told with a 503, not cut off when Serve stops its HTTP
proxy), the replicas' log lines (the periodic stats line with speculative acceptance) reach the terminal, and
a replica that cannot start ends the command with its reason as the last line. Skipped without ray[serve]."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("ray.serve")

from server_helpers import check_stopped, stop_with_requests_in_flight  # noqa: E402

from kvserve.entrypoints.openai.launcher import RemoteServer, free_port  # noqa: E402

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")]

ENGINE = ["--num-threads", "1", "--num-kv-blocks", "256", "--max-model-len", "4096"]


@pytest.fixture(scope="module")
def ray_address():
    import ray

    ray.init(num_cpus=2, object_store_memory=96 * 2**20, include_dashboard=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_sigterm_tells_requests_in_flight_and_replicas_log_their_stats(ray_address):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    args = ["--backend", "ray", *ENGINE, "--max-num-seqs", "1", "--shutdown-grace", "1", "--log-stats-interval",
            "1", "--speculative-config", spec, "--served-model-name", "smol", "smol-too"]
    with RemoteServer(args, env={"RAY_ADDRESS": ray_address}, startup_timeout_s=400) as server:
        # Every --served-model-name answers, as on the local backend (the second had been a 404, and unlisted).
        cards = httpx.get(server.base_url + "/v1/models", timeout=60).json()["data"]
        assert [c["id"] for c in cards] == ["smol", "smol-too"]
        r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                       json={"model": "smol-too", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "smol-too", r.text
        events, queued, seconds = stop_with_requests_in_flight(server, signals=1)
        code = server.proc.wait(120)
        output = server.output()
    assert code == 0, output[-3000:]
    check_stopped(events, queued)
    assert "grace period over; stopping" in output, output[-3000:]
    # Logged in the replica's process: Ray's workers leave logging unconfigured, and these were dropped.
    assert "replica" in output and "ready (engine pid" in output, output[-3000:]
    assert "kvserve.stats: Avg prompt throughput" in output and "Draft acceptance rate" in output, output[-3000:]
    assert seconds < 60, seconds


def test_a_replica_that_cannot_start_ends_with_its_reason(ray_address, tmp_path):
    config = {"models": [{"name": "spec", "model": "smollm2-135m", "engine": {
        "num_threads": 1, "num_kv_blocks": 64,
        "speculative_config": {"method": "draft", "num_speculative_tokens": 3, "model": "/nonexistent/draft"}}}]}
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--backend", "ray",
                           "--models-config", str(path), "--port", str(free_port())],
                          env={**os.environ, "RAY_ADDRESS": ray_address}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 1, lines[-20:]
    # The last line names the deployment and the engine's own reason (it said only which deployments failed).
    assert "Ray Serve deployment failed" in lines[-1] and "'/nonexistent/draft'" in lines[-1], lines[-5:]
    assert not any("Exception during graceful shutdown of replica" in line for line in lines)


def test_a_replica_whose_engine_cannot_restart_is_unhealthy(ray_address, tmp_path):
    """Its engine killed and every restart failing (the model's files gone), a replica had stayed HEALTHY in
    Ray, /health said 200 and every request got a 503, for good: Ray only calls a method named check_health."""
    import re
    import shutil
    import time

    from tiny_models import make_tiny_model

    model = tmp_path / "tiny"
    make_tiny_model("llama", model)
    args = ["--model", str(model), "--backend", "ray", "--dtype", "float32", "--num-threads", "1",
            "--num-kv-blocks", "64", "--max-model-len", "256", "--shutdown-grace", "0"]
    with RemoteServer(args, env={"RAY_ADDRESS": ray_address}, startup_timeout_s=300) as server:
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        pid = int(re.search(r"ready \(engine pid (\d+)\)", server.output()).group(1))
        shutil.move(model, tmp_path / "moved")
        os.kill(pid, 9)
        deadline, status = time.monotonic() + 120, 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(1)
            status = httpx.get(server.base_url + "/health", timeout=30).status_code
        assert status == 503, server.output()[-3000:]


def run_ray_command(ray_address: str, *args: str, timeout_s: float = 300) -> tuple[int, list[str]]:
    """The command on the cluster at ray_address ("local": a cluster of its own, as without a running one)."""
    proc = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--backend", "ray", *args],
                          env={**os.environ, "RAY_ADDRESS": ray_address}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False)
    return proc.returncode, [line for line in proc.stdout.splitlines() if line.strip()]


def test_a_cluster_that_cannot_be_reached_ends_with_one_line_saying_why():
    """RAY_ADDRESS where no cluster answers (or one that wants Ray's auth token) ended the command with ray.init's
    traceback. Ray's own knobs cut its waits for the cluster (5 s to connect, 5 s for its pubsub, 30 s for the
    cluster's ID, 42 s in all) to about 5 s."""
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--backend", "ray",
                           "--port", str(free_port())],
                          env={**os.environ, "RAY_ADDRESS": address, "RAY_gcs_server_port_wait_time_s": "1",
                               "RAY_gcs_rpc_server_connect_timeout_s": "1", "RAY_py_gcs_connect_timeout_s": "2"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 1, lines[-20:]
    assert "Ray Serve cannot start: Failed to connect to Ray cluster at" in lines[-1], lines[-5:]
    assert "Timed out while waiting for GCS" in lines[-1], lines[-5:]
    assert not any(line.startswith("Traceback") for line in lines), lines[-30:]


def test_replicas_the_local_cluster_cannot_hold_are_refused_at_once(tmp_path):
    """On the cluster the command starts (one logical CPU per core, 2 here), a replica reserving more CPUs than
    it has, or first replicas that together do (the README's example asked for 3), were never scheduled: Ray
    waited for them for ever, and the command with it."""
    cores = len(os.sched_getaffinity(0))
    wide = tmp_path / "wide.yaml"
    wide.write_text(json.dumps({"models": [{"name": "wide", "model": "smollm2-135m",
                                            "engine": {"num_threads": cores + 1}}]}))
    code, lines = run_ray_command("local", "--models-config", str(wide), "--port", str(free_port()), timeout_s=120)
    assert code == 1, lines[-20:]
    assert (f"Ray Serve cannot start: model 'wide': a replica reserves {cores + 1} CPUs (engine.num_threads) and "
            f"this local Ray cluster has {cores}") in lines[-1], lines[-5:]
    many = tmp_path / "many.yaml"
    many.write_text(json.dumps({"models": [{"name": "a", "model": "smollm2-135m"},
                                           {"name": "b", "model": "smollm2-135m", "data_parallel_size": cores}]}))
    code, lines = run_ray_command("local", "--models-config", str(many), "--port", str(free_port()), timeout_s=120)
    assert code == 1, lines[-20:]
    assert (f"the models' first replicas reserve {cores + 1} CPUs (a 1 x 1, b {cores} x 1) and this local Ray "
            f"cluster has {cores}") in lines[-1], lines[-5:]


def test_serve_already_running_elsewhere_is_refused_and_left_running(ray_address):
    """Ray Serve already running on the cluster (another user's application) keeps its HTTP port: this command
    served there instead of --port while saying --port, and its shutdown removed every application."""
    import httpx
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Other:
        async def __call__(self, request) -> str:
            return "other"

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(Other.bind(), name="other", route_prefix="/other")
        code, lines = run_ray_command(ray_address, *ENGINE, "--port", str(free_port()), timeout_s=120)
        assert code == 1, lines[-20:]
        assert "Ray Serve cannot start" in lines[-1] and f"its HTTP proxy on 127.0.0.1:{port}" in lines[-1] \
            and f"--port {port}" in lines[-1], lines[-5:]
        assert serve.status().applications["other"].status == "RUNNING"
        assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=30).text == "other"
        # A second kvserve (here an application of that name) is refused, and left running: the refused
        # command used to delete it on its way out.
        serve.run(Other.bind(), name="kvserve", route_prefix="/kv")
        code, lines = run_ray_command(ray_address, *ENGINE, "--port", str(port), timeout_s=120)
        assert code == 1 and "an application named 'kvserve' already runs" in lines[-1], lines[-5:]
        assert {"other", "kvserve"} <= set(serve.status().applications)
        assert httpx.get(f"http://127.0.0.1:{port}/kv", timeout=30).text == "other"
    finally:
        serve.shutdown()


def test_a_signal_while_the_replicas_start_ends_the_start(ray_address):
    """SIGTERM (or Ctrl-C) while Ray starts the replicas: the command used to wait for every replica to be
    ready, then serve and drain; a replica that could never start made it wait for ever."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--backend", "ray", *ENGINE,
                             "--port", str(free_port())], env={**os.environ, "RAY_ADDRESS": ray_address},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "Deploying new version of Deployment" in line:   # the controller has begun: no replica is ready
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines += [line for line in rest.splitlines() if line.strip()]
    assert proc.returncode == 1, lines[-20:]
    assert not any("Ray Serve: serving" in line for line in lines), lines[-20:]
    assert "Ray Serve start-up interrupted" in lines[-1], lines[-5:]
