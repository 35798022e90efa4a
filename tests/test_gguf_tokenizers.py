"""GGUF tokenizers rebuilt by tokenizer.ggml.model / tokenizer.ggml.pre against independent references.

Byte-level BPE families (smollm, llama-bpe, qwen2, gpt-2): a BPE is trained here with each family's own
Hugging Face tokenizer set-up (the pre-tokenizer and normalizer of its published tokenizer.json, or
transformers' Qwen2Tokenizer), written to a GGUF with the `gguf` package as llama.cpp's converter would
(tokens, merges, token types, pre), and kvserve's tokenizer loaded from that file must give the reference's
ids and text back on varied text. The splits are also checked against llama.cpp's own regexes applied
its way (each regex cuts every piece into matches and the text between them).

SentencePiece BPE ("llama" model, Llama 2 style): a model trained with the sentencepiece library itself,
converted to GGUF fields, must encode as sentencepiece does. (Gemma's real file: test_gemma3_gguf.py.)
"""
from __future__ import annotations

import inspect
import json
import logging
import random
import textwrap
from pathlib import Path

import gguf
import pytest
import regex
from tokenizers import Regex, Tokenizer as BackendTokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvserve.models.loader import load_tokenizer
from kvserve.tokenizer.gguf_tokenizer import PRE_TOKENIZERS
from kvserve.tokenizer.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Numbers: 7, 42, 123, 4567, 1234567890 and 3.14159; 2024-05-09 at 10:30.",
    "  two leading spaces, three   inside,\ttab\nnewline\n\n\n  indented\r\nwindows line",
    "trailing spaces   ",
    "I'm sure they'll say WE'VE DONE IT, it's John's and you'd've.",
    "naïve café résumé, Ünïcödé, ß, ǅ, ﬁ ligature, Ωmega",
    "e\u0301 is e + combining acute; é is one code point",
    "日本語のテキスト、中文文本。한국어 텍스트. Привет, мир! مرحبا بالعالم",
    "emoji 😀👍🏽🇫🇷 and symbols ∑ ≈ ≠ → © ™ €100 $5.00",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n  # base case\n    return fib(n-1)+fib(n-2)\n",
    "x = {'a': [1, 2, 3], \"b\": (4.5e-3, None)}; y = x['a'][::-1] ** 2 // 3 != 0",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "!!! ??? ... --- *** ((())) <<>> ||| ^^^ ~~~",
    "\u0000\u0001\u007f control chars",
    "",
    " ",
]


def corpus() -> list[str]:
    """Offline training text: stdlib source (code, English docstrings) plus the kinds of text tested."""
    src = inspect.getsource(textwrap) + inspect.getsource(json.decoder) + inspect.getsource(logging)
    extra = [t for t in TEXTS if t] * 3 + [" ".join(str(random.Random(i).randrange(10 ** 6)) for i in range(300))]
    return src.splitlines(keepends=True) + extra


def smollm_reference() -> BackendTokenizer:
    """SmolLM2's tokenizer.json: each digit on its own, then GPT-2's byte-level regex."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


def gpt2_reference() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok


# The split regex as Meta-Llama-3's tokenizer.json spells it.
META_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_reference() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(META_LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    return tok


def qwen2_reference() -> BackendTokenizer:
    """transformers' own Qwen2Tokenizer, whose normalizer and splits the training then uses."""
    from transformers import Qwen2Tokenizer
    return Qwen2Tokenizer().backend_tokenizer


FAMILIES = {"smollm": smollm_reference, "gpt-2": gpt2_reference, "llama-bpe": llama3_reference,
            "qwen2": qwen2_reference}


def train(tok: BackendTokenizer, vocab_size: int = 1500) -> BackendTokenizer:
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def write_byte_level_gguf(tok: BackendTokenizer, pre: str, path: Path) -> None:
    """The tokenizer part of a GGUF as llama.cpp's converter writes it for a byte-level BPE."""
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, BackendTokenizer, Tokenizer]:
    """(pre name, trained reference, kvserve's tokenizer from the GGUF written from it)."""
    pre = request.param
    ref = train(FAMILIES[pre]())
    path = tmp_path_factory.mktemp(pre) / "tok.gguf"
    write_byte_level_gguf(ref, pre, path)
    if pre == "qwen2":  # compare against the class itself, built from the trained vocabulary and merges
        from transformers import Qwen2Tokenizer
        model = json.loads(ref.to_str())["model"]
        ref = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]]).backend_tokenizer
        ref.add_special_tokens(SPECIALS)  # Qwen2's tokenizer.json lists its chat tokens as added tokens
    return pre, ref, load_tokenizer(str(path))


def test_byte_level_gguf_tokenizes_as_the_families_hf_tokenizer(family) -> None:
    pre, ref, ours = family
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, (pre, text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    # The test texts must exercise merges, not only single bytes.
    assert len(ours.encode(TEXTS[0], add_special_tokens=False)) < len(TEXTS[0].encode()) // 2


def test_families_differ_where_their_splits_do(family) -> None:
    """The old rebuild gave every file SmolLM's splits; each family's own splits show on digits."""
    pre, _, ours = family
    pieces = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("year 2024")]
    want = {"smollm": ["year", "Ġ", "2", "0", "2", "4"], "gpt-2": ["year", "Ġ2024"],
            "llama-bpe": ["year", "Ġ", "202", "4"], "qwen2": ["year", "Ġ", "2", "0", "2", "4"]}[pre]
    assert pieces == want


