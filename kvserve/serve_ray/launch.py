"""`kvserve serve --backend ray`: check the models config and the installed pieces before Ray starts, so a
mistake fails in a second with a clear message instead of inside a replica minutes later."""
from __future__ import annotations

import importlib.util

from kvserve.entrypoints.openai.api_server import ServerArgs
from kvserve.gateway.config import ModelsConfig, ModelsConfigError
from kvserve.models.presets import DEFAULT_PRESET


def models_config_for(models: ModelsConfig | None, args: ServerArgs) -> ModelsConfig:
    """The command line's models config (--models-config, several models, -dp, --max-waiting: the same rules
    as the local backend's, cli.models_config); without one, the single model as one deployment."""
    if models is not None:
        config = models
    else:
        name = args.model_names()[0]
        config = ModelsConfig.from_dict({"models": [{"name": name, "model": args.engine.model or DEFAULT_PRESET}]})
        if args.engine.max_waiting is not None:    # --max-waiting: the ingress's line, as the local server's
            config.admission.max_waiting = args.engine.max_waiting
    if config.routing.auto:
        # Easy/hard routing lives in the local gateway; Ray Serve's router only balances replicas of a name.
        raise ModelsConfigError("routing.auto is not supported with --backend ray (use --backend local)")
    return config


def serve_with_ray(models: ModelsConfig | None, args: ServerArgs) -> int:
    from kvserve.models.presets import resolve_model

    config = models_config_for(models, args)
    for entry in config.models:
        resolve_model(entry.model)   # a missing preset fails here, with its pip command
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise ValueError("--backend ray needs Ray Serve: pip install 'kvserve[ray]'")
    from kvserve.serve_ray.app import run_ray_server

    return run_ray_server(config, args, args.engine_mode)
