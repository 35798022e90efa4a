"""Tokenizer: a `tokenizers.Tokenizer` plus the model's chat template and special-token ids.

Built from a Hugging Face directory (tokenizer.json read as-is: transformers 5's AutoTokenizer may
rebuild some tokenizers its own way and give different ids) or from GGUF metadata (rebuilt from
tokenizer.ggml.* by gguf_tokenizer.py)."""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from kvserve.tokenizer.gguf_tokenizer import build_gguf_tokenizer, gguf_end_token_ids


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids or [])
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in ids:
            ids.insert(0, eos_id)
        self.eos_token_ids: list[int] = ids
        self.all_special_ids: list[int] = sorted(
            {backend.token_to_id(t.content) for t in backend.get_added_tokens_decoder().values() if t.special}
            | set(ids)
            | ({self.bos_token_id} if self.bos_token_id is not None else set())
        )
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---- what code written for transformers' tokenizers reaches for (LLM.get_tokenizer() returns this) ----

    @property
    def eos_token_id(self) -> int | None:
        named = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        return named if named is not None else (self.eos_token_ids[0] if self.eos_token_ids else None)

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        """{"input_ids": ...} for a text (a list of ids) or for a list of texts (a list of lists)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [e.ids for e in self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)]}

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        return self.backend.id_to_token(ids) if isinstance(ids, int) else [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        return self.backend.token_to_id(tokens) if isinstance(tokens, str) else [self.backend.token_to_id(t) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, text: str | None = None) -> bytes:
        """The bytes a token stands for, where its text alone is not whole UTF-8 (part of an emoji or a CJK
        character decodes to U+FFFD): OpenAI's logprob `bytes`, which a client joins to rebuild such characters.
        `text`: the token's decoded text, where the caller has it."""
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.backend.id_to_token(token_id) or ""
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:  # SentencePiece's byte fallback: <0xF0>
            return bytes([int(m.group(1), 16)])
        if piece and all(c in _BYTE_LEVEL_CHARS for c in piece):  # GPT-2 byte-level: one printable char a byte
            return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
        return text.encode("utf-8")  # a token that is U+FFFD itself, or a scheme not known here

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tokenize: bool = False, return_dict: bool = False,
                            **kwargs: Any) -> str | list[int] | dict[str, list[int]]:
        """The rendered conversation. continue_final_message: cut right after the last message's text, so that the
        model continues it instead of closing its turn (a ValueError where the template does not show that text).
        tokenize: its token ids instead (the template writes the special tokens: none added), as a list, or with
        return_dict as {"input_ids": ids}. Unlike transformers', the text is the default and so is the generation
        prompt, as a server renders a chat."""
        if tokenize:
            text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, **kwargs)
            ids = self.encode(text, add_special_tokens=False)
            return {"input_ids": ids} if return_dict else ids
        if not self.chat_template:
            raise ValueError("model has no chat template (a base model takes plain text: use completions, not chat)")
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"the model's chat template does not compile: {e}") from e
        # tools and documents are None unless given, as transformers renders them: a template testing
        # `tools is not none` found them undefined (which is not none) and wrote an empty tools section.
        kwargs = {"tools": None, "documents": None, **kwargs}
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            # Usually the caller's messages (e.g. a role the template rejects via raise_exception).
            raise ValueError(f"chat template error: {e}") from e
        return _end_at_final_message(text, messages[-1].get("content") or "") if continue_final_message else text

    # ---- constructors ----

    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids: list[int] | None = None) -> "Tokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        backend = BackendTokenizer.from_file(str(tok_file))
        cfg: dict = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        elif template is None and (path / "chat_template.json").exists():
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        return cls(backend, template, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")), eos_token_ids)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
        """`fields`: GGUF metadata key -> decoded value (see kvserve.models.gguf.read_metadata)."""
        backend = build_gguf_tokenizer(fields)
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        bos_id = fields.get("tokenizer.ggml.bos_token_id")
        eos_id = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            fields.get("tokenizer.chat_template"),
            tokens[bos_id] if bos_id is not None else None,
            tokens[eos_id] if eos_id is not None else None,
            gguf_end_token_ids(fields),
        )


def _byte_level_chars() -> dict[str, int]:
    """GPT-2 byte-level BPE's alphabet: each byte is written as one printable character; char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # the unprintable ones are moved past 255, in order
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):  # serialized AddedToken
        return tok.get("content")
    return tok


def _end_at_final_message(text: str, final: str) -> str:
    """`text` cut right after the last occurrence of the final message. Templates that trim the message (Llama 3's
    `| trim`) show it stripped, so it is looked for stripped, and its trailing whitespace is kept only where the
    template kept it (the search for the untrimmed text had found nothing and left the turn closed)."""
    core = final.strip()
    at = text.rfind(core)
    if at < 0:
        raise ValueError("continue_final_message: the final message does not appear in the conversation as the "
                         "chat template renders it")
    whole = final.lstrip()
    end = at + len(whole) if text.startswith(whole, at) else at + len(core)
    return text[:end]


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training):
    rendered as its body. Templates that use it had failed to compile, and every chat with them with it."""
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Same settings and globals that transformers gives chat templates, so templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
