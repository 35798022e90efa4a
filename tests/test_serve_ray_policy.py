"""The Ray backend's pieces that need no cluster: the queue-depth autoscaling decision (fed Ray Serve's own
AutoscalingContext), how the YAML maps onto deployment options, and that Ray stays unimported unless
`--backend ray` is chosen."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvserve.config import EngineConfig
from kvserve.gateway.config import ModelsConfig
from kvserve.serve_ray.autoscaling import (
    BATCH_SLOTS_METRIC,
    RUNNING_METRIC,
    WAITING_METRIC,
    QueueDepthPolicy,
    desired_replicas,
)


def context(replicas: int, engine_waiting: list[float], running: list[float], handle_queued: float):
    """Ray Serve's AutoscalingContext as the controller builds it, for `replicas` replicas of 4 slots."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="model0-m", app_name="kvserve")
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(replicas)]
    metrics = {WAITING_METRIC: dict(zip(ids, engine_waiting)), RUNNING_METRIC: dict(zip(ids, running)),
               BATCH_SLOTS_METRIC: {r: 4.0 for r in ids}}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name="kvserve", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=sum(engine_waiting) + sum(running),
        total_queued_requests=handle_queued, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=AutoscalingConfig(min_replicas=1, max_replicas=8))


def test_queue_depth_policy_scales_on_waiting_requests_per_replica():
    pytest.importorskip("ray.serve")
    policy = QueueDepthPolicy(target_queue_depth=2)
    # A full batch and 2 waiting on one replica: exactly the target, no change.
    assert policy(context(1, [2], [4], 0))[0] == 1
    # 2 in the engine's queue and 5 more at the ingress: 7 waiting for 1 replica -> ceil(7 / 2) = 4.
    assert policy(context(1, [2], [4], 5))[0] == 4
    # Busy but nobody waiting: 7 running fill 2 replicas of 4 slots; the queue alone would say 0.
    assert policy(context(2, [0, 0], [4, 3], 0))[0] == 2
    # 3 running fit one replica: scale down.
    assert policy(context(2, [0, 0], [2, 1], 0))[0] == 1
    # Idle: 0 (Ray then applies min_replicas and the downscale delay).
    assert policy(context(3, [0, 0, 0], [0, 0, 0], 0))[0] == 0
    # A replica that has not reported yet counts as empty, not as an error.
    assert policy(context(2, [3], [4], 0))[0] == 2


def test_desired_replicas_is_ray_default_formula_on_waiting_requests():
    # Ray's default: desired = total ongoing / target ongoing per replica. Here: waiting / target depth.
    assert desired_replicas(waiting=12, running=0, batch_slots=8, target_queue_depth=4) == 3
    assert desired_replicas(waiting=0, running=12, batch_slots=8, target_queue_depth=4) == 1.5
    assert desired_replicas(waiting=0, running=0, batch_slots=None, target_queue_depth=4) == 0


