"""Architecture name (ModelConfig.architecture, read from config.json or GGUF metadata) -> model class."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from kvserve.attention.backend import AttentionMetadata, KVCache
from kvserve.config import ModelConfig
from kvserve.layers.linear import LinearBase
from kvserve.layers.quantization import QuantConfig
from kvserve.layers.quantization.methods import Loaded
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.llama import LlamaForCausalLM


class CausalLM(Protocol):
    """What the loader and the model runner use of a model."""
    config: ModelConfig

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[KVCache]) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def linear_layers(self) -> list[LinearBase]: ...

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None: ...


# Llama, Mistral, Qwen2 and Qwen3 differ only in flags that LlamaForCausalLM reads from the config.
MODEL_CLASSES: dict[str, type[torch.nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(architecture: str) -> type[torch.nn.Module]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"no model class for architecture {architecture!r}; supported: "
                         f"{', '.join(MODEL_CLASSES)}") from None


def build_model(cfg: ModelConfig, quant: QuantConfig) -> CausalLM:
    return model_class(cfg.architecture)(cfg, quant)
