"""GGUF tokenizer metadata (tokenizer.ggml.*) -> a `tokenizers.Tokenizer` that tokenizes as the model's
own Hugging Face tokenizer does.

tokenizer.ggml.model says which kind of vocabulary the file holds:

  "gpt2"   byte-level BPE: tokens + merges. How text is cut into words before BPE differs by model family;
           tokenizer.ggml.pre names the family (llama.cpp's names) and PRE_TOKENIZERS maps each supported
           name to that family's splits. A name not in the table is an error: guessing would tokenize
           differently from the model's training without any sign (llama.cpp refuses such files too).
  "llama"  SentencePiece BPE (Llama 2, Gemma): tokens + scores, spaces written as "▁", bytes outside the
           vocabulary as <0xXX> tokens. Merges are not stored: the piece with the highest score merges
           first (SentencePiece's rule, and llama.cpp's), so they are rebuilt ranked by score.

Control tokens become special added tokens and user-defined ones (Gemma's "\\n" runs, HTML tags) plain
added tokens matched whole in the raw text, as llama.cpp does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# GGUF token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# GPT-2's word regex (without its trailing `\s+`, as llama.cpp writes it: whitespace it leaves unmatched
# becomes a piece of its own anyway, since every split below keeps the text between matches).
GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's and Qwen2's, as in their tokenizer.json: case-insensitive contractions, a letter run with one
# leading non-letter, numbers in runs of up to 3 digits (Llama 3) or single digits (Qwen2).
LLAMA3_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """Regexes applied in turn, each cutting every piece into its matches and the text between them;
    then the byte-level mapping."""
    splits: tuple[str, ...]
    nfc: bool = False                 # Qwen2's tokenizer.json normalizes to NFC first
    ignore_merges: bool = False       # Llama 3: a word that is itself a token is not merged from pieces


_SMOLLM = PreTokenizer((r"\p{N}", GPT2_WORDS))  # every digit alone, then GPT-2's words
_LLAMA3 = PreTokenizer((LLAMA3_WORDS,), ignore_merges=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's fallback for byte-level files, also what a file without tokenizer.ggml.pre gets.
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_WORDS, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt-2": PreTokenizer((GPT2_WORDS,)),
    "smollm": _SMOLLM,
    "starcoder": _SMOLLM,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": PreTokenizer((QWEN2_WORDS,), nfc=True),
}


@dataclass
class GGUFVocab:
    """The tokenizer.ggml.* fields, read once."""
    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = True

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> "GGUFVocab":
        model = fields.get("tokenizer.ggml.model")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        spm = model == "llama"
        return cls(
            model=model,
            tokens=tokens,
            types=list(fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)),
            scores=list(fields.get("tokenizer.ggml.scores") or []),
            merges=list(fields.get("tokenizer.ggml.merges") or []),
            pre=fields.get("tokenizer.ggml.pre"),
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_id=fields.get("tokenizer.ggml.eos_token_id"),
            unk_id=fields.get("tokenizer.ggml.unknown_token_id"),
            # llama.cpp's defaults where the key is absent: SentencePiece vocabularies add BOS and a prefix space.
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", spm)),
            add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", spm)),
        )


# Chat formats' end-of-turn tokens. Converters do not always write tokenizer.ggml.eot_token_id (Gemma 3's
# <end_of_turn> is only a control token in its GGUF): a chat reply then ran past its turn. As llama.cpp does, a
# control token with one of these texts also ends generation. (Not <|endoftext|>: a document's end, and not the
# end of a turn where a model's own generation config leaves it out.)
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")
_CONTROL = 3  # tokenizer.ggml.token_type


def gguf_end_token_ids(fields: dict[str, Any]) -> list[int]:
    """The ids that end generation: eos and eot as the file names them, then the end-of-turn control tokens."""
    ids = [fields.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    tokens: list[str] = fields.get("tokenizer.ggml.tokens") or []
    types = fields.get("tokenizer.ggml.token_type")
    if types is not None:
        ids += [i for i, (text, kind) in enumerate(zip(tokens, types))
                if kind == _CONTROL and text in END_OF_TURN_TEXTS]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def build_gguf_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    vocab = GGUFVocab.from_fields(fields)
    if vocab.model == "gpt2":
        tok = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        tok = _sentencepiece_bpe(vocab)
    else:
        raise ValueError(f"GGUF tokenizer model {vocab.model!r} is not supported (supported: 'gpt2' byte-level "
                         "BPE, 'llama' SentencePiece BPE); pass --tokenizer with a Hugging Face directory")
    _add_special_tokens(tok, vocab)
    post = _post_processor(vocab)
    if post is not None:
        tok.post_processor = post
    return tok


def _byte_level_bpe(vocab: GGUFVocab) -> Tokenizer:
    pre_name = vocab.pre
    if pre_name is None:
        logger.warning("GGUF has no tokenizer.ggml.pre; splitting text as llama.cpp's 'default' does, which may "
                       "not be how the model was trained")
        pre_name = "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre_name!r} is not supported (supported: "
                         f"{', '.join(PRE_TOKENIZERS)}); pass --tokenizer with the model's Hugging Face directory")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    # Byte-level BPE covers every byte, so no unknown token is needed.
    tok = Tokenizer(models.BPE(vocab=_vocab_dict(vocab.tokens), merges=merges, unk_token=None, fuse_unk=False,
                               byte_fallback=False, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(vocab: GGUFVocab) -> Tokenizer:
    if len(vocab.scores) != len(vocab.tokens):
        raise ValueError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores to rank its merges by")
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=_vocab_dict(vocab.tokens), merges=spm_merges(vocab), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    # Spaces become "▁". The prefix space (Llama 2, not Gemma) goes before every stretch of text between
    # special tokens, as llama.cpp does; without special tokens that is SentencePiece's dummy prefix.
    # (transformers' Metaspace(prepend_scheme="first") differs: it adds none to text that starts with a space.)
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if vocab.add_space_prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best merged piece first: SentencePiece merges the adjacent
    pair whose concatenation is the highest-scoring piece. Equal scores are ranked by token id (llama.cpp
    takes the leftmost pair instead); SentencePiece's trainer gives every piece its own score, so only a
    piece's own splits tie, and those never compete for the same characters."""
    pieces = {t for t, ty in zip(vocab.tokens, vocab.types) if ty in (NORMAL, USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, (piece, ty, score) in enumerate(zip(vocab.tokens, vocab.types, vocab.scores)):
        if ty != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-score, i, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"GGUF vocabulary repeats {len(tokens) - len(vocab)} token strings")
    return vocab


def _add_special_tokens(tok: Tokenizer, vocab: GGUFVocab) -> None:
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(vocab.tokens, vocab.types) if ty in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(vocab.tokens, vocab.types) if ty == USER_DEFINED]
    tok.add_tokens(user)
    tok.add_special_tokens(special)


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor | None:
    bos = vocab.tokens[vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else None
    eos = vocab.tokens[vocab.eos_id] if vocab.add_eos and vocab.eos_id is not None else None
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False) if vocab.model == "gpt2" else None
    pre, post = (f"{bos}:0 " if bos else ""), (f" {eos}:0" if eos else "")
    specials = [(t, i) for t, i in ((bos, vocab.bos_id), (eos, vocab.eos_id)) if t]
    return processors.TemplateProcessing(single=f"{pre}$A:0{post}", pair=f"{pre}$A:0{post} {pre}$B:1{post}",
                                         special_tokens=specials)
