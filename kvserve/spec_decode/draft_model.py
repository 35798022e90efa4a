"""The draft model of method "draft": a small decoder that proposes tokens, loaded next to the target.

Two kinds of draft:
- a draft checkpoint (kvserve/spec_decode/draft_format.py; the shipped one for the default model, or one
  that train_draft.py wrote): a few Llama layers that read the target's own token embedding and predict a
  reduced vocabulary (DraftLM below);
- any model kvserve loads (Hugging Face directory, GGUF file) with the target's tokenizer.

Either is used as the target is (forward over a paged KV cache of its own, compute_logits over the full
vocabulary), by kvserve/spec_decode/draft_proposer.py.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.attention.backend import AttentionMetadata, KVCache
from kvserve.layers.linear import ColumnLinear, VocabEmbedding
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantization import QuantConfig
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.llama import DecoderLayer, run_decoder_layers
from kvserve.models.loader import LoadedModel, load_model
from kvserve.models.native_stack import NativeDecoderStack
from kvserve.models.weight_loading import load_named_weights
from kvserve.spec_decode.draft_format import (SHIPPED_DRAFT, DraftFileConfig, file_quantization, is_draft_file,
                                               named_load_errors, read_draft)
from kvserve.tokenizer.tokenizer import Tokenizer

# Encoded by target and draft to check that they share a tokenizer (normaliser, pre-tokeniser, merges).
_TOKENIZER_PROBE = "Hello, world! The year 2024 was 366 days long.\n    def f(x):\n        return x ** 2  # ok"


def differing_token_ids(a: Tokenizer, b: Tokenizer) -> list[int]:
    """Ids both know that name different tokens: neither their vocabulary entries nor their decoded texts agree.

    A vocabulary that swaps or renames tokens encodes the probe alike unless the probe uses them, and would
    draft tokens the target reads as others (exact still, but nearly never accepted). Either agreement
    suffices, because the same tokenizer can spell its entries differently when read from a GGUF file. An id
    one side lacks (an added token) is not compared.
    """
    va = {i: t for t, i in a.backend.get_vocab(with_added_tokens=True).items()}
    vb = {i: t for t, i in b.backend.get_vocab(with_added_tokens=True).items()}
    unlike = [i for i in sorted(va.keys() & vb.keys()) if va[i] != vb[i]]
    if not unlike:
        return []
    texts_a = a.backend.decode_batch([[i] for i in unlike], skip_special_tokens=False)
    texts_b = b.backend.decode_batch([[i] for i in unlike], skip_special_tokens=False)
    return [i for i, x, y in zip(unlike, texts_a, texts_b) if x != y]


class DraftLM(nn.Module):
    """Llama layers over the target's embedding, with an LM head over vocab_ids only."""

    def __init__(self, cfg: ModelConfig, embed: VocabEmbedding, vocab_ids: torch.Tensor, quant: QuantConfig) -> None:
        super().__init__()
        self.config = cfg
        self._embed = (embed,)  # the target's module: a tuple keeps it out of this module's parameters
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, quant, f"model.layers.{i}", i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ColumnLinear(cfg.hidden_size, len(vocab_ids), quant.method(["lm_head.weight"]), "lm_head.weight")
        self.register_buffer("vocab_ids", vocab_ids.to(torch.int64), persistent=False)
        # The layers in one native call where it covers them, as for the target (set with the weights).
        self.native_stack: NativeDecoderStack | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers)
        x = self._embed[0].embed(input_ids).to(self.norm.weight.dtype)
        x, residual = run_decoder_layers(self, x, positions, meta, kv_caches)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits over the full vocabulary, -inf outside vocab_ids."""
        return full_vocab_logits(self.lm_head(hidden).float(), self.vocab_ids, self.config.vocab_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, tie_word_embeddings=False)
        self.native_stack = NativeDecoderStack.build(self)


def draft_model_config(target: ModelConfig, f: DraftFileConfig) -> ModelConfig:
    return dataclasses.replace(
        target, architecture="llama", num_hidden_layers=f.num_hidden_layers, intermediate_size=f.intermediate_size,
        num_attention_heads=f.num_attention_heads, num_key_value_heads=f.num_key_value_heads, head_dim=f.head_dim,
        rms_norm_eps=f.rms_norm_eps, rope_theta=f.rope_theta, rope_scaling=None, tie_word_embeddings=False,
        attention_bias=False, qk_norm=False, sliding_window=None, layer_types=None, final_logit_softcapping=None)


def draft_quantization(engine_quantization: str, device: torch.device, given: str | None = None) -> str:
    """A draft checkpoint's linear layers: speculative_config's quantization where given ("auto": the file's
    floats), else int8 weights on CPU (one pass of the 2-layer draft at batch 1 measured 2.4 ms in int8 against
    18-36 ms in float32 on the 2-core AVX2 machine, loaded), unless the engine runs unquantized ("none": exact
    float comparisons in tests) or on a GPU."""
    if given is not None:
        return file_quantization(given)
    return "int8" if device.type == "cpu" and engine_quantization != "none" else "none"


def full_vocab_logits(logits: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a reduced vocabulary [N, len(vocab_ids)] -> over the full one, -inf outside vocab_ids."""
    out = torch.full((logits.shape[0], vocab_size), float("-inf"), device=logits.device)
    out[:, vocab_ids] = logits
    return out


