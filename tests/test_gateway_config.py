"""The models config: what the README's example means, and errors that name the field."""
import pytest

from kvserve.gateway.config import AUTO_MODEL, ModelsConfig, ModelsConfigError

EXAMPLE = """
models:
  - name: small
    model: smollm2-135m
    data_parallel_size: 2
    engine: {max_num_seqs: 64}
    autoscaling: {min_replicas: 1, max_replicas: 3, target_queue_depth: 8}
  - name: large
    model: gemma3-270m
routing:
  policy: cache_aware
  auto: {small: small, large: large}
admission:
  max_waiting: 32
"""


def test_example_parses(tmp_path):
    p = tmp_path / "models.yaml"
    p.write_text(EXAMPLE)
    cfg = ModelsConfig.from_yaml(p)
    assert [m.name for m in cfg.models] == ["small", "large"]
    assert cfg.model_names() == ["small", "large", AUTO_MODEL]
    small = cfg.entry("small")
    assert small.data_parallel_size == 2 and small.autoscaling.max_replicas == 3
    ec = small.engine_config()
    assert ec.model == "smollm2-135m" and ec.max_num_seqs == 64
    assert cfg.admission.max_waiting == 32 and cfg.routing.policy == "cache_aware"


def test_short_form():
    cfg = ModelsConfig.from_models(["smollm2-135m", "gemma3-270m"])
    assert cfg.model_names() == ["smollm2-135m", "gemma3-270m"]
    assert cfg.routing.auto is None


@pytest.mark.parametrize("data, field", [
    ({"models": []}, "models"),
    ({"models": [{"name": "a"}]}, "models[0].model"),
    ({"models": [{"name": "a", "model": "x", "data_parallel_size": 0}]}, "models[0].data_parallel_size"),
    ({"models": [{"name": "a", "model": "x", "data_parallel_size": 10**30}]}, "models[0].data_parallel_size"),
    ({"models": [{"name": "a", "model": "x", "engine": {"max_num_seqz": 1}}]}, "models[0].engine"),
    ({"models": [{"name": "a", "model": "x", "engine": {"max_num_seqs": 0}}]}, "models[0].engine"),
    # YAML hands values over as written: a bool or a float where an integer belongs is refused, not used.
    ({"models": [{"name": "a", "model": "x", "engine": {"num_threads": True}}]}, "num_threads must be an integer"),
    ({"models": [{"name": "a", "model": "x", "engine": {"max_num_seqs": 2.5}}]}, "max_num_seqs must be an integer"),
    ({"models": [{"name": "a", "model": "x"}, {"name": "a", "model": "y"}]}, "used twice"),
    ({"models": [{"name": "auto", "model": "x"}]}, "reserved"),
    ({"models": [{"name": "a", "model": "x"}], "routing": {"policy": "random"}}, "routing.policy"),
    ({"models": [{"name": "a", "model": "x"}], "routing": {"auto": {"small": "a", "large": "b"}}},
     "routing.auto.large"),
    ({"models": [{"name": "a", "model": "x"}], "admission": {"max_waiting": -1}}, "admission.max_waiting"),
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"max_replicas": 0}}]}, "autoscaling.max_replicas"),
    # These had raised a TypeError (a traceback at start-up) or were taken as written.
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"min_replicas": "2"}}]}, "autoscaling.min_replicas"),
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"max_replicas": True}}]}, "autoscaling.max_replicas"),
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"min_replicas": 1.5}}]}, "autoscaling.min_replicas"),
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"target_queue_depth": "x"}}]},
     "autoscaling.target_queue_depth"),
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"target_queue_depth": float("nan")}}]},
     "autoscaling.target_queue_depth"),
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"upscale_delay_s": -5}}]}, "autoscaling.upscale_delay_s"),
    ({"models": [{"name": "a", "model": "x", "autoscaling": {"target_queue_depth": 1e-320}}]},
     "autoscaling.target_queue_depth"),
    ({"models": [{"name": "a", "model": "x"}], "routing": {"auto": {"small": ["a"], "large": "a"}}},
     "routing.auto.small"),
    # Accepted, then dropped: the gateway's line is admission.max_waiting.
    ({"models": [{"name": "a", "model": "x", "engine": {"max_waiting": 3}}]}, "admission.max_waiting"),
    ({"modles": []}, "modles"),
])
def test_errors_name_the_field(data, field):
    with pytest.raises(ModelsConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelsConfig.from_dict(data)


def test_bad_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("models: [\n")
    with pytest.raises(ModelsConfigError, match="not valid YAML"):
        ModelsConfig.from_yaml(p)
