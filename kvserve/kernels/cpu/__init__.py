"""C++ kernels for x86 CPUs: one source, built once per instruction set, the variant chosen at run time.

Variants ("ISAs"), best first:
- "avx512": AVX-512 F/BW/DQ/VL + VNNI + FMA (+ F16C, which every AVX-512 CPU has; the sources may use it).
  VNNI's byte dot products are what the quantized matmuls use; the AVX-512 CPUs without it (Skylake-SP/X,
  2017) run the avx2 variant;
- "avx2": AVX2 + FMA + F16C.
On a CPU with AMX-BF16 (Intel Sapphire Rapids and later) the avx512 build also multiplies bfloat16 float
weights on AMX tiles (dense_linear_amx.cpp): "amx" below is that mode of the avx512 build, not a build.
Each is its own extension, kvserve_cpu_<isa>, built from every *.cpp in this folder with
-DKVSERVE_NS=kvserve_<isa>, so its ops land in torch.ops.kvserve_<isa> and both variants can be loaded
into one process (the tests compare them with the torch path).

Which one runs: KVSERVE_CPU_ISA=amx|avx512|avx2|none forces one (none: the torch paths only; avx512: that
build without AMX); unset or "auto": the best this CPU supports. A forced ISA this CPU lacks logs a warning
and falls back to the auto choice (loading it would die of an illegal instruction). KVSERVE_CPU_KERNELS=0 is
kept as an alias for none, and wins over KVSERVE_CPU_ISA. Call sites check applies(t), then call ops().<op>(...).

The build is cached by torch (under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), so only the first
process on a machine pays for it (the avx2 variant: ~60 s on the 2-core dev machine; bindings.cpp says why
registration has a file of its own). Its folder is named by what goes into it (sources, flags, torch), and
it compiles copies of the sources kept there: checkouts and venvs that share the cache then share a build,
where one folder per variant made them rebuild it in turn (ninja rebuilds when a compile command changes,
and the source path is part of it). Anything that stops it (no compiler, no supported ISA, a failed build)
leaves the torch paths in place, and is logged once. A build killed part-way does not hold up the
next start (see _build_or_load), and a finished build in a cache this user cannot write is loaded as is.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvserve.utils.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
ISAS = ("avx512", "avx2")  # the builds, best first
MODES = ("amx", *ISAS)  # what KVSERVE_CPU_ISA may ask for, best first
# -fopenmp: at::parallel_for is inlined from ATen's headers as an OpenMP region; without the flag it
# runs on one thread. The library resolves to the libgomp torch has already loaded.
_COMMON_FLAGS = ["-O3", "-fopenmp"]
_ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
# /proc/cpuinfo flags each variant needs; torch's capability names where /proc is absent.
_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "fma", "f16c"},
              "avx2": {"avx2", "fma", "f16c"}}
_CPU_FLAGS["amx"] = _CPU_FLAGS["avx512"] | {"amx_tile", "amx_bf16"}
_TORCH_CAPABILITIES = {"amx": set(), "avx512": {"AVX512"}, "avx2": {"AVX2", "AVX512"}}  # amx: from /proc only


def applies(t: torch.Tensor) -> bool:
    """Whether the kernels can take this tensor: on the CPU, bfloat16 or float32, and built."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32) and available()


def available() -> bool:
    """True once a variant's kernels are registered (building them if need be)."""
    return isa() is not None


@functools.cache
def ops() -> torch._ops._OpNamespace:
    """The torch.ops namespace of the chosen variant (cached: call sites look it up once per layer)."""
    chosen = isa()
    if chosen is None:
        raise RuntimeError("no CPU kernels in this process: check cpu_kernels.applies() first")
    return getattr(torch.ops, namespace(chosen))


