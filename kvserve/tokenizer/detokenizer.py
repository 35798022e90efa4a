"""Incremental detokenization of one output sequence, with stop strings.

Text comes from tokenizers' DecodeStream: each step decodes only the tokens since the last emitted
chunk (O(1) per token), and holds a token back while its text would end in a broken UTF-8 char.
The stream is seeded with the prompt's last tokens so the first output token decodes as it does
inside the full text (a tokenizer whose decoder strips a leading space would otherwise drop it).
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.stop_checker import find_stop_string, partial_stop_len

# Prompt tokens that seed the stream: enough for any decoder's context (a space, a multi-byte char).
_PROMPT_CONTEXT = 6


# A UTF-8 char is at most 4 bytes, so a broken one at the end spans at most 3 byte tokens.
_MAX_BROKEN_TAIL = 3


def _broken_tail(tokenizer: Tokenizer, ids: list[int], skip_special: bool) -> int:
    """How many of ids' last tokens hold the start of a char their text leaves unfinished (0 if none): the
    fewest whose removal leaves text that does not end in U+FFFD. A U+FFFD left after 3 tokens is not a
    char that more bytes could finish, so 0 then."""
    for n in range(min(_MAX_BROKEN_TAIL, len(ids)) + 1):
        if not tokenizer.decode(ids[:len(ids) - n], skip_special_tokens=skip_special).endswith("\ufffd"):
            return n
    return 0


def _seed(tokenizer: Tokenizer, ids: list[int], skip_special: bool) -> tuple[list[int], list[int]]:
    """Where a decode stream over ids' continuation starts: (seed, tail), the seed the longest suffix of ids,
    less its broken tail, whose text holds no U+FFFD, and the tail the tokens after it that start a char the
    continuation will finish. ids may start with the middle bytes of a char (byte-fallback tokens, as Gemma's
    and Llama 2's write rare chars), and such a decoder turns a whole run of bytes with a stray one in it into
    U+FFFDs: a seed holding one made every output char written in bytes come out as U+FFFD."""
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=skip_special)  # noqa: E731
    for start in range(len(ids)):
        suffix = ids[start:]
        broken = _broken_tail(tokenizer, suffix, skip_special)
        if "\ufffd" not in decode(suffix[:len(suffix) - broken]):
            return suffix[:len(suffix) - broken], suffix[len(suffix) - broken:]
    return [], []


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""            # full output text so far (after any stop truncation)
        self.stop_reason: str | None = None
        self._skip_special = params.skip_special_tokens
        seed, tail = _seed(tokenizer, list(prompt_token_ids[-_PROMPT_CONTEXT:]), self._skip_special)
        self._start_stream(seed, tail)
        # The ids whose text output_text already holds (a short tail, as context; a prompt's broken tail is the
        # prompt's, not output) and the ids the stream is still holding back.
        self._decoded_tail: list[int] = seed + tail
        self._held: list[int] = []
        self._sent = 0                   # chars of output_text already returned by get_delta
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def _start_stream(self, seed: list[int], tail: list[int]) -> None:
        """A new decode stream after seed's text, tail (the start of a char) stepped in."""
        self._stream = DecodeStream(seed, skip_special_tokens=self._skip_special)
        # A token-id prompt may end inside a multi-byte char. Seeded with that broken text, the stream found
        # its first output unlike its seed and returned the whole seed's text, prompt included. Stepped in
        # instead, the tail waits like any broken char, and the output's first text completes it (as vLLM's
        # stream, primed by steps, does).
        for t in tail:
            self._stream.step(self.tokenizer, t)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False, check_stop: bool = True) -> str | None:
        """Append generated tokens. Returns the stop string if one now occurs in the output (the
        text is then cut before it, or after it with include_stop_str_in_output), else None.

        stop_terminated: the last token ended the sequence (EOS or a stop_token_id); as in vLLM its
        text is left out unless include_stop_str_in_output.
        check_stop: False while the sequence is within min_tokens. As in vLLM, a stop string must end in
        text that arrives after the first min_tokens tokens; text checked with check_stop=False is never
        searched again on its own."""
        assert self.stop_reason is None, "update() after a stop string ended the sequence"
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        checked = len(self.output_text)
        for tok in new_token_ids:
            self._held.append(tok)
            try:
                chunk = self._stream.step(self.tokenizer, tok)
            except Exception:  # noqa: BLE001 - tokenizers' own error type is not exported
                # A byte the decoder cannot continue from (a stray byte token in a run of them: "Invalid
                # prefix encountered while decoding stream"). It raised out of the engine's step, failing every
                # request in it. The text is then what a full decode gives (U+FFFD for the bytes that make no
                # char), and a new stream starts after it.
                seed, tail = _seed(self.tokenizer, (self._decoded_tail + self._held)[-_PROMPT_CONTEXT:],
                                   self._skip_special)
                tail = tail[len(tail) - min(len(tail), len(self._held)):]  # a char the next ids may finish
                self._held = self._held[:len(self._held) - len(tail)]
                self.output_text += self._full_decode_chunk()
                self._start_stream(seed, tail)
                self._decoded_tail, self._held = seed, tail
                continue
            if chunk is not None:
                self.output_text += chunk
                self._decoded_tail = (self._decoded_tail + self._held)[-_PROMPT_CONTEXT:]
                self._held = []
        if check_stop and self.params.stop and len(self.output_text) > checked:
            return self._check_stop(checked)
        return None

    def get_delta(self, finished: bool) -> str:
        """Text not returned before that is safe to show. Held back until finished: a broken UTF-8
        tail, and a tail that the next tokens could turn into a stop string."""
        if finished:
            self._flush()
            end = len(self.output_text)
        else:
            end = len(self.output_text) - self._stop_holdback()
        assert end >= self._sent, (end, self._sent)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def _check_stop(self, checked: int) -> str | None:
        match = find_stop_string(self.output_text, checked, self.params.stop)
        if match is None:
            return None
        cut = match.end if self.params.include_stop_str_in_output else match.start
        self.output_text = self.output_text[:cut]
        self.stop_reason = match.stop
        return match.stop

    def _stop_holdback(self) -> int:
        # With include_stop_str_in_output a stop string's text is shown anyway, so nothing waits.
        if self.stop_reason is not None or not self.params.stop or self.params.include_stop_str_in_output:
            return 0
        return partial_stop_len(self.output_text[-self._max_stop_len:], self.params.stop)

    def _flush(self) -> None:
        """At the end, show what the stream still holds (e.g. a final broken char as '\ufffd'),
        exactly as a full decode would render it."""
        if not self._held or self.stop_reason is not None:
            return
        self.output_text += self._full_decode_chunk()
        self._held = []

    def _full_decode_chunk(self) -> str:
        """The held ids' text as a full decode renders it after a plain char: a char's worth of context, so a
        decoder that strips a leading space keeps it. Not after the decoded tail: a byte-fallback decoder
        renders a run of bytes with a stray one in it as U+FFFDs only, so the tail's own bytes, run into the
        held ones, came out as U+FFFD too."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self._skip_special)  # noqa: E731
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        return decode(plain + self._held)[len(decode(plain)):]
