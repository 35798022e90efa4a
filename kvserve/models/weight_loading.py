"""Hugging Face-named checkpoint tensors -> a decoder model's layers.

Projections go to their fused linear layer's shard through its shape-checked `weight_loader`; every other
tensor (norms) is copied into the parameter of the same name. Every weight must be present. The model
provides `embed_tokens`, `lm_head` and the usual `model.layers.{i}.self_attn/mlp.*_proj` names.
"""
from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from kvserve.layers.linear import LinearBase, pack_float_weights
from kvserve.layers.quantization.methods import Loaded, as_float

# Hugging Face projection name -> (our fused layer, shard index in it)
PROJECTION_SHARDS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                     "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                     "down_proj": ("down_proj", 0)}


def linear_layers(model: nn.Module) -> list[LinearBase]:
    """Each linear layer once (a tied LM head is the embedding itself)."""
    return list(dict.fromkeys(m for m in model.modules() if isinstance(m, LinearBase)))


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, Loaded]], tie_word_embeddings: bool) -> None:
    """Route each tensor to its layer, then finalize every linear layer and re-lay float bf16 weights where
    that pays (pack_float_weights, after tying): a native decoder stack built next takes the final tensors."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and tie_word_embeddings):
            continue
        parts = name.split(".")
        if name == "embed_tokens.weight":
            model.embed_tokens.weight_loader(0, tensor)
        elif name == "lm_head.weight":
            model.lm_head.weight_loader(0, tensor)
        elif len(parts) >= 2 and parts[-2] in PROJECTION_SHARDS:
            layer_name, shard = PROJECTION_SHARDS[parts[-2]]
            layer = model.get_submodule(".".join(parts[:-2] + [layer_name]))
            if parts[-1] == "weight":
                layer.weight_loader(shard, tensor)
            else:
                layer.bias_loader(shard, as_float(tensor))
        elif name in params:
            tensor = as_float(tensor)
            if params[name].shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        else:
            raise ValueError(f"unexpected weight {name!r}: the checkpoint is not one of this architecture's as "
                             f"kvserve reads it")  # a KeyError had come out as a traceback
    layers = linear_layers(model)
    missing = [n for layer in layers for n in layer.missing()]
    missing += sorted(n for n, p in params.items() if n not in loaded and not _owned_by_linear(model, n))
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")
    for layer in layers:
        layer.finalize()
    pack_float_weights(model)  # bf16 on CPU only; a no-op elsewhere


def _owned_by_linear(model: nn.Module, param_name: str) -> bool:
    """Biases of linear layers are loaded (and checked) by the layers themselves."""
    owner = model.get_submodule(param_name.rpartition(".")[0])
    return isinstance(owner, LinearBase)
