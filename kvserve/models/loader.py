"""load_model: a Hugging Face directory, a GGUF file, a preset name (kvserve/models/presets.py) or None (the
embedded default) -> model + tokenizer."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import ModelConfig
from kvserve.layers.quantization import QuantConfig
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.gguf import GGUFTensor, gguf_model_config, iter_gguf_weights
from kvserve.models.gguf_file import read_gguf
from kvserve.models.hf import iter_hf_weights, read_hf_config
from kvserve.models.presets import resolve_model
from kvserve.models.registry import CausalLM, build_model
from kvserve.tokenizer.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer


def load_model(path: str | None, dtype: torch.dtype, device: torch.device, tokenizer: str | None = None,
               quantization: str = "auto", group_size: int = 32) -> LoadedModel:
    """tokenizer: a Hugging Face directory or GGUF file whose tokenizer replaces the model's own.
    quantization: see QuantConfig (auto keeps a GGUF's quantized blocks; none, int8, int4)."""
    quant = QuantConfig(quantization, group_size, dtype, device)
    return _load(path, quant, tokenizer)


def load_tokenizer(path: str, eos_token_ids: list[int] | None = None) -> Tokenizer:
    p = Path(resolve_model(path))
    if p.is_dir():
        return Tokenizer.from_hf_dir(p, eos_token_ids)
    if p.is_file() and p.suffix == ".gguf":
        return Tokenizer.from_gguf_fields(read_gguf(p).metadata)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    raise ValueError(f"tokenizer {path!r} is neither a Hugging Face directory nor a .gguf file")


def _load(path: str | None, quant: QuantConfig, tokenizer_path: str | None) -> LoadedModel:
    """tokenizer_path, when given, is the only tokenizer read: the model's own is never built, so one that
    kvserve cannot rebuild (an unsupported GGUF pre-tokenizer, a directory without tokenizer.json) is no error."""
    path = resolve_model(path)  # a preset name or None (the default) -> the file it names
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
        cfg = read_hf_config(p)
        tokenizer = (load_tokenizer(tokenizer_path, cfg.eos_token_ids) if tokenizer_path is not None
                     else Tokenizer.from_hf_dir(p, cfg.eos_token_ids))
        return LoadedModel(_build(cfg, iter_hf_weights(p), quant), cfg, tokenizer)
    if p.is_file() and p.suffix == ".gguf":
        file = read_gguf(p)
        meta = file.metadata
        cfg = gguf_model_config(meta, {t.name: t for t in file.tensors})
        tokenizer = (load_tokenizer(tokenizer_path, cfg.eos_token_ids) if tokenizer_path is not None
                     else Tokenizer.from_gguf_fields(meta))
        weights = list(iter_gguf_weights(file, cfg, meta["general.architecture"]))
        quant.quantized_tensors = {name: t.quantized for name, t in weights}
        return LoadedModel(_build(cfg, weights, quant), cfg, tokenizer)
    if not p.exists():
        raise FileNotFoundError(f"model path {path!r} does not exist (no model hub access: pass a local path)")
    raise ValueError(f"{path!r} is neither a Hugging Face model directory nor a .gguf file")


def _build(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor | GGUFTensor]], quant: QuantConfig
           ) -> CausalLM:
    if cfg.architecture == "gemma3" and quant.dtype == torch.float16:
        # As vLLM refuses it: Gemma 3's activations overflow float16, and every logit became NaN (the argmax, token
        # 0, came out for ever with no error).
        raise ValueError("Gemma 3 is numerically unstable in float16: use --dtype bfloat16 or float32")
    # Linear layers make their weights from the loaded shards (finalize); construction itself only makes
    # norm weights and RoPE tables, so it runs on the target device directly. (On the meta device, the
    # first tensor op went through torch's Python reference kernels, whose imports cost ~1-2 s a start.)
    with torch.device(quant.device):
        model = build_model(cfg, quant).to(quant.dtype)
    for m in model.modules():  # every RoPE table (Gemma has one per layer kind), float32 again after the cast
        if isinstance(m, RotaryEmbedding):
            m.reset_table(quant.device)
    model.load_weights(weights)
    return model.eval().requires_grad_(False)
