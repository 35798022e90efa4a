"""GGUF file -> ModelConfig, Hugging Face-named weights (raw: kept in the file's blocks or dequantized,
as each layer's method decides) and tokenizer metadata."""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from kvserve.config import ModelConfig
from kvserve.layers.quantization.blocks import BlockWeight
from kvserve.tokenizer.gguf_tokenizer import gguf_end_token_ids
from kvserve.models.gemma3 import default_layer_types
from kvserve.models.gguf_blocks import FLOAT_TYPES, to_block_weight
from kvserve.models.gguf_file import GGUFFile

_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

# GGUF tensor name -> Hugging Face name ({} is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around both sublayers: its "ffn_norm" is the norm before the MLP, not after attention.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """gguf.GGUFReader's fields as Python values (kvserve's loader reads files with gguf_file.read_gguf)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def gguf_model_config(meta: dict[str, Any], tensors: dict[str, Any]) -> ModelConfig:
    """tensors: the reader's tensors by name (names say which optional parts exist; rope_freqs is read)."""
    if int(meta.get("split.count", 1) or 1) > 1:  # llama.cpp's gguf-split: only one part is here
        raise ValueError(f"this is part {int(meta.get('split.no', 0)) + 1} of a GGUF split in "
                         f"{int(meta['split.count'])} files; kvserve reads one file: merge them first "
                         f"(llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf`)")
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if (get("expert_count") or 0) > 1:  # its expert tensors had been refused one by one as unexpected
        raise ValueError(f"mixture-of-experts models ({get('expert_count')} experts) are not supported")
    missing = [f"{arch}.{k}" for k in ("embedding_length", "attention.head_count", "block_count",
                                        "feed_forward_length") if get(k) is None]
    if missing:  # a LoRA adapter's GGUF, say: it holds no model
        raise ValueError(f"the GGUF lacks {', '.join(missing)}: it does not describe a whole {arch} model")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    scaling = None
    kind = get("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        # As a config.json asking for it is refused: dropped, the model ran unscaled RoPE at every length (and
        # was offered its extended context).
        raise ValueError(f"unsupported rope scaling type {kind!r} in the GGUF (supported: none, linear)")
    if "rope_freqs.weight" in tensors:
        # Llama-3.x: llama.cpp's converter stores the scaled RoPE as one divisor per frequency.
        t = tensors["rope_freqs.weight"]
        scaling = {"rope_type": "freq_factors",
                   "factors": gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).tolist()}
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    extra = _gemma3_fields(meta, int(get("block_count")), int(hidden), int(heads), int(head_dim)) \
        if arch == "gemma3" else {}
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(get("attention.head_count_kv") or heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=get("attention.sliding_window"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_end_token_ids(meta),
        **extra,
    )


def _gemma3_fields(meta: dict[str, Any], layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """What a Gemma 3 GGUF leaves out, as llama.cpp fills it in: every 6th layer global, RoPE base 10000 on
    sliding layers (any rope scaling is the global layers'), scores scaled by head_dim ** -0.5 except in
    the 62-layer 27B model, whose query_pre_attn_scalar is hidden / heads."""
    return dict(
        layer_types=default_layer_types(layers),
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        final_logit_softcapping=meta.get("gemma3.final_logit_softcapping"),
    )


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows: within each head it interleaves the two
    rotary halves (pairs (i, i + D/2) become adjacent rows); HF's rotate-half layout keeps them split."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFTensor:
    """A GGUF tensor as stored in the (memory-mapped) file; rows are output features.
    unpermute_heads: undo llama.cpp's Q/K row order for this many heads (0: none).
    offset: added to the values (Gemma's norms: llama.cpp stores 1 + w, Hugging Face w)."""
    name: str
    data: np.ndarray
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]           # torch order (slowest dim first)
    unpermute_heads: int = 0
    offset: float = 0.0

    @property
    def quantized(self) -> bool:
        return self.qtype not in FLOAT_TYPES

    def to_float(self) -> torch.Tensor:
        w = gguf.quants.dequantize(self.data, self.qtype).reshape(self.shape)
        w = np.ascontiguousarray(self._rows(w), dtype=np.float32)
        if self.offset:
            w = w + np.float32(self.offset)
        # Unquantized tensors are read-only views of the memory-mapped file.
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    def to_blocks(self) -> BlockWeight:
        assert not self.offset, "offset tensors (norms) are never kept quantized"
        if len(self.shape) != 2:
            raise ValueError(f"GGUF tensor {self.name!r} of shape {self.shape} is not a matrix")
        try:
            return to_block_weight(self._rows(self.data), self.qtype, self.shape)
        except ValueError as e:
            raise ValueError(f"GGUF tensor {self.name!r}: {e}") from None

    def _rows(self, a: np.ndarray) -> np.ndarray:
        """Rows (first dim) in Hugging Face order; a block's bytes stay together with their row."""
        return unpermute_qk(a, self.unpermute_heads) if self.unpermute_heads else a


def iter_gguf_weights(reader: GGUFFile | gguf.GGUFReader, cfg: ModelConfig, arch: str
                      ) -> Iterator[tuple[str, GGUFTensor]]:
    # llama.cpp permutes Q/K only for archs whose converter targets its "normal" (adjacent-pair) RoPE.
    permuted = arch in ("llama", "mistral")
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read into the config's rope_scaling, not a weight
            continue
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            m = _LAYER_RE.fullmatch(t.name)
            if m is None or m.group(2) not in layer_names:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
        heads = 0
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = cfg.num_attention_heads
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = cfg.num_key_value_heads
        # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
        shape = tuple(reversed([int(d) for d in t.shape]))
        offset = -1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        yield name, GGUFTensor(t.name, t.data, t.tensor_type, shape, heads, offset)
