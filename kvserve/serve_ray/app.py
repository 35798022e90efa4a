"""Build and run the Ray Serve application for a models config: one ModelReplica deployment per model,
one OpenAIIngress in front.

How the YAML maps onto Ray Serve (ray.serve.config.AutoscalingConfig):
  autoscaling.min_replicas / max_replicas       -> min_replicas / max_replicas
  data_parallel_size                            -> initial_replicas (clamped to [min, max]); without
                                                   `autoscaling`, a fixed num_replicas
  autoscaling.target_queue_depth                -> QueueDepthPolicy(target_queue_depth), a custom policy
                                                   (autoscaling.py), instead of target_ongoing_requests
  autoscaling.upscale_delay_s / downscale_delay_s -> the same fields
  admission.max_waiting                         -> max_queued_requests (beyond it: 429 + Retry-After)
  engine.max_num_seqs + ceil(target_queue_depth) -> max_ongoing_requests per replica: a replica holds a
                                                   full batch and a short queue; the rest wait in the
                                                   ingress's router, where a new replica can take them
Replicas report their queue every METRICS_INTERVAL_S and Ray averages over LOOK_BACK_S: scaling reacts
within a couple of seconds plus the configured delay."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import threading
import time
import warnings
from dataclasses import replace
from typing import Any

from kvserve.config import EngineConfig
from kvserve.entrypoints.async_llm import EngineMode
from kvserve.entrypoints.openai.api_server import LOG_FORMAT, STOP_FLUSH_S, STOPPED_MESSAGE, ServerArgs
from kvserve.gateway.config import AutoscalingConfig, ModelEntry, ModelsConfig
from kvserve.serve_ray.autoscaling import QueueDepthPolicy

logger = logging.getLogger("kvserve.serve_ray")

APP_NAME = "kvserve"
METRICS_INTERVAL_S = 0.5      # how often replicas and the ingress report their queues to the controller
LOOK_BACK_S = 2.0             # the window Ray averages those reports over
INGRESS_MAX_ONGOING = 10_000  # the ingress only forwards bytes; it must never be what queues requests
# How long a replica being removed may take to finish its requests. Ray applies it to every stop, scaling
# down included, where it had been --shutdown-grace: streams on a replica Ray scaled away were cut after
# 30 s (at once with a grace of 0). At the command's own shutdown the ingress has already finished or
# stopped every request (drain_ingress), so the replicas have none left and this costs nothing there.
REPLICA_DRAIN_S = 600.0
HEALTH_CHECK_PERIOD_S = 5.0   # ModelReplica.check_health
INTERRUPTED = "start-up interrupted: a signal came while the replicas were starting"


def deployment_name(index: int, model_name: str) -> str:
    return f"model{index}-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model_name)


def initial_replicas(entry: ModelEntry) -> int:
    """Replicas at start: data_parallel_size, within the autoscaling bounds where there are some."""
    scaling = entry.autoscaling
    if scaling is None:
        return entry.data_parallel_size
    return min(max(entry.data_parallel_size, scaling.min_replicas), scaling.max_replicas)


def replica_num_cpus(engine: EngineConfig) -> int:
    """Logical CPUs a replica reserves for Ray's placement: its engine's threads."""
    return engine.num_threads or 1


def model_deployment_options(entry: ModelEntry, engine: EngineConfig, max_queued: int,
                             grace_s: float) -> dict[str, Any]:
    scaling = entry.autoscaling
    depth = (scaling or AutoscalingConfig()).target_queue_depth
    options: dict[str, Any] = {
        "max_ongoing_requests": engine.max_num_seqs + math.ceil(depth),
        "max_queued_requests": max_queued,
        "graceful_shutdown_timeout_s": max(grace_s, REPLICA_DRAIN_S),
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        # The ingress has drained the requests before Serve shuts down (drain_ingress): no need to wait the
        # default 2 s before the replica's check that nothing is left, which, with a short grace period,
        # left too little time for the engine's clean stop before the replica was killed.
        "graceful_shutdown_wait_loop_s": 0.2,
        # Logical CPUs for Ray's placement; the engine process uses engine.num_threads of them.
        "ray_actor_options": {"num_cpus": replica_num_cpus(engine),
                              "num_gpus": 1 if engine.device.startswith("cuda") else 0},
    }
    if scaling is None:
        options["num_replicas"] = entry.data_parallel_size
        return options
    options["autoscaling_config"] = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": initial_replicas(entry),
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
        "metrics_interval_s": METRICS_INTERVAL_S,
        "look_back_period_s": LOOK_BACK_S,
        "policy": {"policy_function": QueueDepthPolicy, "policy_kwargs": {"target_queue_depth": depth}},
    }
    return options


def build_application(config: ModelsConfig, args: ServerArgs, engine_mode: EngineMode = "process"):
    """The Ray Serve application (ingress bound to one deployment per model). `args.engine` is the base
    engine config each model's `engine` options override."""
    from ray import serve

    from kvserve.serve_ray.ingress import OpenAIIngress
    from kvserve.serve_ray.replica import ModelReplica

    handles, deployments = {}, {}
    for i, entry in enumerate(config.models):
        engine = entry.engine_config(args.engine)
        name = deployment_name(i, entry.name)
        # The replica's own app checks nothing the ingress has checked already (API keys).
        # The first model's further --served-model-name names (given for one model only) are its replicas' too.
        aliases = args.served_model_names[1:] if i == 0 else []
        replica_args = replace(args, engine=engine, served_model_names=[entry.name, *aliases],
                               engine_mode=engine_mode, api_keys=[], web=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # metrics_interval_s: still Ray's knob
            options = model_deployment_options(entry, engine, config.admission.max_waiting, args.shutdown_grace_s)
            deployment = serve.deployment(ModelReplica, name=name, **options)
        handles[entry.name] = deployment.bind(entry.name, replica_args)
        deployments[entry.name] = name
    ingress = serve.deployment(OpenAIIngress, name="ingress", num_replicas=1, graceful_shutdown_wait_loop_s=0.2,
                               max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0})
    return ingress.bind(handles, deployments, APP_NAME, args)