def target_embedding(target: LoadedModel, what: str, path: str | Path, made_for: str, hidden_size: int,
                     vocab_size: int) -> VocabEmbedding:
    """The target's token embedding, which a file made for a model of this hidden size and vocabulary (a
    draft checkpoint, an eagle head) reads; a clear error where the target is not such a model."""
    tcfg = target.config
    if (hidden_size, vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ValueError(f"speculative_config: {what} {str(path)!r} was made for {made_for} (hidden size "
                         f"{hidden_size}, vocabulary {vocab_size}); the target has hidden size "
                         f"{tcfg.hidden_size} and vocabulary {tcfg.vocab_size}")
    embed = getattr(target.model, "embed_tokens", None)
    if not isinstance(embed, VocabEmbedding):
        raise ValueError(f"speculative_config: a {what} needs a target with a token embedding "
                         f"(architecture {tcfg.architecture!r} has none kvserve can share)")
    return embed


def build_draft_lm(path: str | Path, target: LoadedModel, dtype: torch.dtype, device: torch.device,
                   quantization: str = "none") -> DraftLM:
    fcfg, tensors, _ = read_draft(path)
    embed = target_embedding(target, "draft", path, fcfg.target, fcfg.hidden_size, fcfg.vocab_size)
    cfg = draft_model_config(target.config, fcfg)
    quant = QuantConfig(quantization, 32, dtype, device)
    with torch.device(device):
        model = DraftLM(cfg, embed, tensors.pop("vocab_ids"), quant).to(dtype)
    model.rotary.reset_table(device)
    model.load_weights(tensors.items())
    return model.eval().requires_grad_(False)


def load_draft(model_path: str | None, target: LoadedModel, dtype: torch.dtype, device: torch.device,
               quantization: str = "auto", given: str | None = None) -> nn.Module:
    """The draft of method "draft": model_path (None: the draft shipped for the default model).
    quantization: the engine's (a Hugging Face or GGUF draft is loaded with it as the target is); given:
    speculative_config's, the draft's own weight format where set."""
    ckpt_quant = draft_quantization(quantization, device, given)
    if model_path is None:
        if not SHIPPED_DRAFT.exists():
            raise FileNotFoundError(f"speculative_config: the shipped draft {SHIPPED_DRAFT} is missing; "
                                    "make it with benchmarks/train_draft.py or pass 'model'")
        try:
            return build_draft_lm(SHIPPED_DRAFT, target, dtype, device, ckpt_quant)
        except ValueError as e:
            raise ValueError(f"{e}. Method 'draft' without 'model' uses the draft shipped for the default "
                             "model; for another target pass 'model': a draft with that target's tokenizer"
                             ) from None
    p = Path(model_path)
    if not p.exists():
        raise FileNotFoundError(f"speculative_config: model {model_path!r} does not exist (a Hugging Face "
                                "directory, a .gguf file or a draft .safetensors made by train_draft.py)")
    if is_draft_file(p):
        with named_load_errors("draft", p):
            return build_draft_lm(p, target, dtype, device, ckpt_quant)
    from kvserve.spec_decode.eagle_head import is_head_file  # here: eagle_head imports this module
    if is_head_file(p):
        raise ValueError(f"speculative_config: model {model_path!r} is an eagle head: method 'eagle' takes it")
    if not (p.is_dir() or p.suffix == ".gguf"):
        raise ValueError(f"speculative_config: model {model_path!r} is neither a Hugging Face directory, a "
                         ".gguf file nor a kvserve draft .safetensors (made by benchmarks/train_draft.py)")
    with named_load_errors("draft model", p):
        draft = load_model(str(p), dtype, device, quantization=given or quantization)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config: draft model {model_path!r} has a vocabulary of "
                         f"{draft.config.vocab_size} tokens, the target {target.config.vocab_size}: a draft "
                         "must share the target's tokenizer")
    if draft.tokenizer.encode(_TOKENIZER_PROBE) != target.tokenizer.encode(_TOKENIZER_PROBE):
        raise ValueError(f"speculative_config: draft model {model_path!r} tokenizes text differently from "
                         "the target: a draft must share the target's tokenizer")
    if unlike := differing_token_ids(draft.tokenizer, target.tokenizer):
        shown = ", ".join(f"{i} ({draft.tokenizer.backend.id_to_token(i)!r} against "
                          f"{target.tokenizer.backend.id_to_token(i)!r})" for i in unlike[:3])
        raise ValueError(f"speculative_config: draft model {model_path!r} names {len(unlike)} token id(s) "
                         f"differently from the target, e.g. {shown}: a draft must share the target's tokenizer")
    return draft.model
