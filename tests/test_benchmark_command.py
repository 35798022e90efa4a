"""The command line a benchmark's results file records pastes back: parsed again, it gives the same options."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser() -> argparse.ArgumentParser:
    # The option shapes the benchmark scripts use.
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 32])
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"])
    ap.add_argument("--train-rows", type=int, default=None)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data-only", action="store_true")
    ap.add_argument("--speculative-config", type=str, default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--out", type=str, default="/tmp/a dir/h.safetensors")
    return ap


def test_recorded_command_parses_back_to_the_same_options():
    common = _common()
    ap = _parser()
    for argv in ([], ["--data-only", "--train-rows", "20", "--concurrency", "1", "--methods", "eagle", "eagle-b"]):
        args = ap.parse_args(argv)
        words = shlex.split(common.command_options(vars(args)))
        assert "None" not in words and "False" not in words
        assert ap.parse_args(words) == args


def test_recorded_command_names_the_script_that_ran_whatever_the_results_are_called(monkeypatch):
    """A run with --name recorded `python benchmarks/<name>.py`, a script that does not exist."""
    common = _common()
    monkeypatch.setattr("sys.argv", [str(ROOT / "benchmarks" / "verify_rows.py"), "--name", "verify_rows_host_a"])
    assert common._running_script("verify_rows_host_a") == "verify_rows"
    monkeypatch.setattr("sys.argv", ["/usr/bin/pytest"])  # not a benchmark: the results' name, as before
    assert common._running_script("verify_rows_host_a") == "verify_rows_host_a"
