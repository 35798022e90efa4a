"""`--models-config FILE.yaml`: which models one endpoint serves, how many replicas each, how requests are
routed and admitted. Parsed once at start-up with errors that name the offending field, so a typo fails
the launch instead of a request. The same dataclasses back the short form `kvserve serve A B`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvserve.config import EngineConfig
from kvserve.utils.value_checks import is_finite, is_int

RoutingPolicy = Literal["cache_aware", "least_loaded", "round_robin"]
ROUTING_POLICIES = ("cache_aware", "least_loaded", "round_robin")
AUTO_MODEL = "auto"                       # the model name that asks the gateway to pick small or large
# Engine processes per model: each holds a copy of the weights, so this is a bound against a typo (10**30 grew
# the replica list until memory ran out), not a measured limit.
MAX_DATA_PARALLEL_SIZE = 256
# max_waiting: the gateway's line is the model's (admission.max_waiting); an engine's own bound was dropped unsaid.
_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)} - {"model", "max_waiting"}


class ModelsConfigError(ValueError):
    """A models config that cannot be served; the message names the field (e.g. models[1].name)."""


MIN_TARGET_QUEUE_DEPTH = 0.01  # waiting requests per replica


@dataclass
class AutoscalingConfig:
    """Ray Serve only: replicas follow the waiting requests per replica, not CPU utilisation."""
    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_depth: float = 4.0       # waiting requests per replica that trigger a scale-up
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0

    def check(self, where: str) -> None:
        # Types first: a YAML string or bool had raised a TypeError below, and 1.5 replicas or a NaN were taken.
        for name in ("min_replicas", "max_replicas"):
            if not is_int(getattr(self, name)):
                raise ModelsConfigError(f"{where}.{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("target_queue_depth", "upscale_delay_s", "downscale_delay_s"):
            value = getattr(self, name)
            if not is_finite(value) or value < 0:
                raise ModelsConfigError(f"{where}.{name} must be a finite number >= 0, got {value!r}")
        if self.min_replicas < 0:
            raise ModelsConfigError(f"{where}.min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ModelsConfigError(f"{where}.max_replicas must be >= max(1, min_replicas), got {self.max_replicas}")
        # Below this, waiting / depth overflowed to infinity in the policy, which then failed every tick.
        if self.target_queue_depth < MIN_TARGET_QUEUE_DEPTH:
            raise ModelsConfigError(f"{where}.target_queue_depth must be >= {MIN_TARGET_QUEUE_DEPTH} (waiting "
                                    f"requests per replica), got {self.target_queue_depth}")


@dataclass
class ModelEntry:
    name: str                             # the `model` field clients send
    model: str                            # preset name, HF directory or .gguf file
    data_parallel_size: int = 1           # engine processes (replicas) behind this name
    # EngineConfig fields for this model's engines (e.g. {"max_num_seqs": 64, "quantization": "int8"}).
    engine: dict[str, Any] = field(default_factory=dict)
    autoscaling: AutoscalingConfig | None = None

    def engine_config(self, base: EngineConfig | None = None) -> EngineConfig:
        """This model's EngineConfig: `base` (the command line's engine options) overridden by `engine`."""
        values = {f.name: getattr(base, f.name) for f in fields(EngineConfig)} if base else {}
        values.update(self.engine)
        values["model"] = self.model
        return EngineConfig(**values)


@dataclass
class RoutingConfig:
    policy: RoutingPolicy = "cache_aware"
    # {"small": NAME, "large": NAME}: clients may send model "auto" and the gateway picks one of the two.
    auto: dict[str, str] | None = None


@dataclass
class AdmissionConfig:
    max_waiting: int = 256                # per model; beyond it a request gets 429 with Retry-After


@dataclass
class ModelsConfig:
    models: list[ModelEntry]
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def model_names(self) -> list[str]:
        return [m.name for m in self.models] + ([AUTO_MODEL] if self.routing.auto else [])

    def entry(self, name: str) -> ModelEntry | None:
        return next((m for m in self.models if m.name == name), None)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> ModelsConfig:
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ModelsConfigError(f"cannot read models config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ModelsConfigError(f"models config {path} is not valid YAML: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_models(cls, models: list[str]) -> ModelsConfig:
        """The short form `kvserve serve A B`: one replica each, named by what was typed."""
        return cls.from_dict({"models": [{"name": m, "model": m} for m in models]})

    @classmethod
    def from_dict(cls, data: Any) -> ModelsConfig:
        if not isinstance(data, dict):
            raise ModelsConfigError("models config must be a mapping with a 'models' list")
        _no_unknown(data, {"models", "routing", "admission"}, "models config")
        raw_models = data.get("models")
        if not isinstance(raw_models, list) or not raw_models:
            raise ModelsConfigError("models must be a non-empty list")
        models = [_model_entry(m, f"models[{i}]") for i, m in enumerate(raw_models)]
        names = [m.name for m in models]
        for name in names:
            if names.count(name) > 1:
                raise ModelsConfigError(f"models: the name {name!r} is used twice")
            if name == AUTO_MODEL:
                raise ModelsConfigError(f"models: {AUTO_MODEL!r} is reserved for routing.auto")
        routing = _routing(data.get("routing") or {}, set(names))
        admission = _admission(data.get("admission") or {})
        return cls(models=models, routing=routing, admission=admission)


def _no_unknown(d: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise ModelsConfigError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _model_entry(d: Any, where: str) -> ModelEntry:
    if not isinstance(d, dict):
        raise ModelsConfigError(f"{where} must be a mapping with name and model")
    _no_unknown(d, {"name", "model", "data_parallel_size", "engine", "autoscaling"}, where)
    for key in ("name", "model"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise ModelsConfigError(f"{where}.{key} must be a non-empty string")
    dp = d.get("data_parallel_size", 1)
    if not is_int(dp) or not 1 <= dp <= MAX_DATA_PARALLEL_SIZE:
        raise ModelsConfigError(f"{where}.data_parallel_size must be an integer in [1, {MAX_DATA_PARALLEL_SIZE}], "
                                f"got {dp!r}")
    engine = d.get("engine") or {}
    if not isinstance(engine, dict):
        raise ModelsConfigError(f"{where}.engine must be a mapping of engine options")
    if "max_waiting" in engine:
        raise ModelsConfigError(f"{where}.engine.max_waiting: a model's waiting line is the gateway's, set once for "
                                f"every model as admission.max_waiting")
    _no_unknown(engine, _ENGINE_FIELDS, f"{where}.engine")
    try:
        EngineConfig(**engine)
    except (TypeError, ValueError) as e:
        raise ModelsConfigError(f"{where}.engine: {e}") from None
    autoscaling = None
    if d.get("autoscaling") is not None:
        a = d["autoscaling"]
        if not isinstance(a, dict):
            raise ModelsConfigError(f"{where}.autoscaling must be a mapping")
        _no_unknown(a, {f.name for f in fields(AutoscalingConfig)}, f"{where}.autoscaling")
        autoscaling = AutoscalingConfig(**a)
        autoscaling.check(f"{where}.autoscaling")
    return ModelEntry(name=d["name"], model=d["model"], data_parallel_size=dp, engine=dict(engine),
                      autoscaling=autoscaling)


def _routing(d: Any, names: set[str]) -> RoutingConfig:
    if not isinstance(d, dict):
        raise ModelsConfigError("routing must be a mapping")
    _no_unknown(d, {"policy", "auto"}, "routing")
    policy = d.get("policy", "cache_aware")
    if policy not in ROUTING_POLICIES:
        raise ModelsConfigError(f"routing.policy must be {'|'.join(ROUTING_POLICIES)}, got {policy!r}")
    auto = d.get("auto")
    if auto is not None:
        if not isinstance(auto, dict) or set(auto) != {"small", "large"}:
            raise ModelsConfigError("routing.auto must be a mapping with exactly the keys small and large")
        for role, name in auto.items():
            if not isinstance(name, str) or name not in names:
                raise ModelsConfigError(f"routing.auto.{role}: no model named {name!r} in models")
    return RoutingConfig(policy=policy, auto=dict(auto) if auto else None)


def _admission(d: Any) -> AdmissionConfig:
    if not isinstance(d, dict):
        raise ModelsConfigError("admission must be a mapping")
    _no_unknown(d, {"max_waiting"}, "admission")
    mw = d.get("max_waiting", 256)
    if not is_int(mw) or mw < 1:
        raise ModelsConfigError(f"admission.max_waiting must be an integer >= 1, got {mw!r}")
    return AdmissionConfig(max_waiting=mw)