def replica_cpus(config: ModelsConfig, base: EngineConfig) -> list[tuple[str, int, int]]:
    """Per model: (name, replicas at start, logical CPUs a replica reserves), as model_deployment_options
    asks Ray for them."""
    return [(entry.name, initial_replicas(entry), replica_num_cpus(entry.engine_config(base)))
            for entry in config.models]


def cluster_problem(config: ModelsConfig, base: EngineConfig, started_here: bool) -> str | None:
    """Why this Ray cluster can never start the models' first replicas, or None. Ray would wait for them for
    ever ("No available node types can fulfill resource request"), and the command with it."""
    import ray

    largest = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)
    total = ray.cluster_resources().get("CPU", 0.0)
    needs = replica_cpus(config, base)
    wide = next(((name, cpus) for name, _, cpus in needs if cpus > largest), None)
    need = sum(start * cpus for _, start, cpus in needs)
    if not started_here:
        # A cluster joined may grow (an autoscaler adds nodes for pending replicas): say what may wait, only.
        if wide is not None or need > total:
            logger.warning("the models' first replicas reserve %d CPUs, a replica up to %d; this Ray cluster has "
                           "%g, its largest node %g: replicas wait until nodes with room join",
                           need, max(c for _, _, c in needs), total, largest)
        return None
    if wide is not None:
        return (f"model {wide[0]!r}: a replica reserves {wide[1]} CPUs (engine.num_threads) and this local Ray "
                f"cluster has {largest:g}")
    if need > total:
        parts = ", ".join(f"{name} {start} x {cpus}" for name, start, cpus in needs)
        return (f"the models' first replicas reserve {need} CPUs ({parts}) and this local Ray cluster has "
                f"{total:g} (one per core): lower data_parallel_size or engine.num_threads, or join a larger "
                f"cluster with RAY_ADDRESS")
    return None


