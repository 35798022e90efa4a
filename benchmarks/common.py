"""Shared by the benchmark scripts: where results go, a record of the machine they ran on, and a timer."""
from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvserve.utils.cpuinfo import cpu_model_name

# KVSERVE_BENCH_RESULTS: another folder, for rehearsals that must not overwrite the published results.
RESULTS = Path(os.environ.get("KVSERVE_BENCH_RESULTS") or Path(__file__).parent / "results")


BLAS_CHOICES = ("choose", "preferred", "cublaslt")


def use_blas(choice: str) -> None:
    """--blas, on a GPU, before any engine is built: each captured graph shape with the faster of cuBLAS and
    cuBLASLt (choose, the engine's own way), every graph with torch's preference (preferred, as before the
    engine chose), or cuBLASLt for everything, eager steps too (cublaslt, as TORCH_BLAS_PREFER_CUBLASLT=1)."""
    from kvserve.worker import blas_choice

    blas_choice.CHOOSE_BLAS = choice == "choose"
    if choice == "cublaslt":
        if not torch.cuda.is_available():
            raise SystemExit("--blas cublaslt needs CUDA")
        torch.backends.cuda.preferred_blas_library("cublaslt")


def median_seconds(fn, repeat: int) -> float:
    """Median wall time of fn() over `repeat` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_seconds(llm, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one greedy request alone (its whole prefill), and that token."""
    from kvserve import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0]


def add_prefill_options(ap, lengths: list[int], rounds: int, name: str) -> None:
    """The options of a script that times one prompt's prefill alone (prefill_engine runs it)."""
    ap.add_argument("--lengths", nargs="+", type=int, default=lengths, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the chunk size (the engine's default)")
    ap.add_argument("--name", default=name)


def prefill_engine(args, model: str | None = None):
    """A model (None: the default one) for prefill_seconds: prefix caching off, chunks of
    --max-num-batched-tokens, on the native kernels (which the scripts compare settings of). -> (LLM, the
    kernels' ISA)."""
    from kvserve import LLM
    from kvserve.kernels import cpu as cpu_kernels

    isa = cpu_kernels.isa()
    assert isa, "the native kernels did not build on this machine"
    llm = LLM(**({"model": model} if model else {}), max_num_seqs=4, kv_cache_memory=1 << 30,
              enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens)
    return llm, isa


def machine_info() -> dict:
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu_model_name(), "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0],
            # PASSIVE puts OpenMP's threads to sleep after every parallel region: at batch 1 that wake-up is
            # paid ~200 times per step, so figures taken with and without it do not compare.
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "libgomp default",
            "load_average": round(os.getloadavg()[0], 2),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def git_rev() -> str:
    if os.environ.get("GIT_REV"):  # a copy whose .git is not the tree's (a GPU lease): the caller says which
        return os.environ["GIT_REV"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent).strip()
    except Exception:
        return "unknown"


def save(name: str, data: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown)
    print(f"wrote {RESULTS / (name + '.json')} and .md")


def command_options(options: dict) -> str:
    """argparse's parsed options as a command line that pastes back: flags only when set, unset options left
    out, lists as separate words, and shell quoting where needed."""
    words = []
    for k, v in options.items():
        if v is None or v is False:
            continue
        words.append("--" + k.replace("_", "-"))
        if v is not True:
            words += [shlex.quote(str(x)) for x in (v if isinstance(v, (list, tuple)) else [v])]
    return "".join(" " + w for w in words)


def _running_script(name: str) -> str:
    """The benchmark script this process runs (its --name may name the results otherwise), else name."""
    stem = Path(sys.argv[0]).stem
    return stem if (Path(__file__).parent / f"{stem}.py").is_file() else name


def report(name: str, title: str, args, setup: str, table: str, results: dict, isa: str | None = None,
           script: str | None = None) -> None:
    """Print the table and save it as results/<name>.json and .md, with the command that reproduces it
    (benchmarks/<script or name>.py and its arguments), the git revision and the machine. Given the CPU
    kernels' ISA (kvserve.kernels.cpu.isa()), the files are results/<name>_<isa>.*, and say which ISA: runs
    on machines with different instruction sets then sit side by side."""
    print(table)
    info = machine_info()
    # The switches that force a narrower ISA than the CPU's are part of the command.
    switches = ("KVSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    forced = "".join(f"{k}={os.environ[k]} " for k in switches if os.environ.get(k))
    cmd = f"{forced}python benchmarks/{script or _running_script(name)}.py" + command_options(vars(args))
    kernels = ""
    if isa:
        from kvserve.kernels import cpu as cpu_kernels

        # AMX is a mode of the avx512 build (bfloat16 float weights on its tiles): said where it was on.
        amx = " + AMX" if isa == "avx512" and cpu_kernels.amx() else ""
        kernels = f" CPU kernels: {isa.upper()}{amx}."
    md = (f"# {title}\n\nCommand: `{cmd}` (git {git_rev()})\n\nMachine: {info['cpu']}, {info['cores']} cores, "
          f"torch {info['torch']} ({info['torch_threads']} threads).{kernels} {setup}\n\n{table}\n")
    data = {"args": vars(args), "machine": info, "git": git_rev(), "results": results}
    if isa:
        data["cpu_kernels_isa"] = isa
    save(f"{name}_{isa}" if isa else name, data, md)
