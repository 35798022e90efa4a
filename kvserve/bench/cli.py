"""`kvserve bench {serve,sweep,plot}` -- argument parsing only; the work is in serve/sweep/plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path

from kvserve.bench.client import IGNORE_EOS_METHODS, EndpointConfig
from kvserve.bench.datasets import DATASETS, DatasetConfig
from kvserve.bench.metrics import parse_goodput
from kvserve.bench.serve import ServeConfig
# Counts and lengths: 0 prompts printed an empty table, --output-len 0 became max_tokens 1 without a word.
from kvserve.entrypoints.cli import non_negative_int, positive_int


def _rate(text: str) -> float:
    return float("inf") if text == "inf" else float(text)


def _range_ratio(text: str) -> float:
    """vLLM's bound: lengths are drawn in [len * (1 - r), len * (1 + r)]."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, e.g. 50,90,99, got {text!r}") from None
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"must be numbers in [0, 100], got {text!r}")
    return values


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object (merged into each request body), got {text!r}")
    return value


def _result_file(text: str) -> str:
    """Checked before the run: a directory, or a place that cannot be written, failed only after the whole
    benchmark, losing it. Nothing is made here: a scratch file in the nearest folder that exists is written and
    removed (the folders under it are made when the result is saved)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    if path.exists() and not path.is_file():  # a FIFO or a device would block or swallow the result
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file")
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvserve-bench-"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written ({folder}: {e.strerror})") from None
    return text


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, as vLLM's bench shows them; not where there is none to show (None,
    off, empty, a required option) or the help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or action.default in (None, False, "", argparse.SUPPRESS) or "default" in text
                or not action.option_strings):
            return text
        return super()._get_help_string(action)


API_KEY_NOTE = ("A server started with --api-key gets the key from the OPENAI_API_KEY environment variable "
                "(as vLLM's benchmark reads it).")


def _result_dir(text: str) -> str:
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return text


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model name sent in each request (default: the first the server lists at /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                   help="default: chat for --dataset chat, completions otherwise")
    p.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: passages of the corpus; shared-prefix: a system prompt shared by the requests "
                        "and a question each; chat: conversations of several turns")
    p.add_argument("--num-prompts", type=positive_int, default=100, help="requests in the run")
    p.add_argument("--seed", type=int, default=0, help="draws the prompts, their lengths and the arrival times")
    p.add_argument("--tokenizer", default=None,
                   help="a GGUF file or a directory with tokenizer.json (default: the embedded model)")
    g = p.add_argument_group("dataset shapes")
    g.add_argument("--input-len", type=positive_int, default=256, help="random: mean prompt tokens")
    g.add_argument("--output-len", type=positive_int, default=128, help="max_tokens (mean for random/chat)")
    g.add_argument("--range-ratio", type=_range_ratio, default=0.0,
                   help="random/chat: lengths uniform in [L*(1-r), L*(1+r)]")
    g.add_argument("--prefix-len", type=non_negative_int, default=1024,
                   help="shared-prefix: tokens of the passage in the system prompt, after a one-line "
                        "instruction (17 tokens with the default tokenizer)")
    g.add_argument("--question-len", type=positive_int, default=32,
                   help="shared-prefix: tokens of corpus text in each question, after a 'Question N: ...' "
                        "lead (~11 tokens with the default tokenizer)")
    g.add_argument("--num-prefixes", type=positive_int, default=1, help="shared-prefix: distinct prefixes")
    g.add_argument("--max-turns", type=positive_int, default=4, help="chat: user turns drawn in [1, N]")
    g.add_argument("--message-len", type=positive_int, default=64, help="chat: mean tokens per message")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps; 1 = Poisson")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    p.add_argument("--percentiles", type=_percentiles, default="50,90,99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--ignore-eos-via", choices=IGNORE_EOS_METHODS, default="field",
                   help="how to make servers generate exactly max_tokens: the ignore_eos field "
                        "(vLLM, llama-server, kvserve), transformers serve's generation_config, "
                        "logit_bias against special tokens (llama-cpp-python's server), or none")
    p.add_argument("--temperature", type=float, default=0.0, help="sent in every request")
    p.add_argument("--extra-body", type=_json_object, default=None, help="JSON merged into every request body")
    p.add_argument("--no-test-request", action="store_true",
                   help="skip the unmeasured probe request sent before the run")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--save-text", action="store_true", help="keep generated text in the JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve bench", description="Benchmark OpenAI-compatible servers.",
                                     epilog=API_KEY_NOTE)
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="one run against one server", epilog=API_KEY_NOTE,
                       formatter_class=_HelpWithDefaults)
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--request-rate", type=_rate, default=float("inf"), help="req/s, or inf")
    s.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="requests in flight at most (default: no limit)")
    s.add_argument("--save-result", type=_result_file, default=None, metavar="FILE", help="write the JSON result here")
    s.add_argument("--label", default="", help="name of this run in plots")
    _add_workload_args(s)

    w = sub.add_parser("sweep", help="a ladder of rates or concurrencies against servers", epilog=API_KEY_NOTE,
                       formatter_class=_HelpWithDefaults)
    w.add_argument("--server", action="append", required=True,
                   metavar="NAME=URL[,model=M][,ignore_eos_via=...]",
                   help="a server to benchmark; options override --model / --ignore-eos-via for it")
    w.add_argument("--launch", action="append", default=[], metavar="NAME=COMMAND",
                   help="start this command before NAME's points and stop it after")
    w.add_argument("--launch-timeout", type=float, default=600.0,
                   help="seconds a launched server may take to start")
    axis = w.add_mutually_exclusive_group(required=True)
    axis.add_argument("--request-rates", help="e.g. 1,2,4,inf")
    axis.add_argument("--concurrencies", help="e.g. 1,8,32,64 (request rate inf unless given)")
    w.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="with --concurrencies: the arrival rate at every point")
    w.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="with --request-rates: requests in flight at most (default: no limit)")
    w.add_argument("--prompts-per-concurrency", type=non_negative_int, default=0,
                   help="at concurrency C send max(--num-prompts, this*C) requests")
    w.add_argument("--result-dir", type=_result_dir, required=True,
                   help="where each point's JSON, sweep_summary.json, sweep.png and launched servers' logs go")
    _add_workload_args(w)

    pl = sub.add_parser("plot", help="redraw curves from result JSONs (files or directories)")
    pl.add_argument("paths", nargs="+", help="result JSON files, or folders of them")
    pl.add_argument("--out", required=True, help="PNG path")
    pl.add_argument("--title", default="", help="the figure's title")
    pl.add_argument("--cdf", choices=("ttft", "e2el"), default=None,
                    help="draw the per-request CDF of this latency instead of throughput curves")
    return parser


def serve_config_from_args(args: argparse.Namespace, base_url: str) -> ServeConfig:
    endpoint = args.endpoint or ("chat" if args.dataset == "chat" else "completions")
    return ServeConfig(
        endpoint=EndpointConfig(base_url, args.model, endpoint, ignore_eos_via=args.ignore_eos_via,
                                temperature=args.temperature, extra_body=args.extra_body or {}),
        dataset=DatasetConfig(
            name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
            input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
            prefix_len=args.prefix_len, question_len=args.question_len,
            num_prefixes=args.num_prefixes, max_turns=args.max_turns, message_len=args.message_len),
        request_rate=getattr(args, "request_rate", float("inf")),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        goodput_slos_ms=parse_goodput(args.goodput),
        percentiles=args.percentiles,
        tokenizer=args.tokenizer,
        test_request=not args.no_test_request,
        disable_tqdm=args.disable_tqdm,
        save_text=args.save_text,
        label=getattr(args, "label", ""),
        tags={"command": getattr(args, "command_line", "")},
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.bench.report import format_table
    from kvserve.bench.serve import run_benchmark
    from kvserve.bench.tokenizer import load_tokenizer

    cfg = serve_config_from_args(args, args.base_url)
    res = asyncio.run(run_benchmark(cfg, load_tokenizer(cfg.tokenizer)))
    print(format_table(res.metrics, cfg.request_rate, cfg.burstiness, cfg.max_concurrency, cfg.label,
                       res.spec_decode, res.server))
    if args.save_result:
        res.save(args.save_result)
        print(f"saved {args.save_result}")
    _say_failures(res.results)
    return 0 if res.metrics.completed > 0 else 1


def _say_failures(results: list) -> None:
    """The table counts failed requests; their reasons were only in the saved JSON."""
    errors = Counter(r.error for r in results if not r.success)
    if errors:
        reason, count = errors.most_common(1)[0]
        print(f"kvserve bench: {sum(errors.values())} of {len(results)} requests failed; the most common reason "
              f"({count}): {reason}", file=sys.stderr)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from kvserve.bench.sweep import SweepConfig, parse_points, parse_server, run_sweep
    from kvserve.bench.tokenizer import load_tokenizer

    # Each point sets its own: given beside the ladder that sets it, it had been replaced without a word.
    if args.concurrencies and args.max_concurrency is not None:
        raise ValueError("--max-concurrency goes with --request-rates: with --concurrencies each point sets it")
    if args.request_rates and args.request_rate != float("inf"):
        raise ValueError("--request-rate goes with --concurrencies: with --request-rates each point sets it")
    servers = [parse_server(s) for s in args.server]
    by_name = {s.name: s for s in servers}
    for item in args.launch:
        name, sep, cmd = item.partition("=")
        if not sep or name not in by_name:
            raise ValueError(f"--launch {item!r}: NAME must match a --server name")
        by_name[name].launch_cmd = cmd
    axis = "concurrency" if args.concurrencies else "request_rate"
    base = serve_config_from_args(args, servers[0].base_url)
    sw = SweepConfig(servers, axis, parse_points(args.concurrencies or args.request_rates), base,
                     Path(args.result_dir), args.prompts_per_concurrency, args.launch_timeout)
    results = run_sweep(sw, load_tokenizer(base.tokenizer))
    _say_failures([r for res in results for r in res.results])
    return 0 if all(r.metrics.completed > 0 for r in results) else 1


def _cmd_plot(args: argparse.Namespace) -> int:
    from kvserve.bench.plot import load_results, plot_cdf, plot_curves

    results = load_results([Path(p) for p in args.paths])
    if not results:
        print("no benchmark result JSON found", file=sys.stderr)
        return 1
    if args.cdf:
        print(plot_cdf(results, args.cdf, Path(args.out), args.title))
    else:
        print(plot_curves(results, Path(args.out), args.title))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = "kvserve bench " + shlex.join(argv)  # recorded in every result JSON
    try:
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "sweep":
            return _cmd_sweep(args)
        return _cmd_plot(args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"kvserve bench: error: {e}", file=sys.stderr)
        return 2
