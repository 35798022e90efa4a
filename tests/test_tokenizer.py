"""kvserve's Tokenizer vs transformers' PreTrainedTokenizerFast on the same tokenizer.json (the form
the transformers-5 trap note in MODELS.md recommends comparing against), plus chat-template sources
and the GGUF rebuild's BOS handling."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvserve.tokenizer.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers like 12345 and 3.14159 appear in text.",
    "Unicode: naïve café, 日本語, emoji 😀.",
    "Tokenizers split words into byte-level pieces.",
] * 20
TEXTS = ["Hello, world!", "The year 2024 had 366 days.", "naïve 日本 😀", "  spaces\tand\nnewlines", "<|im_start|>x<|im_end|>"]


def write_hf_dir(path: Path, template_in: str | None = "config") -> None:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "<|im_end|>", "special": True}}
    if template_in == "config":
        cfg["chat_template"] = CHATML
    elif template_in == "jinja":
        (path / "chat_template.jinja").write_text(CHATML)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def reference(path: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), chat_template=CHATML)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_transformers(tmp_path: Path, text: str) -> None:
    write_hf_dir(tmp_path)
    ours, ref = Tokenizer.from_hf_dir(tmp_path), reference(tmp_path)
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("template_in", ["config", "jinja"])
def test_chat_template_matches_transformers(tmp_path: Path, template_in: str) -> None:
    write_hf_dir(tmp_path, template_in)
    ours, ref = Tokenizer.from_hf_dir(tmp_path), reference(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 123"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )


def test_what_code_written_for_transformers_reaches_for(tmp_path: Path) -> None:
    """LLM.get_tokenizer()'s users write transformers' calls: apply_chat_template(tokenize=True) had returned the
    text (the keyword went to the template as a variable), and eos_token_id, len(), tok(text), get_vocab() and
    convert_ids_to_tokens() were missing."""
    write_hf_dir(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=CHATML,
                                  bos_token="<s>", eos_token="<|im_end|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 123 😀"}]
    for gen in (True, False):
        want = ref.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen) == want
        assert ours.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=gen
                                        )["input_ids"] == want
    assert ours.eos_token_id == ref.eos_token_id and ours.bos_token_id == ref.bos_token_id
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    for text in (TEXTS[0], TEXTS):
        assert ours(text)["input_ids"] == ref(text)["input_ids"]
    ids = ours.encode(TEXTS[2])
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids[0]) == ref.convert_ids_to_tokens(ids[0])
    assert ours.convert_tokens_to_ids(ref.convert_ids_to_tokens(ids)) == ids


# Llama 3's way (content trimmed), a template that keeps spacing, transformers' {% generation %} block, and a
# tools section guarded by `is not none`.
TRIMMING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GENERATION = ("{% if tools is not none %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
              "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
              "{% endgeneration %}{% else %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("template", [CHATML, TRIMMING, GENERATION])
@pytest.mark.parametrize("final", ["Sure, here it is:\n", "Sure", "  Sure  "])
def test_continue_final_message_cuts_where_transformers_does(tmp_path: Path, template: str, final: str) -> None:
    """The search for the untrimmed final message found nothing in a trimming template's render and left the
    turn closed (the model answered anew); {% generation %} did not compile; an unset `tools` wrote [TOOLS]."""
    write_hf_dir(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    ours.chat_template = template
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=template)
    messages = [{"role": "user", "content": "Write it."}, {"role": "assistant", "content": final}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                   continue_final_message=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == want
    plain = messages[:1]
    assert ours.apply_chat_template(plain) == ref.apply_chat_template(plain, tokenize=False,
                                                                      add_generation_prompt=True)


def test_continue_final_message_the_template_does_not_show_is_refused(tmp_path: Path) -> None:
    write_hf_dir(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    ours.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"   # shows no content at all
    with pytest.raises(ValueError, match="final message does not appear"):
        ours.apply_chat_template([{"role": "assistant", "content": "Sure"}], add_generation_prompt=False,
                                 continue_final_message=True)


def test_chat_template_errors(tmp_path: Path) -> None:
    write_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="bad role tool"):
        Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "tool", "content": "x"}])
    write_hf_dir(tmp_path, template_in=None)
    with pytest.raises(ValueError, match="model has no chat template"):
        Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_special_token_ids(tmp_path: Path) -> None:
    write_hf_dir(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path, eos_token_ids=[1])
    ids = {t: ours.backend.token_to_id(t) for t in SPECIALS}
    assert ours.bos_token_id == ids["<s>"]
    assert ours.eos_token_ids == [ids["<|im_end|>"], 1]  # tokenizer's eos first, then the model config's
    assert set(ids.values()) <= set(ours.all_special_ids)
    assert ours.vocab_size == len(reference(tmp_path))


def gguf_fields(add_bos: bool) -> dict:
    # A minimal byte-level BPE in GGUF metadata form: 256 byte tokens, one merge, two control tokens.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["he", "<s>", "</s>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 257 + [3, 3],
        "tokenizer.ggml.merges": ["h e"],
        "tokenizer.ggml.bos_token_id": 257,
        "tokenizer.ggml.eos_token_id": 258,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.chat_template": CHATML,
    }


@pytest.mark.parametrize("add_bos", [True, False])
def test_gguf_rebuild_adds_bos_only_when_asked(add_bos: bool) -> None:
    tok = Tokenizer.from_gguf_fields(gguf_fields(add_bos))
    ids = tok.encode("hello 42")
    he = tok.backend.token_to_id("he")
    digits = [tok.backend.token_to_id(c) for c in "42"]
    body = [he] + [tok.backend.token_to_id(c) for c in "llo"] + [tok.backend.token_to_id("Ġ")] + digits
    assert ids == ([257] if add_bos else []) + body
    assert tok.encode("hello 42", add_special_tokens=False) == body
    assert tok.decode(ids) == "hello 42"
    assert tok.eos_token_ids == [258] and tok.bos_token_id == 257
    assert tok.encode("<s>", add_special_tokens=False) == [257]  # control tokens are atomic


SPLIT_TEXTS = ["emoji 😀🎉🧬 and flags 🇫🇷", " 你好，世界", "𓀀𓀁 ꙮ \U000E0041 𝒜", "naïve café", "a\ufffdb"]


@pytest.mark.parametrize("preset", ["smollm2-135m", "gemma3-270m"])
def test_token_bytes_rebuild_characters_split_across_tokens(preset: str) -> None:
    """OpenAI's logprob `bytes` are what a client joins to rebuild a character split across tokens: each such
    token's text alone is U+FFFD. On both shipped models (GPT-2 byte-level pieces, SentencePiece byte fallback),
    joined bytes give back the UTF-8 of the text, and each partial token's bytes are what its piece spells, read
    with transformers' byte table for byte-level pieces."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from kvserve.models.loader import load_tokenizer
    from kvserve.models.presets import resolve_model

    tok = load_tokenizer(resolve_model(preset))
    partial = 0
    for text in SPLIT_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        texts = [tok.decode([i], skip_special_tokens=False) for i in ids]
        partial += sum("\ufffd" in t for t in texts)
        assert b"".join(tok.token_bytes(i, t) for i, t in zip(ids, texts)) == text.encode("utf-8"), text
    assert partial >= 10  # the texts do split characters on both models
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    byte_level = json.loads(tok.backend.decoder.__getstate__())["type"] == "ByteLevel"
    ids = range(tok.vocab_size)
    texts = tok.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    checked = 0
    for i, text in zip(ids, texts):
        if "\ufffd" not in text:
            continue
        piece = tok.backend.id_to_token(i)
        if byte_level:
            want = bytes(byte_of[c] for c in piece)
        elif piece.startswith("<0x") and piece.endswith(">"):
            want = bytes([int(piece[3:-1], 16)])
        else:  # SentencePiece pieces that hold U+FFFD itself
            assert "\ufffd" in piece, (i, piece)
            want = text.encode("utf-8")
        assert tok.token_bytes(i) == want, (i, piece)
        assert want.decode("utf-8", errors="replace") == text, (i, piece)
        checked += want != text.encode("utf-8")
    assert checked >= 100