@functools.cache
def amx() -> bool:
    """Whether bfloat16 float weights run on AMX tiles (dense_linear_amx.cpp): the avx512 build, on a CPU with
    AMX-BF16 whose tile state Linux grants this process, unless KVSERVE_CPU_ISA asks for avx512 or less."""
    if isa() != "avx512" or requested_isa() not in ("auto", "amx") or not cpu_supports("amx"):
        return False
    if not ops().amx_bf16_ready():
        logger.warning("AMX off: Linux refused this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        return False
    return True


def describe() -> str:
    """The kernels in use, as benchmarks state them: "avx512 + amx", "avx512", "avx2" or "none"."""
    chosen = isa()
    return "none" if chosen is None else f"{chosen} + amx" if amx() else chosen


@functools.cache
def isa() -> str | None:
    """The variant in use ("avx512" or "avx2"), built and registered; None: the torch paths."""
    wanted = requested_isa()
    if wanted == "none":
        logger.info("CPU kernels off (KVSERVE_CPU_ISA=none or KVSERVE_CPU_KERNELS=0)")
        return None
    if wanted != "auto" and not cpu_supports(wanted):
        logger.warning("KVSERVE_CPU_ISA=%s, but this CPU lacks it: choosing the best it supports", wanted)
        wanted = "auto"
    if wanted == "amx":  # a mode of the avx512 build (amx())
        wanted = "avx512"
    candidates = [wanted] if wanted != "auto" else [i for i in ISAS if cpu_supports(i)]
    if not candidates:
        logger.info("CPU kernels off: this CPU has neither AVX-512 nor AVX2 + FMA + F16C")
        return None
    for candidate in candidates:  # a failed build (logged) falls through to the next best
        if build(candidate) is not None:
            return candidate
    return None


def requested_isa() -> str:
    """What the environment asks for: "auto", "none" or one of MODES."""
    if os.environ.get("KVSERVE_CPU_KERNELS", "1") == "0":
        return "none"
    wanted = os.environ.get("KVSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if wanted not in ("auto", "none", *MODES):
        raise ValueError(f"KVSERVE_CPU_ISA={wanted!r}: expected one of auto, none, {', '.join(MODES)}")
    return wanted


@functools.cache
def cpu_supports(isa_name: str) -> bool:
    """Whether this CPU runs the variant: /proc/cpuinfo's flags, else torch's own CPU capability."""
    flags = cpu_flags()
    if flags is not None:
        return _CPU_FLAGS[isa_name] <= flags
    return torch.backends.cpu.get_cpu_capability() in _TORCH_CAPABILITIES[isa_name]


def namespace(isa_name: str) -> str:
    """The torch.ops namespace a variant registers its ops under."""
    return f"kvserve_{isa_name}"


def sources() -> list[Path]:
    """Every .cpp here goes into every variant: a new kernel file joins the build by being here, and its
    ops reach torch.ops once bindings.cpp registers them (declared in ops.h)."""
    return sorted(_DIR.glob("*.cpp"))


def _read_sources() -> dict[str, bytes]:
    """The sources and headers, read once: the digest and the build's copies must be the same bytes."""
    return {f.name: f.read_bytes() for f in sorted(_DIR.glob("*.[ch]*"))}


def _digest(files: dict[str, bytes]) -> str:
    return hashlib.sha256(b"".join(files.values())).hexdigest()[:16]


def compile_flags(isa_name: str, digest: str | None = None) -> list[str]:
    # torch rebuilds when the sources or flags change, not the headers: the digest flag covers them.
    digest = digest or _digest(_read_sources())
    return _COMMON_FLAGS + _ISA_FLAGS[isa_name] + [f"-DKVSERVE_NS={namespace(isa_name)}",
                                                   f"-DKVSERVE_SOURCES_DIGEST={digest}"]


@functools.cache
def build(isa_name: str) -> torch._ops._OpNamespace | None:
    """Build (or load from torch's cache) one variant and register its ops: its torch.ops namespace, or
    None where the build failed (logged). Refuses a variant this CPU cannot run: loading it could
    already execute its instructions (static initialisers are compiled with the same flags)."""
    if not cpu_supports(isa_name):
        raise ValueError(f"this CPU cannot run the {isa_name} kernels")
    try:
        _put_ninja_on_path()
        files = _read_sources()
        flags = compile_flags(isa_name, _digest(files))
        build_dir = _build_directory(isa_name, flags)
        _build_or_load(isa_name, files, flags, build_dir)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        logger.warning("CPU kernels (%s) off, the build failed: %s", isa_name,
                       str(e).strip().splitlines()[-1] if str(e) else e)
        return None
    ops_ns = getattr(torch.ops, namespace(isa_name))
    return ops_ns if hasattr(ops_ns, "paged_attention_") and hasattr(ops_ns, "silu_and_mul") else None


def _build_or_load(isa_name: str, files: dict[str, bytes], flags: list[str], build_dir: Path) -> None:
    """torch's load() under a lock of our own. torch guards a build with a lock *file* that it takes even to
    load a finished build, and a process killed while building (the OOM killer, a CI timeout) leaves that
    file behind: every later start then waited on it for good, silently. An flock dies with its holder, so
    whoever holds ours knows a leftover torch lock file is stale and removes it."""
    from torch.utils.cpp_extension import load

    library = build_dir / f"kvserve_cpu_{isa_name}.so"
    try:
        lock_file = open(build_dir / "kvserve.lock", "a")  # noqa: SIM115 (held until the build is loaded)
    except OSError:
        if not library.exists():
            raise
        # A finished build in a cache this user cannot write (an image built by another user): load it as
        # is. Its folder is named by the sources' digest, the flags and torch, so it is this build.
        torch.ops.load_library(str(library))
        return
    with lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("CPU kernels (%s): waiting for another process's build in %s", isa_name, build_dir)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)  # ours is held: a torch lock file here is a dead build's
        load(name=f"kvserve_cpu_{isa_name}", sources=_stage_sources(files, build_dir / "src"),
             extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
             build_directory=str(build_dir), verbose=False)


def _build_directory(isa_name: str, flags: list[str]) -> Path:
    """torch's folder for the variant, named by the flags (the sources' digest among them) and this torch."""
    from torch.utils.cpp_extension import _get_build_directory

    key = hashlib.sha256("\0".join([*flags, torch.__version__, str(Path(torch.__file__).parent)]).encode())
    return Path(_get_build_directory(f"kvserve_cpu_{isa_name}_{key.hexdigest()[:12]}", verbose=False))


def _stage_sources(files: dict[str, bytes], into: Path) -> list[str]:
    """Copies of the sources at a path that depends only on their contents. A copy already there is kept
    as is (same name, same folder key: same bytes), so its mtime stays older than the objects."""
    into.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        dst = into / name
        if not dst.exists():
            tmp = into / f".{name}.{os.getpid()}.tmp"  # processes starting together: whole files only
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return [str(into / name) for name in files if name.endswith(".cpp")]


def compile_only(isa_name: str, out_dir: Path) -> list[Path]:
    """Compile every source of a variant to an object file in out_dir without linking or loading it, so
    a machine without that ISA still checks that it builds. Raises CalledProcessError on a compile error."""
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX", "c++")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in include_paths()]
    # -O0 last: a variant's errors (syntax, templates, an intrinsic its -m flags lack: always_inline's
    # "target specific option mismatch") are reported at any level, and the check took 90 s instead of
    # 167 s for the AVX-512 variant on a 2-core Zen 3, the suite's slowest test.
    flags = compile_flags(isa_name) + ["-O0"]

    def compile_one(src: Path) -> Path:
        obj = Path(out_dir) / f"{src.stem}.{isa_name}.o"
        subprocess.run([cxx, "-std=c++20", "-fPIC", abi, *includes, *flags, "-c", str(src), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        return obj

    # One compiler per core, as ninja runs the real build (the first error raises, as before).
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, sources()))


def have_compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv used without activating it has the wheel's ninja off PATH."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
