"""Tiny random Hugging Face models, built and saved with transformers inside the tests.

Weights are drawn wider than transformers' default init so that logits are peaked: greedy tokens then
have clear margins and cannot flip on float32 rounding differences between two correct implementations.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

VOCAB = 260  # 256 byte tokens + 4 specials
SPECIALS = ["<s>", "</s>", "<pad>", "<unk>"]

# KV cache for engines on these models: 32k blocks of 4 tokens, no pressure unless a test sets num_kv_blocks.
# The CPU default (1 GiB) is 524k blocks here, ~2.2 s to build per engine on an idle core (0.06 s for this).
TINY_KV = 64 << 20

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=256, eos_token_id=257, pad_token_id=258)


def arch_specs():
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    return {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(
            tie_word_embeddings=False, rope_theta=10000.0,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=True, sliding_window=None)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=24)),
    }


def byte_tokenizer() -> Tokenizer:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    assert len(vocab) == 256
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def make_tiny_model(arch: str, path: Path, seed: int = 0):
    """Build, randomise and save a tiny model of `arch` to `path`; returns the transformers model."""
    config_cls, model_cls, extra = arch_specs()[arch]
    torch.manual_seed(seed)
    config = config_cls(**COMMON, **extra)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = None  # tests generate fixed lengths
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and the log-softmax of its logits at each generated step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=258)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits, 0)[:, 0].float(), dim=-1)
    return tokens, logprobs
