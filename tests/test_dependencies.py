"""pyproject's version bounds admit only versions with the APIs kvserve calls."""
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"


def requirement(name: str) -> Requirement:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_tokenizers_bound_requires_decode_stream_with_prefill():
    from tokenizers import Tokenizer, models
    from tokenizers.decoders import DecodeStream

    spec = requirement("tokenizers").specifier
    # 0.21.x has DecodeStream, but its constructor takes no prompt ids: DecodeStream([...], skip_special_tokens=...)
    # fails there with "got multiple values for argument 'skip_special_tokens'" (checked against 0.21.4).
    assert "0.21.4" not in spec and "0.22.0" in spec
    assert version("tokenizers") in spec
    tok = Tokenizer(models.BPE())
    tok.add_tokens(["a", "b", " c"])
    assert DecodeStream([0, 1], skip_special_tokens=True).step(tok, 2).endswith(" c")  # the detokenizer's call