def serve_conflict(args: ServerArgs) -> tuple[str | None, bool]:
    """Whether Ray Serve already runs on this cluster in a way this command cannot share: (why not, or None;
    whether Serve ran before this command, which must then remove only its own application at exit)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None, False
    if APP_NAME in serve.status().applications:
        return (f"an application named {APP_NAME!r} already runs on this Ray cluster (another `kvserve serve "
                f"--backend ray`?); stop it first"), True
    http = client.http_config
    if (http.host, http.port) != (args.host, args.port):
        return (f"Ray Serve already runs on this cluster with its HTTP proxy on {http.host}:{http.port}, which "
                f"cannot change while it runs: pass --host {http.host} --port {http.port}"), True
    return None, True


def deploy(config: ModelsConfig, args: ServerArgs, engine_mode: EngineMode, stop: threading.Event) -> str | None:
    """Start Serve's HTTP proxy on args.host:args.port and deploy; returns once every replica is ready (None),
    or why not: a deployment that failed, or `stop` set (a signal) before then. Needs a connected Ray first.
    The application is submitted without waiting and then polled, so that a signal is seen within half a
    second: a signal handler must not raise into serve.run's wait (Ray prints and ignores the exception)."""
    from ray import serve

    serve.start(http_options={"host": args.host, "port": args.port})
    if stop.is_set():
        return INTERRUPTED
    serve.run_many([serve.RunTarget(build_application(config, args, engine_mode), name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    while not stop.wait(0.5):
        app = serve.status().applications.get(APP_NAME)
        if app is None:
            continue
        if app.status == "RUNNING":
            return None
        if app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            return f"deployment failed: {deployment_failure(app.message or app.status)}"
    return INTERRUPTED


def deployment_failure(message: str) -> str:
    """Why deploying failed, in one line. The application's status says only which deployments failed; the
    reason (a replica constructor's exception, e.g. a draft model path that does not exist) is the last line
    of the failed deployment's status message."""
    from ray import serve

    summary = message.strip().splitlines()[-1] if message.strip() else "the application failed"
    with contextlib.suppress(Exception):
        app = serve.status().applications.get(APP_NAME)
        for name, deployment in (app.deployments.items() if app is not None else ()):
            lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
            if deployment.status in ("DEPLOY_FAILED", "UNHEALTHY") and lines:
                # The engine's own startup error already says what failed and why.
                reason = re.sub(r"^[\w.]*EngineStartupError: ", "", lines[-1])
                return f"{summary} {name}: {reason}"
    return summary


def drain_ingress(grace_s: float, stop_now: threading.Event) -> None:
    """What `kvserve serve` does on SIGTERM, through the ingress: new requests get 503 at once, those in flight
    may finish within grace_s (or until a second signal), then the rest are stopped with a 503 (a stream: an
    error event, then [DONE]). Serve's own shutdown would stop the HTTP proxy first, cutting every response."""
    from ray import serve

    try:
        ingress = serve.get_deployment_handle("ingress", APP_NAME)
        ingress.begin_drain.remote().result(timeout_s=10)
        # Asked in waits of a second at most (Serve logs each call), so a second signal is seen within one.
        deadline = time.monotonic() + grace_s
        left = ingress.wait_idle.remote(0).result(timeout_s=10)
        while left and not stop_now.is_set() and (wait := deadline - time.monotonic()) > 0:
            left = ingress.wait_idle.remote(min(1.0, wait)).result(timeout_s=10)
        if left:
            logger.warning("%s; stopping %d requests still in flight",
                           "second signal" if stop_now.is_set() else "grace period over", left)
            ingress.stop_requests.remote(STOPPED_MESSAGE).result(timeout_s=10)
            ingress.wait_idle.remote(STOP_FLUSH_S).result(timeout_s=STOP_FLUSH_S + 10)
    except Exception as e:  # noqa: BLE001 - shutting down regardless
        logger.warning("could not drain the ingress: %r", e)


def run_ray_server(config: ModelsConfig, args: ServerArgs, engine_mode: EngineMode = "process") -> int:
    """`kvserve serve --backend ray`: joins the cluster at RAY_ADDRESS (or the one this machine's `ray start`
    left running, as ray.init() does), or starts a local one; serves until SIGTERM/SIGINT, then drains the
    ingress as `kvserve serve` drains (drain_ingress), removes its Serve application and exits 0."""
    import ray
    from ray import serve

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        ray.init(include_dashboard=False, logging_level=args.log_level.upper())
    except ConnectionError as e:
        # Ray's message names the address; the last line of its cause says why (its cause's text carries a
        # whole traceback), e.g. that the cluster wants a token (Ray's token authentication).
        why = str(e.__cause__ or "").strip().splitlines()
        logger.error("Ray Serve cannot start: %s%s", e, f" ({why[-1]})" if why else "")
        return 1
    # ray.init started a head node here unless it connected to a cluster already running.
    started_here = bool(getattr(getattr(ray._private.worker, "_global_node", None), "head", False))
    stop, stop_now = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        if stop_now.is_set():
            # A third: exit at once, without draining or Serve's shutdown; ray.shutdown() still ends the local
            # cluster's processes started here (left alone, some of them outlived this one).
            with contextlib.suppress(Exception):
                ray.shutdown()
            os._exit(1)
        (stop_now if stop.is_set() else stop).set()   # a first signal ends start-up or serving, a second the grace

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    failure, serve_ran_before, deploying = None, False, False
    try:
        conflict, serve_ran_before = serve_conflict(args)
        failure = conflict or cluster_problem(config, args.engine, started_here)
        if failure is not None:
            failure = f"cannot start: {failure}"
            return 1
        deploying = True
        failure = deploy(config, args, engine_mode, stop)
        if failure is not None:
            return 1
        logger.info("Ray Serve: serving %s at http://%s:%d", ", ".join(config.model_names()), args.host, args.port)
        stop.wait()
        logger.info("shutting down: draining in-flight requests (grace %.0fs)", args.shutdown_grace_s)
        drain_ingress(args.shutdown_grace_s, stop_now)
    finally:
        if deploying:   # what this command deployed, and nothing it found running
            if serve_ran_before:
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
        ray.shutdown()
        if failure is not None:   # last, below what Ray prints while it shuts down
            logger.error("Ray Serve %s", failure)
    return 0
