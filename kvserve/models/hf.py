"""Hugging Face directory -> ModelConfig and weights (safetensors only; pickle checkpoints are refused
because loading them can run arbitrary code)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.config import ModelConfig
from kvserve.models.gemma3 import FULL, SLIDING, default_layer_types

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}


def read_hf_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported model architecture {archs or cfg.get('model_type')!r} in {path}/config.json; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    quant = cfg.get("quantization_config")
    if quant:  # its weights would have been read as floats, their scales left aside
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"pre-quantized checkpoints are not supported (quantization_config quant_method "
                         f"{method!r}): give the unquantized model (kvserve quantizes it with --quantization) "
                         f"or a GGUF file")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{path}/config.json lacks {', '.join(missing)}")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if arch != "gemma3" and cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    heads = cfg["num_attention_heads"]
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rope or cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    sliding = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3"):
        sliding = _qwen_sliding_window(cfg, arch)
    fields = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_window=sliding,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=hf_eos_ids(path, cfg),
    )
    if arch == "gemma3":
        fields.update(gemma3_fields(cfg))
    return ModelConfig(**fields)


def _qwen_sliding_window(cfg: dict, arch: str) -> int | None:
    """Qwen's window, which transformers applies only from layer max_window_layers up (layer_types spells it
    out): every layer had slid where use_sliding_window was set, also on layers that attend to everything."""
    if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
        return None
    layers = cfg["num_hidden_layers"]
    first = cfg.get("max_window_layers", layers)
    kinds = set(cfg.get("layer_types") or
                ["sliding_attention" if i >= first else "full_attention" for i in range(layers)])
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ValueError(f"a sliding window on some layers only (use_sliding_window with max_window_layers or "
                         f"layer_types) is not supported for {arch}")
    return cfg["sliding_window"]


def gemma3_fields(cfg: dict) -> dict:
    """Gemma 3's own config.json keys, in transformers 5's form (layer_types, rope_parameters per layer
    kind) or 4.x's (sliding_window_pattern, rope_theta + rope_local_base_freq + rope_scaling)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma 3 hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (kvserve is causal only)")
    rope = cfg.get("rope_parameters") or {}
    if FULL in rope or SLIDING in rope:
        global_rope, local_rope = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    else:
        global_rope = dict(rope or cfg.get("rope_scaling") or {})
        global_rope.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local_rope = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    theta = float(global_rope.pop("rope_theta", 1_000_000.0))
    local_theta = float(local_rope.pop("rope_theta", 10_000.0))
    if local_rope.get("rope_type", local_rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling on sliding-window layers is not supported: {local_rope}")
    if global_rope.get("rope_type", global_rope.get("type")) in ("default", None):
        global_rope = {}
    layer_types = cfg.get("layer_types") or default_layer_types(
        cfg["num_hidden_layers"], cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return dict(
        rope_theta=theta,
        rope_scaling=global_rope or None,
        rope_local_theta=local_theta,
        layer_types=list(layer_types),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        sliding_window=cfg.get("sliding_window", 4096),
        qk_norm=True,
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def hf_eos_ids(path: Path, cfg: dict) -> list[int]:
    """Union of config.json's and generation_config.json's eos_token_id (either may be an int or a list)."""
    ids: list[int] = []
    sources = [cfg]
    if (path / "generation_config.json").exists():
        sources.append(json.loads((path / "generation_config.json").read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ValueError(
            f"{path} only has pickle checkpoints (.bin/.pt), which kvserve does not load because unpickling "
            "can run arbitrary code; convert them to safetensors first"
        )
    raise FileNotFoundError(f"no *.safetensors weights in {path}")


def iter_hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        if not file.exists():
            raise FileNotFoundError(f"{file} is named in the index but missing")
        try:
            f = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors' own error type: a file cut short (a download that stopped) or damaged
            raise ValueError(f"{file} is not a readable safetensors file ({e})") from None
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)