def test_yaml_maps_onto_ray_serve_deployment_options():
    from kvserve.serve_ray.app import model_deployment_options

    config = ModelsConfig.from_dict({"models": [
        {"name": "small", "model": "smollm2-135m", "data_parallel_size": 2, "engine": {"max_num_seqs": 16},
         "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_queue_depth": 2.5,
                         "upscale_delay_s": 1, "downscale_delay_s": 10}},
        {"name": "large", "model": "gemma3-270m", "data_parallel_size": 3}],
        "admission": {"max_waiting": 50}})
    small, large = config.models
    opts = model_deployment_options(small, small.engine_config(EngineConfig()), 50, 30.0)
    scaling = opts["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (1, 4, 2)
    assert (scaling["upscale_delay_s"], scaling["downscale_delay_s"]) == (1, 10)
    assert scaling["policy"]["policy_function"] is QueueDepthPolicy
    assert scaling["policy"]["policy_kwargs"] == {"target_queue_depth": 2.5}
    # A full batch plus ceil(2.5) waiting per replica; the rest wait at the ingress, counted as queue depth.
    assert opts["max_ongoing_requests"] == 16 + 3 and opts["max_queued_requests"] == 50
    fixed = model_deployment_options(large, large.engine_config(EngineConfig()), 50, 30.0)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    # A replica scaled away finishes its streams: Ray's drain timeout had been --shutdown-grace (0: cut at once).
    for grace in (0.0, 30.0):
        drain = model_deployment_options(small, small.engine_config(EngineConfig()), 50, grace)
        assert drain["graceful_shutdown_timeout_s"] >= 600
    assert model_deployment_options(small, small.engine_config(EngineConfig()), 50, 900.0)[
        "graceful_shutdown_timeout_s"] == 900.0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`kvserve ARGS` in a fresh interpreter, which says at the end whether Ray got imported."""
    script = textwrap.dedent(f"""
        import sys
        from kvserve.entrypoints.cli import main
        try:
            rc = main({list(args)!r})
        except SystemExit as e:  # --help
            rc = e.code
        print("RAY_IMPORTED" if "ray" in sys.modules else "RAY_NOT_IMPORTED")
        sys.exit(rc)
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_ray_is_not_imported_without_backend_ray(tmp_path):
    out = run_cli("serve", "--help")
    assert "--backend {local,ray}" in out.stdout and "RAY_NOT_IMPORTED" in out.stdout
    bad = tmp_path / "models.yaml"
    bad.write_text("models:\n  - name: a\n    model: smollm2-135m\n    autoscaling: {max_replicas: 0}\n")
    # A config error is reported before Ray is touched, with the field named.
    out = run_cli("serve", "--backend", "ray", "--models-config", str(bad))
    assert out.returncode == 2 and "models[0].autoscaling.max_replicas" in out.stderr
    assert "RAY_NOT_IMPORTED" in out.stdout
    auto = tmp_path / "auto.yaml"
    auto.write_text("models:\n  - {name: a, model: smollm2-135m}\n  - {name: b, model: smollm2-135m}\n"
                    "routing:\n  auto: {small: a, large: b}\n")
    out = run_cli("serve", "--backend", "ray", "--models-config", str(auto))
    assert out.returncode == 2 and "routing.auto is not supported with --backend ray" in out.stderr


def test_the_command_lines_models_reach_ray_as_they_reach_the_local_gateway(tmp_path):
    """-dp, several models on the command line and --max-waiting were dropped on the way to Ray (one model,
    one replica, max_waiting 256); a model both on the command line and in --models-config, and
    --routing-policy (the local gateway's choice; Ray Serve's router picks the replica), are refused."""
    from kvserve.entrypoints.cli import _server_args, build_parser, engine_config, models_config
    from kvserve.serve_ray.launch import models_config_for

    def for_ray(*argv: str) -> ModelsConfig:
        args = build_parser().parse_args(["serve", "--backend", "ray", *argv])
        config = engine_config(args, max_waiting=args.max_waiting)
        return models_config_for(models_config(args), _server_args(args, config, None))

    config = for_ray("smollm2-135m", "gemma3-270m", "-dp", "2", "--max-waiting", "5")
    assert [(m.name, m.model, m.data_parallel_size) for m in config.models] == [
        ("smollm2-135m", "smollm2-135m", 2), ("gemma3-270m", "gemma3-270m", 2)]
    assert config.admission.max_waiting == 5
    one = for_ray("--max-waiting", "7", "--served-model-name", "smol")
    assert [(m.name, m.data_parallel_size) for m in one.models] == [("smol", 1)] and one.admission.max_waiting == 7
    yaml_path = tmp_path / "models.yaml"
    yaml_path.write_text("models:\n  - {name: a, model: smollm2-135m}\n")
    out = run_cli("serve", "smollm2-135m", "--backend", "ray", "--models-config", str(yaml_path))
    assert out.returncode == 2 and "not both" in out.stderr and "RAY_NOT_IMPORTED" in out.stdout
    out = run_cli("serve", "--backend", "ray", "--routing-policy", "round_robin")
    assert out.returncode == 2 and "--routing-policy" in out.stderr and "RAY_NOT_IMPORTED" in out.stdout
