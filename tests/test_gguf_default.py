"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) loaded by kvserve vs transformers'
own GGUF reader (its dequantization and Q/K un-permutation, none of kvserve's code) in a stock
LlamaForCausalLM: greedy tokens, the canonical sanity answer, and tokenizer ids. Weights dequantized to
float32 (quantization="none") so the comparison is exact; the kept-4-bit default is tested in
test_quantized_model.py."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from kvserve.models.loader import LoadedModel, load_model
from paged_helpers import PagedSeqs, make_backend, make_kv_caches

NUM_TOKENS = 32
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 100.",
]



@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(None, torch.float32, torch.device("cpu"), quantization="none")


@pytest.fixture(scope="module")
def reference(default_reference_model) -> LlamaForCausalLM:
    return default_reference_model  # tests/conftest.py: transformers' own GGUF reading, shared


@pytest.fixture(scope="module")
def reference_tokenizer(default_reference_tokenizer):
    return default_reference_tokenizer


def greedy_paged(loaded: LoadedModel, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy decoding of all prompts together through kvserve's paged forward; a sequence stops after
    EOS (included) or num_tokens."""
    model, cfg = loaded.model, loaded.config
    block_size = 16
    num_blocks = 1 + sum(-(-(len(p) + num_tokens) // block_size) for p in prompts)
    backend = make_backend(model, cfg, num_blocks, block_size)
    seqs = PagedSeqs(backend)
    kv = make_kv_caches(backend)
    outs: list[list[int]] = [[] for _ in prompts]
    chunks = dict(enumerate(prompts))
    with torch.no_grad():
        for _ in range(num_tokens):
            ids, positions, meta = seqs.batch(chunks)
            last = torch.tensor(meta.query_start_loc_list[1:]) - 1
            nxt = model.compute_logits(model(ids, positions, meta, kv)[last]).argmax(-1).tolist()
            for i, t in zip(chunks, nxt):
                outs[i].append(t)
            chunks = {i: [t] for i, t in zip(chunks, nxt) if t not in loaded.tokenizer.eos_token_ids}
            if not chunks:
                break
    return outs


def chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=True)


def test_config_from_gguf_metadata(ours: LoadedModel) -> None:
    c = ours.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.eos_token_ids == [2] and ours.tokenizer.eos_token_ids == [2]


def test_greedy_tokens_match_transformers(ours: LoadedModel, reference: LlamaForCausalLM) -> None:
    prompts = [chat_ids(ours, text) for text in CHATS]
    got = greedy_paged(ours, prompts, NUM_TOKENS)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            want = reference.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=2
            )[0, len(prompt):].tolist()
        assert tokens == want, ours.tokenizer.decode(tokens) + " | " + ours.tokenizer.decode(want)


def test_capital_of_france(ours: LoadedModel) -> None:
    tokens = greedy_paged(ours, [chat_ids(ours, CHATS[0])], 10)[0]
    eos = tokens.index(2) if 2 in tokens else len(tokens)
    assert ours.tokenizer.decode(tokens[:eos]) == "The capital of France is Paris."


TOKENIZER_TEXTS = [
    "Hello world!",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "naïve café, 日本語のテキスト, emoji 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_ids_match_transformers(ours: LoadedModel, reference_tokenizer, text: str) -> None:
    ids = ours.tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(ours: LoadedModel, reference_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count 1 to 12."},
        {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10 11 12"},
        {"role": "user", "content": "Thanks!"},
    ]
    text = ours.tokenizer.apply_chat_template(messages)
    assert text == reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.encode(text) == reference_tokenizer.encode(text)
    # add_bos_token is false in this file: nothing is prepended.
    assert ours.tokenizer.encode("hi") == ours.tokenizer.encode("hi", add_special_tokens=False)