# llama.cpp's regexes per pre-tokenizer type (src/llama-vocab.cpp), in its own spelling.
LLAMA_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_SPLITS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", LLAMA_CPP_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt-2": [LLAMA_CPP_GPT2],
    "smollm": [r"\p{N}", LLAMA_CPP_GPT2],
    "starcoder": [r"\p{N}", LLAMA_CPP_GPT2],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
LLAMA_CPP_SPLITS["llama3"] = LLAMA_CPP_SPLITS["llama-v3"] = LLAMA_CPP_SPLITS["llama-bpe"]


def llama_cpp_split(text: str, exprs: list[str]) -> list[str]:
    pieces = [text]
    for expr in exprs:
        out = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(expr, piece):
                out += [piece[pos:m.start()]] if m.start() > pos else []
                out += [m.group()] if m.end() > m.start() else []
                pos = m.end()
            out += [piece[pos:]] if pos < len(piece) else []
        pieces = out
    return pieces


def test_every_supported_pre_splits_as_llama_cpp() -> None:
    assert set(LLAMA_CPP_SPLITS) == set(PRE_TOKENIZERS)
    byte_chars = bytes_to_unicode()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    for pre, exprs in LLAMA_CPP_SPLITS.items():
        ours = Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                           "tokenizer.ggml.tokens": alphabet, "tokenizer.ggml.merges": []})
        for text in TEXTS:
            want = ["".join(byte_chars[b] for b in p.encode()) for p in llama_cpp_split(text, exprs)]
            got = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str(text)]
            assert got == want, (pre, text)


def test_unknown_pre_is_refused_and_missing_pre_is_llama_cpps_default(caplog) -> None:
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": sorted(pre_tokenizers.ByteLevel.alphabet()),
              "tokenizer.ggml.merges": []}
    with pytest.raises(ValueError, match="'chatglm-bpe' is not supported.*--tokenizer"):
        Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.pre": "chatglm-bpe"})
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_gguf_fields(fields)
    assert "no tokenizer.ggml.pre" in caplog.text
    default = Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.pre": "default"})
    assert tok.encode("a 1234, b") == default.encode("a 1234, b")
    with pytest.raises(ValueError, match="'bert' is not supported"):
        Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.model": "bert"})


# ---- SentencePiece BPE ("llama" vocabularies) ----

def train_sentencepiece(path: Path) -> "sentencepiece.SentencePieceProcessor":
    import sentencepiece as spm

    (path / "corpus.txt").write_text("".join(corpus()))
    # Llama 2's trainer settings that shape encoding: no normalization, no whitespace collapsing, a dummy
    # prefix space, digits split, bytes as fallback.
    spm.SentencePieceTrainer.train(
        input=str(path / "corpus.txt"), model_prefix=str(path / "sp"), model_type="bpe", vocab_size=1200,
        character_coverage=0.9995, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=["<|im_start|>"], control_symbols=["<|im_end|>"], bos_id=1, eos_id=2, unk_id=0,
        minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(path / "sp.model"))


def sentencepiece_gguf_fields(sp) -> dict:
    """What llama.cpp's converter writes for a SentencePiece model (its token types from the piece kinds)."""
    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        if sp.is_unused(i):
            return 5
        return 4 if sp.id_to_piece(i) == "<|im_start|>" else 1
    n = sp.get_piece_size()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def test_sentencepiece_gguf_encodes_as_sentencepiece(tmp_path: Path) -> None:
    sp = train_sentencepiece(tmp_path)
    ours = Tokenizer.from_gguf_fields(sentencepiece_gguf_fields(sp))
    rng = random.Random(0)
    # Text without special tokens (sentencepiece reads control pieces as plain text, and puts no prefix
    # space after a user-defined one, where llama.cpp does: checked below).
    texts = [t for t in TEXTS if "<|" not in t]
    words = [w for t in texts for w in t.split(" ")] + ["", " ", "  ", "\n"]
    texts += [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for text in texts:
        want = sp.encode(text)
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.encode(text) == [1] + want  # llama.cpp's default for SentencePiece files: add BOS
        assert ours.decode(want) == sp.decode(want)
    # llama.cpp starts the text after a special token with a prefix space again.
    start, end = sp.piece_to_id("<|im_start|>"), sp.piece_to_id("<|im_end|>")
    assert ours.encode("<|im_start|>user hi<|im_end|>", add_special_tokens=False) == \
        [start] + sp.encode("user hi") + [end]


@pytest.mark.parametrize("preset, ends", [("gemma3-270m", ["<eos>", "<end_of_turn>"]), ("smollm2-135m", ["<|im_end|>"])])
def test_end_of_turn_control_tokens_end_generation(preset: str, ends: list[str]) -> None:
    """Gemma 3's GGUF names no eot token, only <eos>: a chat reply ran past its <end_of_turn> (llama.cpp ends on
    such control tokens too). SmolLM2's <|endoftext|>, a control token too, is not an end of turn."""
    from kvserve.models.presets import resolve_model
    try:
        tok = load_tokenizer(resolve_model(preset))
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(str(e))
    assert [tok.decode([i], skip_special_tokens=False) for i in tok.eos_token_ids] == ends
